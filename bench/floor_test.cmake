# eo-bench refuses an offloaded row that is faster than its transfer floor: at 1e-6 GB/s the
# tiny model's staged bytes would take far longer than its steps did. The resident row (no
# staged bytes, no floor) of the same run is printed as a result.
execute_process(COMMAND ${BENCH} --model ${MODEL} --points 64x1 --steps 1 --warmup 2 --modes resident,prefetch
                        --h2d-gbps 0.000001 --workdir ${WORK}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "eo-bench exited 0 with a row below its floor:\n${out}\n${err}")
endif()
if(NOT out MATCHES "\\| prefetch \\| error: refused: [0-9.]+ s/step \\(fastest step [0-9.]+ s\\) is below this row's transfer floor")
  message(FATAL_ERROR "the prefetch row was not refused for its floor:\n${out}\n${err}")
endif()
if(NOT out MATCHES "\\| resident \\| [0-9.]+ \\|")
  message(FATAL_ERROR "the resident row (no floor) was not printed as a result:\n${out}\n${err}")
endif()
