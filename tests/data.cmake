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
# axolotl's named chat templates (issue #31): eo-ddp preprocess with chatml, qwen3, deepseek_v2/v3,
# gemma4, llama4 against their jinja (tools/chat_templates, copied from axolotl 0.19.0) rendered
# with jinja2 and axolotl 0.19's find_turn labelling, on the same rows (tests/ref/chat_templates_ref.py).
add_test(NAME chat_templates_ref
         COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/chat_templates_ref.py $<TARGET_FILE:eo-ddp> ${PROJECT_SOURCE_DIR}
                 ${CMAKE_CURRENT_BINARY_DIR}/chat_templates_ref)
set_tests_properties(chat_templates_ref PROPERTIES LABELS ref TIMEOUT 600
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;OMP_NUM_THREADS=1"
                     PASS_REGULAR_EXPRESSION "chat_templates_ref: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
# A parquet dataset gives the same token ids and labels as the same rows in JSON lines (and as
# transformers' own tokenisation), and trains (tests/parquet_jsonl.py).
add_test(NAME parquet_jsonl
         COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/parquet_jsonl.py $<TARGET_FILE:eo-ddp> ${PROJECT_SOURCE_DIR}
                 ${CMAKE_CURRENT_BINARY_DIR}/parquet_jsonl)
set_tests_properties(parquet_jsonl PROPERTIES LABELS unit TIMEOUT 600
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;OMP_NUM_THREADS=1"
                     PASS_REGULAR_EXPRESSION "parquet_jsonl: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
