# NF4 parity fixtures: bitsandbytes (venv, CPU) writes reference tensors into the build folder
# before any NF4 gtest runs (CTest fixture), so nothing large is committed.
add_test(NAME nf4_fixtures
         COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/nf4_fixtures.py
                 ${CMAKE_CURRENT_BINARY_DIR}/nf4_fixtures.safetensors)
set_tests_properties(nf4_fixtures PROPERTIES FIXTURES_SETUP nf4_fixtures LABELS unit TIMEOUT 600)

# The gtest cases are discovered at test time; this file, included by CTest after the discovery
# file, makes each of them require the fixture.
set(EO_NF4_PROPS ${CMAKE_CURRENT_BINARY_DIR}/nf4_properties.cmake)
file(WRITE ${EO_NF4_PROPS} [=[
foreach(t IN LISTS test_nf4_TESTS)
  set_tests_properties("${t}" PROPERTIES FIXTURES_REQUIRED nf4_fixtures)
endforeach()
]=])
set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${EO_NF4_PROPS})
