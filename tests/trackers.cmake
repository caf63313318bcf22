# Trackers (issue #47): TensorBoard events read back by tensorboard's EventAccumulator, a W&B offline
# run's history, and a W&B that fails or hangs leaving training unchanged (tests/ref/trackers_ref.py).
add_test(NAME trackers_ref
         COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/trackers_ref.py $<TARGET_FILE:eo-ddp> ${PROJECT_SOURCE_DIR}
                 ${CMAKE_CURRENT_BINARY_DIR}/trackers_ref)
set_tests_properties(trackers_ref PROPERTIES LABELS ref TIMEOUT 900
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;OMP_NUM_THREADS=1;WANDB_SILENT=true")
