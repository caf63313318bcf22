#include "models/weights.h"

#include "common/error.h"

namespace eo::model {

const char* expert_matrix_name(ExpertMatrix m) {
  switch (m) {
    case ExpertMatrix::Gate: return "gate_proj";
    case ExpertMatrix::Up: return "up_proj";
    case ExpertMatrix::Down: return "down_proj";
  }
  return "?";
}

const QuantizedWeight& ResidentWeights::expert_weight(int layer, int expert, ExpertMatrix m) {
  EO_CHECK(layer >= 0 && layer < static_cast<int>(bank_.size()) && expert >= 0 &&
               expert < static_cast<int>(bank_[layer].size()),
           "ResidentWeights: no expert ", expert, " in layer ", layer);
  return bank_[layer][expert][static_cast<int>(m)];
}

}  // namespace eo::model
