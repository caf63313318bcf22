# Offloaded training end to end on the CPU build: equality with resident training, staging counts,
# pageable homes, and the error for a model without expert blocks (tests/offload_train.sh).
add_test(NAME offload_train COMMAND ${PROJECT_SOURCE_DIR}/tests/offload_train.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
set_tests_properties(offload_train PROPERTIES LABELS unit TIMEOUT 600
                     PASS_REGULAR_EXPRESSION "offload_train: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
# The same equality for glm4_moe and DeepSeek (tests/offload_arch.sh).
add_test(NAME offload_arch COMMAND ${PROJECT_SOURCE_DIR}/tests/offload_arch.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
set_tests_properties(offload_arch PROPERTIES LABELS unit TIMEOUT 900
                     PASS_REGULAR_EXPRESSION "offload_arch: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
# Disk homes below the engine: the file, its checks, a full drive, the read ring (test_disk_homes.cpp).
eo_unit_test(test_disk_homes SOURCES test_disk_homes.cpp LIBS eo_runtime)
# expert_offload_homes: disk end to end, one rank: bitwise, reuse, rebuilds, full and read-only
# drives, config errors (tests/disk_homes.sh; 2 and 3 ranks in mpi_train.sh).
add_test(NAME disk_homes COMMAND ${PROJECT_SOURCE_DIR}/tests/disk_homes.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
set_tests_properties(disk_homes PROPERTIES LABELS unit TIMEOUT 600
                     PASS_REGULAR_EXPRESSION "disk_homes: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
