# Decoder parity against transformers / peft / bitsandbytes (tests/test_model.cpp).
# The reference fixtures (tiny checkpoints, adapters, expected outputs) are generated at test
# time by tests/ref/model_ref.py into ${PROJECT_BINARY_DIR}/tests/model_ref/<arch>/.
target_link_libraries(test_model PRIVATE eo_runtime nlohmann_json::nlohmann_json)  # runtime/data/jsonl
add_dependencies(test_model eo-ddp)  # the score tests run the binary

set(EO_MODEL_REF_ROOT ${PROJECT_BINARY_DIR}/tests/model_ref)
file(MAKE_DIRECTORY ${EO_MODEL_REF_ROOT})  # flock needs the folder for its lock file
# glm4_moe / DeepSeek / glm4_moe_lite: each family and a variant with its unusual options on
# (tools/make_tiny_model.py); mistral4 in its variant only (its base layout's switches are each
# covered by another fixture: low-rank q with interleaved RoPE, YaRN with mscale = mscale_all_dim), and
# inside Mistral 3's multimodal wrapper as the Hub ships Mistral Small 4 (mistral4_mm).
foreach(arch qwen3_moe olmoe mixtral qwen2_moe glm4_moe glm4_moe_grouped deepseek_v2 deepseek_v2_grouped deepseek_v3
        deepseek_v3_yarn gpt_oss glm4_moe_lite glm4_moe_lite_grouped mistral4_scaled mistral4_mm gemma4 gemma4_kv llama4
        qwen3_next qwen3_5_moe_mm minimax_m2 ernie4_5_moe hunyuan_v1_moe)
  add_test(NAME model_ref_${arch}
           COMMAND flock ${EO_MODEL_REF_ROOT}/${arch}.lock ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/model_ref.py ${arch} ${EO_MODEL_REF_ROOT})
  set_tests_properties(model_ref_${arch} PROPERTIES LABELS ref TIMEOUT 600 FIXTURES_SETUP model_ref
                       ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1")
endforeach()
# The whole gtest binary against the fresh fixtures (the per-case `unit` registrations reuse them,
# or generate them under a lock on first use).
add_test(NAME model_parity COMMAND test_model)
set_tests_properties(model_parity PROPERTIES LABELS ref TIMEOUT 1200 FIXTURES_REQUIRED model_ref)
# gpt-oss MXFP4 experts against transformers' dequantiser (tests/ref/mxfp4_ref.py).
add_test(NAME mxfp4_ref_gpt_oss
         COMMAND flock ${PROJECT_BINARY_DIR}/tests/mxfp4_ref/gpt_oss.lock ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/mxfp4_ref.py gpt_oss ${PROJECT_BINARY_DIR}/tests/mxfp4_ref)
set_tests_properties(mxfp4_ref_gpt_oss PROPERTIES LABELS ref TIMEOUT 600 FIXTURES_SETUP model_ref
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1")
file(MAKE_DIRECTORY ${PROJECT_BINARY_DIR}/tests/mxfp4_ref)
# NVFP4 (modelopt) checkpoints against the float64 decode and transformers / peft on the decoded
# weights (tests/ref/nvfp4_ref.py).
add_test(NAME nvfp4_ref_qwen3_moe
         COMMAND flock ${PROJECT_BINARY_DIR}/tests/nvfp4_ref/qwen3_moe.lock ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/nvfp4_ref.py qwen3_moe ${PROJECT_BINARY_DIR}/tests/nvfp4_ref)
set_tests_properties(nvfp4_ref_qwen3_moe PROPERTIES LABELS ref TIMEOUT 600 FIXTURES_SETUP model_ref
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1")
file(MAKE_DIRECTORY ${PROJECT_BINARY_DIR}/tests/nvfp4_ref)
# nvfp4_merge_aware against axolotl's merge-aware forward and torchao's quantiser, both written from
# their definitions (tests/ref/nvfp4_merge_ref.py).
add_test(NAME nvfp4_merge_ref_qwen3_moe
         COMMAND flock ${PROJECT_BINARY_DIR}/tests/nvfp4_merge_ref/qwen3_moe.lock ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/nvfp4_merge_ref.py qwen3_moe ${PROJECT_BINARY_DIR}/tests/nvfp4_merge_ref)
set_tests_properties(nvfp4_merge_ref_qwen3_moe PROPERTIES LABELS ref TIMEOUT 900 FIXTURES_SETUP model_ref
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1")
file(MAKE_DIRECTORY ${PROJECT_BINARY_DIR}/tests/nvfp4_merge_ref)

# The real shapes of issue 46's families (configs/models; Qwen3.5's inside its multimodal wrapper):
# `eo-ddp plan` reads their config.json as the Hub ships it and plans an offloaded QLoRA run of them.
foreach(shape ernie-4.5-21b-a3b hunyuan-a13b qwen3-next-80b-a3b qwen3.5-35b-a3b)
  add_test(NAME plan_shape_${shape}
           COMMAND $<TARGET_FILE:eo-ddp> plan --config ${PROJECT_SOURCE_DIR}/configs/bench/qwen3-30b-a3b-offload.yaml
                   --set base_model=${PROJECT_SOURCE_DIR}/configs/models/${shape})
  set_tests_properties(plan_shape_${shape} PROPERTIES LABELS unit TIMEOUT 60 PASS_REGULAR_EXPRESSION "peak VRAM +[0-9.]+ GiB")
endforeach()
