# `eo-ddp merge` (issue #47): the merged folder loads in transformers with no missing or unexpected
# key and means what the adapter means (tests/ref/merge_ref.py), per LoRA form and family; a
# many-shard base merges within two shards of host memory (tests/ref/merge_streaming.py).
# FORM or FORM:ARCH (a tools/make_tiny_model.py --arch name; none: the bundled tiny Qwen3-MoE).
set(_eo_merge_cases attn experts fused experts:mixtral experts:glm4_moe_lite_grouped experts:mistral4_scaled
    attn:gemma4_mm attn:mistral4_mm attn:llama4_mm fused:gemma4_mm fused:mistral4_mm fused:glm4_moe
    fused:deepseek_v2 fused:deepseek_v3 fused:gpt_oss fused:gpt_oss_mxfp4 fused:llama4 experts:ernie4_5_moe
    attn:hunyuan_v1_moe)
foreach(_case ${_eo_merge_cases})
  string(REPLACE ":" ";" _parts "${_case}")
  list(GET _parts 0 _form)
  set(_arch "")
  list(LENGTH _parts _n)
  if(_n GREATER 1)
    list(GET _parts 1 _arch)
  endif()
  if(_arch)
    set(_name merge_ref_${_form}_${_arch})
  else()
    set(_name merge_ref_${_form})
  endif()
  add_test(NAME ${_name}
           COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/merge_ref.py $<TARGET_FILE:eo-ddp> ${PROJECT_SOURCE_DIR}
                   ${CMAKE_CURRENT_BINARY_DIR}/${_name} ${_form} ${_arch})
  set_tests_properties(${_name} PROPERTIES LABELS ref TIMEOUT 600
                       ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;OMP_NUM_THREADS=1")
endforeach()
add_test(NAME merge_streaming
         COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/merge_streaming.py $<TARGET_FILE:eo-ddp> ${PROJECT_SOURCE_DIR}
                 ${CMAKE_CURRENT_BINARY_DIR}/merge_streaming)
set_tests_properties(merge_streaming PROPERTIES LABELS ref TIMEOUT 600
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;OMP_NUM_THREADS=1")
# A bitsandbytes pre-quantised base (tests/ref/bnb_checkpoint_ref.py's nf4 / nf4_dq): written dequantised as
# bitsandbytes dequantises it, then merged (tests/ref/merge_bnb_ref.py).
add_test(NAME merge_bnb_ref
         COMMAND ${EO_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/merge_bnb_ref.py $<TARGET_FILE:eo-ddp> ${PROJECT_SOURCE_DIR}
                 ${CMAKE_CURRENT_BINARY_DIR}/merge_bnb_ref)
set_tests_properties(merge_bnb_ref PROPERTIES LABELS ref TIMEOUT 900
                     ENVIRONMENT "HF_HUB_OFFLINE=1;TRANSFORMERS_OFFLINE=1;OMP_NUM_THREADS=1")
