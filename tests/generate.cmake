# `eo-ddp generate` (issue #47): greedy ids equal transformers' generate on the tiny model, with and
# without an adapter, fp32 CPU; the streamed text, the rates, seeded sampling (tests/ref/generate_ref.py).
add_test(NAME generate_ref
         COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/generate_ref.py $<TARGET_FILE:eo-ddp> ${PROJECT_SOURCE_DIR}
                 ${CMAKE_CURRENT_BINARY_DIR}/generate_ref)
set_tests_properties(generate_ref PROPERTIES LABELS ref TIMEOUT 600
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;OMP_NUM_THREADS=1")
# The kv cache in every attention form (GQA, partial RoPE, latent attention, sinks and sliding windows,
# chunked and NoPE layers, delta-rule state) against transformers' generate, and expert offload changing
# no token (tests/ref/generate_kv_ref.py).
add_test(NAME generate_kv_ref
         COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/generate_kv_ref.py $<TARGET_FILE:eo-ddp> ${PROJECT_SOURCE_DIR}
                 ${CMAKE_CURRENT_BINARY_DIR}/generate_kv_ref)
set_tests_properties(generate_kv_ref PROPERTIES LABELS ref TIMEOUT 900
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;OMP_NUM_THREADS=1")
# The cache against the whole-sequence forward at every position, each attention form, fp32 (gtest,
# on tests/ref/model_ref.py's fixtures).
eo_unit_test(test_kv_cache SOURCES test_kv_cache.cpp LIBS eo_models)
