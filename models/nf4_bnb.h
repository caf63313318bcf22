// bitsandbytes' pre-quantised 4-bit checkpoint format <-> eo::QuantizedWeight.
//
// transformers saves a Linear4bit module `P` as Params4bit + QuantState.as_dict(packed=True):
//   P.weight                                   U8 [(n+1)/2, 1] packed nibbles
//   P.weight.absmax                            F32 [nblocks] (U8 codes when nested)
//   P.weight.quant_map                         F32 [16], the NF4 code book
//   P.weight.nested_absmax                     F32 [ceil(nblocks / nested_blocksize)] (nested)
//   P.weight.nested_quant_map                  F32 [256], signed dynamic map (nested)
//   P.weight.quant_state.bitsandbytes__nf4     U8 bytes of a JSON object: quant_type, blocksize,
//                                              dtype, shape, and when nested nested_blocksize,
//                                              nested_dtype, nested_offset
// Reading validates all of it (fp4 is refused) and names the module in every error.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "models/nf4.h"

namespace eo::nf4 {

using TensorLookup = std::function<at::Tensor(const std::string&)>;
using TensorExists = std::function<bool(const std::string&)>;

// True when module `prefix` carries a bitsandbytes 4-bit quant state (nf4 or fp4).
bool is_bitsandbytes_4bit(const TensorExists& has, const std::string& prefix);

// Builds the quantised weight of module `prefix` (CPU tensors, as returned by `get`).
QuantizedWeight from_bitsandbytes(const TensorLookup& get, const TensorExists& has, const std::string& prefix);

// The tensors bitsandbytes would save for `q` as module `prefix`, in its order (CPU).
std::vector<std::pair<std::string, at::Tensor>> to_bitsandbytes(const QuantizedWeight& q, const std::string& prefix);

}  // namespace eo::nf4
