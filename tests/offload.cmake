# Offloaded training end to end on the CPU build: equality with resident training, staging counts,
# pageable homes, and the error for a model without expert blocks (tests/offload_train.sh).
add_test(NAME offload_train COMMAND ${PROJECT_SOURCE_DIR}/tests/offload_train.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
set_tests_properties(offload_train PROPERTIES LABELS unit TIMEOUT 600
                     PASS_REGULAR_EXPRESSION "offload_train: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
# The same equality for glm4_moe and DeepSeek (tests/offload_arch.sh).
# Three tests of a few families each, so that ctest -j spreads them over the cores; COST starts
# them first (they are the longest unit tests).
set(EO_OFFLOAD_ARCH_GROUPS
    "glm_deepseek=glm4_moe_grouped deepseek_v2_grouped deepseek_v3_yarn glm4_moe_lite_grouped"
    "mistral_gemma=mistral4_scaled mistral4_mm gemma4 gemma4_params"
    "llama_gpt_oss=llama4 gpt_oss gpt_oss_mxfp4"
    "delta_rule=qwen3_next"
    "ernie_hunyuan=ernie4_5_moe hunyuan_v1_moe")
foreach(group ${EO_OFFLOAD_ARCH_GROUPS})
  string(REGEX MATCH "^[a-z_]+" name "${group}")
  string(REGEX REPLACE "^[a-z_]+=" "" archs "${group}")
  add_test(NAME offload_arch_${name} COMMAND ${PROJECT_SOURCE_DIR}/tests/offload_arch.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
  set_tests_properties(offload_arch_${name} PROPERTIES LABELS unit TIMEOUT 900 COST 100 ENVIRONMENT "EO_OFFLOAD_ARCHS=${archs}"
                       PASS_REGULAR_EXPRESSION "offload_arch: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
endforeach()
# Disk homes below the engine: the file, its checks, a full drive, the read ring (test_disk_homes.cpp).
eo_unit_test(test_disk_homes SOURCES test_disk_homes.cpp LIBS eo_runtime)
# expert_offload_homes: disk end to end, one rank: bitwise, reuse, rebuilds, full and read-only
# drives, config errors (tests/disk_homes.sh; 2 and 3 ranks in mpi_train.sh).
add_test(NAME disk_homes COMMAND ${PROJECT_SOURCE_DIR}/tests/disk_homes.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
set_tests_properties(disk_homes PROPERTIES LABELS unit TIMEOUT 600
                     PASS_REGULAR_EXPRESSION "disk_homes: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
# The experts' LoRA state on the host (expert_lora_offload) trains bitwise as on the device: 10
# steps with clipping, resumes both ways, 1 and 2 ranks (tests/expert_lora_offload.sh).
add_test(NAME expert_lora_offload COMMAND ${PROJECT_SOURCE_DIR}/tests/expert_lora_offload.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
set_tests_properties(expert_lora_offload PROPERTIES LABELS mpi TIMEOUT 900 PROCESSORS 2
                     PASS_REGULAR_EXPRESSION "expert_lora_offload: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
