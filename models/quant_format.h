// The two 4-bit formats a frozen weight is held in (nf4::QuantizedWeight's tag). A header of its
// own so that sizes can be planned (offload/layout.h, runtime/plan.h) without libtorch.
#pragma once

namespace eo {

// NF4: bitsandbytes' layout (models/nf4.h). MXFP4: OCP microscaling FP4, 32 values per E8M0
// scale byte (models/mxfp4.h), as gpt-oss's checkpoints store their experts.
enum class QuantFormat : int { Nf4 = 0, Mxfp4 = 1 };
const char* quant_format_name(QuantFormat f);  // "NF4", "MXFP4"

}  // namespace eo
