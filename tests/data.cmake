# tools/tokenize_data.py, tested offline with a tiny tokenizer built at test time (tests/ref/test_tokenize.py).
add_test(NAME data_tokenize_py
         COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/test_tokenize.py
                 ${PROJECT_SOURCE_DIR}/tools/tokenize_data.py ${CMAKE_CURRENT_BINARY_DIR}/data_tokenize)
set_tests_properties(data_tokenize_py PROPERTIES LABELS unit TIMEOUT 600
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1")
