# Fault injection (issue #8 item 3): disk full during a save, NaN/Inf steps, too little host RAM
# for the expert homes, bad data — each a clear message, a non-zero exit in bounded time and no
# corrupted output. Single-rank cases run as unit tests; the 2-rank NaN cases run mpirun (mpi).
eo_test(test_faults SOURCES test_faults.cpp LIBS eo_runtime)
add_dependencies(test_faults eo-ddp eo-ddp-faults)
gtest_discover_tests(test_faults PROPERTIES LABELS unit TIMEOUT 600 DISCOVERY_TIMEOUT 60
                     SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
eo_test(test_faults_mpi SOURCES test_faults_mpi.cpp LIBS eo_runtime)
target_compile_definitions(test_faults_mpi PRIVATE EO_MPIEXEC="${MPIEXEC_EXECUTABLE}")
add_dependencies(test_faults_mpi eo-ddp eo-ddp-faults)
add_test(NAME test_faults_mpi COMMAND test_faults_mpi)
set_tests_properties(test_faults_mpi PROPERTIES LABELS mpi TIMEOUT 600 ENVIRONMENT "${EO_MPI_ENV}")
