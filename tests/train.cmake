# Single-rank training tests (tests/test_train.cpp runs the eo-ddp binary) and the peft check:
# tests/ref/train_peft_check.py trains a short adapter with eo-ddp, loads it with transformers +
# peft and compares the loss with `eo-ddp score`.
add_dependencies(test_train eo-ddp)
add_test(NAME train_peft_check
         COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/train_peft_check.py
                 $<TARGET_FILE:eo-ddp> ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_BINARY_DIR}/train_peft)
set_tests_properties(train_peft_check PROPERTIES LABELS ref TIMEOUT 600
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;OMP_NUM_THREADS=1")
