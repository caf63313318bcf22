// How peft's ParamWrapper (lora_target_parameters) lays lora_A and lora_B over a family's fused
// expert parameters in transformers 5 (peft/tuners/lora/layer.py: ParamWrapper.update_layer,
// get_delta_weight). eo-ddp keeps the adapter in exactly that layout, so what it trains is what
// peft saves, loads and steps; ExpertLora reads the factors the forward needs out of it.
#pragma once

namespace eo::model {

struct FusedExpertLayout {
  // peft takes a 3-D parameter as [E, out, in] unless its experts module carries transformers'
  // is_transposed flag (then [E, in, out]: gpt-oss). Llama 4's gate_up_proj [E, H, 2I] and
  // down_proj [E, I, H] multiply as x @ W[e] but lack the flag, so peft's lora_A [r·E, 2I] sits
  // on the output side and lora_B [H, r·E] on the input side: ΔW[e] = B_e A_e in W's own layout.
  bool factors_swapped = false;
  // gate_up_proj's output features alternate gate and up (gpt-oss: gate = [..., ::2]), and so do
  // the rows of its lora_B; elsewhere gate is the first half and up the second.
  bool gate_up_interleaved = false;
};

}  // namespace eo::model
