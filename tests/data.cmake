# tools/tokenize_data.py, tested offline with a tiny tokenizer built at test time (tests/ref/test_tokenize.py).
add_test(NAME data_tokenize_py
         COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/test_tokenize.py
                 ${PROJECT_SOURCE_DIR}/tools/tokenize_data.py ${CMAKE_CURRENT_BINARY_DIR}/data_tokenize)
set_tests_properties(data_tokenize_py PROPERTIES LABELS unit TIMEOUT 600
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1")
# The axolotl dataset formats (issue #16): eo-ddp preprocess / train against transformers'
# apply_chat_template and an independent reference of axolotl's masking rules; cache reuse and
# rebuild; pre-tokenized data with no Python; eval loss == eo-ddp score (tests/ref/data_formats_ref.py).
add_test(NAME data_formats_ref
         COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/data_formats_ref.py $<TARGET_FILE:eo-ddp> ${PROJECT_SOURCE_DIR}
                 ${CMAKE_CURRENT_BINARY_DIR}/data_formats_ref)
set_tests_properties(data_formats_ref PROPERTIES LABELS ref TIMEOUT 900
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;OMP_NUM_THREADS=1"
                     PASS_REGULAR_EXPRESSION "data_formats_ref: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
