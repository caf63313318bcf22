# Runs `MPIEXEC -n NP --oversubscribe EXE ARG` and passes only if it exits non-zero within LIMIT
# seconds and its output matches EXPECT (a regex): a failed rank must end the whole job, quickly.
string(TIMESTAMP t0 "%s")
execute_process(COMMAND ${MPIEXEC} -n ${NP} --oversubscribe ${EXE} ${ARG}
                TIMEOUT ${LIMIT} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(TIMESTAMP t1 "%s")
math(EXPR took "${t1} - ${t0}")
message("exit: ${rc} after ${took} s\n--- output ---\n${out}${err}")
if(NOT rc MATCHES "^[0-9]+$")
  message(FATAL_ERROR "the job did not end by itself within ${LIMIT} s (${rc})")
endif()
if(rc EQUAL 0)
  message(FATAL_ERROR "the job exited 0 although a rank failed")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT}")
  message(FATAL_ERROR "the output does not name the fault (expected /${EXPECT}/)")
endif()
