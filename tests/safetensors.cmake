# test_safetensors extras: the Python reference stack for interchange tests. (The sanitizer run,
# every unit and mpi test under ASan + UBSan, is scripts/sanitize, called by CI after the tests.)
