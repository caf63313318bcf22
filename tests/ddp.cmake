# Data-parallel reduction (runtime/ddp/comm, reducer): the gtest suite under mpirun with 2 and 3
# (oversubscribed) ranks and as a world of one, plus fault runs that must end the whole job.
eo_mpi_test(test_ddp 2 SOURCES test_ddp.cpp LIBS eo_runtime)
eo_mpi_test(test_ddp 3 SOURCES test_ddp.cpp LIBS eo_runtime)
add_test(NAME test_ddp_world_of_one COMMAND test_ddp)
set_tests_properties(test_ddp_world_of_one PROPERTIES LABELS unit TIMEOUT 300)

# A rank that throws before its all-reduce, or hangs past ddp_timeout (3 s here), must make
# mpirun exit non-zero within the limit, with a message naming the fault.
function(eo_ddp_fault_test mode ranks expect)
  add_test(NAME test_ddp_fault_${mode}_np${ranks}
           COMMAND ${CMAKE_COMMAND} -DMPIEXEC=${MPIEXEC_EXECUTABLE} -DNP=${ranks} -DEXE=$<TARGET_FILE:test_ddp>
                   -DARG=--fault=${mode} -DLIMIT=90 "-DEXPECT=${expect}"
                   -P ${CMAKE_CURRENT_SOURCE_DIR}/ddp_expect_abort.cmake)
  set_tests_properties(test_ddp_fault_${mode}_np${ranks} PROPERTIES LABELS mpi TIMEOUT 120 ENVIRONMENT "${EO_MPI_ENV}")
endfunction()
eo_ddp_fault_test(throw 2 "rank 1: injected fault on rank 1 before its all-reduce")
eo_ddp_fault_test(hang 2 "rank 0: all-reduce of gradient bucket 0 .* did not complete within 3 s")
eo_ddp_fault_test(hang 3 "rank [01]: all-reduce of gradient bucket 0 .* did not complete within 3 s")

# Data-parallel training through mpirun and the eo-ddp binary (equivalence, identical LoRA,
# collective bytes, failing ranks): tests/mpi_train.sh.
add_test(NAME mpi_train COMMAND ${PROJECT_SOURCE_DIR}/tests/mpi_train.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
set_tests_properties(mpi_train PROPERTIES LABELS mpi TIMEOUT 900 ENVIRONMENT "${EO_MPI_ENV}"
                     PASS_REGULAR_EXPRESSION "mpi_train: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")

# Ranks given different configs stop before loading, naming the key (tests/rank_agreement.sh).
add_test(NAME rank_agreement COMMAND ${PROJECT_SOURCE_DIR}/tests/rank_agreement.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
set_tests_properties(rank_agreement PROPERTIES LABELS mpi TIMEOUT 600 ENVIRONMENT "${EO_MPI_ENV}"
                     PASS_REGULAR_EXPRESSION "rank_agreement: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")

# fp16: an overflow on one rank is every rank's skipped step (tests/fp16_mpi.sh).
add_test(NAME fp16_mpi COMMAND ${PROJECT_SOURCE_DIR}/tests/fp16_mpi.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
set_tests_properties(fp16_mpi PROPERTIES LABELS mpi TIMEOUT 600 ENVIRONMENT "${EO_MPI_ENV}"
                     PASS_REGULAR_EXPRESSION "fp16_mpi: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
