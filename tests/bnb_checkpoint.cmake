# Loading bitsandbytes pre-quantised checkpoints (tests/test_bnb_checkpoint.cpp). The fixtures
# (quantised tiny checkpoints and transformers' reference logits) are generated at test time by
# tests/ref/bnb_checkpoint_ref.py into ${PROJECT_BINARY_DIR}/tests/bnb_checkpoint_ref/<arch>/.
eo_unit_test(test_bnb_checkpoint SOURCES test_bnb_checkpoint.cpp LIBS eo_models)

set(EO_BNB_REF_ROOT ${PROJECT_BINARY_DIR}/tests/bnb_checkpoint_ref)
file(MAKE_DIRECTORY ${EO_BNB_REF_ROOT})  # flock needs the folder for its lock file
foreach(arch qwen3_moe mixtral qwen2_moe)
  add_test(NAME bnb_checkpoint_ref_${arch}
           COMMAND flock ${EO_BNB_REF_ROOT}/${arch}.lock ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/bnb_checkpoint_ref.py ${arch} ${EO_BNB_REF_ROOT})
  set_tests_properties(bnb_checkpoint_ref_${arch} PROPERTIES LABELS ref TIMEOUT 600 FIXTURES_SETUP bnb_checkpoint_ref
                       ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1")
endforeach()
# The whole gtest binary against the fresh fixtures.
add_test(NAME bnb_checkpoint_parity COMMAND test_bnb_checkpoint)
set_tests_properties(bnb_checkpoint_parity PROPERTIES LABELS ref TIMEOUT 1200 FIXTURES_REQUIRED bnb_checkpoint_ref)
