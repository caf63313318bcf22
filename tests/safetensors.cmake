# test_safetensors extras: the Python reference stack for interchange tests, and the
# sanitizer run (its own ASan/UBSan build folder, so it is slow: it compiles).
target_compile_definitions(test_safetensors PRIVATE EO_PYTHON="${EO_PYTHON}")

add_test(NAME sanitize_safetensors COMMAND ${PROJECT_SOURCE_DIR}/scripts/sanitize)
set_tests_properties(sanitize_safetensors PROPERTIES LABELS "unit;asan" TIMEOUT 3600)
