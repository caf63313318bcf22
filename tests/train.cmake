# Single-rank training tests (tests/test_train.cpp runs the eo-ddp binary) and the peft check:
# tests/ref/train_peft_check.py trains a short adapter with eo-ddp, loads it with transformers +
# peft and compares the loss with `eo-ddp score`.
add_dependencies(test_train eo-ddp eo-ddp-faults)
add_dependencies(test_fp16 eo-ddp eo-ddp-faults)
add_test(NAME train_peft_check
         COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/train_peft_check.py
                 $<TARGET_FILE:eo-ddp> ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_BINARY_DIR}/train_peft)
set_tests_properties(train_peft_check PROPERTIES LABELS ref TIMEOUT 600
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;OMP_NUM_THREADS=1")
# peft_layers_to_transform (issue #31): LoRA on layers 1 and 3 only; the modules the adapter holds
# are those peft's own matching selects, and it loads and scores the same in peft.
add_test(NAME train_peft_check_layers
         COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/train_peft_check.py
                 $<TARGET_FILE:eo-ddp> ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_BINARY_DIR}/train_peft_layers --layers 1,3)
set_tests_properties(train_peft_check_layers PROPERTIES LABELS ref TIMEOUT 600
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;OMP_NUM_THREADS=1")
# The same for Mistral Small 4's family (latent attention; no auto class in transformers 5.24),
# GLM-4.7-Flash's (latent attention, a dense layer before the sparse ones), and Gemma 4, Mistral
# Small 4 and Llama 4 as the Hub ships them (multimodal wrappers: the text model
# trained, the vision tower not).
# Qwen3-Next and Qwen3.5-MoE (its multimodal wrapper): LoRA on the gated delta-rule layers' projections.
# ERNIE-4.5-MoE (tied embeddings, dense layers around the sparse ones), Hunyuan-MoE (q/k norms after RoPE).
foreach(arch mistral4_scaled glm4_moe_lite_grouped gemma4_mm mistral4_mm llama4_mm qwen3_next qwen3_5_moe_mm ernie4_5_moe
        hunyuan_v1_moe)
  add_test(NAME train_peft_check_${arch}
           COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/train_peft_check.py
                   $<TARGET_FILE:eo-ddp> ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_BINARY_DIR}/train_peft_${arch} ${arch})
  set_tests_properties(train_peft_check_${arch} PROPERTIES LABELS ref TIMEOUT 600
                       ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;OMP_NUM_THREADS=1")
endforeach()
# lora_target_parameters (issue #16 item 5): the fused expert LoRA eo-ddp trains is the adapter
# peft's ParamWrapper saves and loads (keys, shapes, config), and means the same loss there.
add_test(NAME train_peft_fused_check
         COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/train_peft_fused_check.py
                 $<TARGET_FILE:eo-ddp> ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_BINARY_DIR}/train_peft_fused)
set_tests_properties(train_peft_fused_check PROPERTIES LABELS ref TIMEOUT 600
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;OMP_NUM_THREADS=1")
# The same on Gemma 4 (its experts are layers.{i}.experts: target_parameters experts.*) and Mistral
# Small 4, both as the Hub ships them (multimodal wrappers), GLM-4.5, DeepSeek V2 / V3, gpt-oss
# (gate and up interleaved in [E, H, 2I]) and Llama 4 (peft's factors on swapped sides).
foreach(arch gemma4_mm mistral4_mm glm4_moe deepseek_v2 deepseek_v3 gpt_oss llama4)
  add_test(NAME train_peft_fused_check_${arch}
           COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/train_peft_fused_check.py
                   $<TARGET_FILE:eo-ddp> ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_BINARY_DIR}/train_peft_fused_${arch} ${arch})
  set_tests_properties(train_peft_fused_check_${arch} PROPERTIES LABELS ref TIMEOUT 600
                       ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;OMP_NUM_THREADS=1")
endforeach()
# The step's schedule end to end: layer-major == micro-batch-major bitwise for g = 1, 2, 4 with and
# without offload, staged bytes per step <= 2 x expert bytes (tests/schedule_train.sh).
add_test(NAME schedule_train COMMAND ${PROJECT_SOURCE_DIR}/tests/schedule_train.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
set_tests_properties(schedule_train PROPERTIES LABELS unit TIMEOUT 900
                     PASS_REGULAR_EXPRESSION "schedule_train: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
# Every command README.md and docs/*.md show, run as shown on the tiny model or listed with the test
# that covers it; the pages' lengths, widths, links and generated reference (tests/docs_commands.sh,
# tests/docs_check.py).
add_test(NAME docs_commands COMMAND ${PROJECT_SOURCE_DIR}/tests/docs_commands.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
set_tests_properties(docs_commands PROPERTIES LABELS unit TIMEOUT 900 ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1"
                     PASS_REGULAR_EXPRESSION "docs_commands: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
# The mission's command (issue #16): cmake --install to a temporary prefix, then from another folder
# mpirun -np 2 eo-ddp --config qwen3-moe.yaml (a copy pointed at the tiny model and a chat JSONL).
add_test(NAME install_mission COMMAND ${PROJECT_SOURCE_DIR}/tests/install_mission.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
set_tests_properties(install_mission PROPERTIES LABELS mpi TIMEOUT 900 ENVIRONMENT "${EO_MPI_ENV}"
                     PASS_REGULAR_EXPRESSION "install_mission: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
# axolotl-style configs of every architecture, only base_model and data replaced: each passes
# --check and trains 3 steps, or is refused for its in-scope rejection (tests/axolotl_examples.sh).
add_test(NAME axolotl_examples COMMAND ${PROJECT_SOURCE_DIR}/tests/axolotl_examples.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
set_tests_properties(axolotl_examples PROPERTIES LABELS ref TIMEOUT 600
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1"
                     PASS_REGULAR_EXPRESSION "axolotl_examples: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
# axolotl 0.19.0's own example configs on the architectures eo-ddp trains (tests/axolotl_examples/upstream):
# each passes --check and trains 3 steps, or is refused with exactly the reasons expect.tsv lists.
# Split by the corpus's folders into four tests that ctest -j runs side by side (COST: first).
foreach(group "a=archived/ deepseek-v2/ expert_parallel/ gemma4/ glm45/ glm47-flash/" "b=gpt-oss/ llama-4/"
              "c=mistral/ mistral4/ qwen3/" "d=qwen3-next/ qwen3.5/ minimax/")
  string(SUBSTRING "${group}" 0 1 name)
  string(SUBSTRING "${group}" 2 -1 folders)
  add_test(NAME axolotl_upstream_${name} COMMAND ${PROJECT_SOURCE_DIR}/tests/axolotl_upstream.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
  set_tests_properties(axolotl_upstream_${name} PROPERTIES LABELS ref TIMEOUT 900 COST 100
                       ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;EO_UPSTREAM_ONLY=${folders}"
                       PASS_REGULAR_EXPRESSION "axolotl_upstream: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
endforeach()
# axolotl's NVFP4 example on a tiny NVFP4 (modelopt) checkpoint: as written (nvfp4_merge_aware) --check
# passes, `eo-ddp plan` counts NVFP4 experts and 3 steps train snapped; nvfp4_merge_aware_start_step's
# schedule against plain LoRA, the adapter_config.json stamp, and the refusals.
add_test(NAME nvfp4_train COMMAND ${PROJECT_SOURCE_DIR}/tests/nvfp4_train.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR} ${EO_PYTHON})
set_tests_properties(nvfp4_train PROPERTIES LABELS ref TIMEOUT 600
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1"
                     PASS_REGULAR_EXPRESSION "nvfp4_train: all checks passed" FAIL_REGULAR_EXPRESSION "FAILED")
