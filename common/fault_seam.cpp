#include "common/fault_seam.h"

#include <utility>

namespace eo::faults {
namespace {
Plan& installed() {
  static Plan p;
  return p;
}
}  // namespace

void install(Plan plan) { installed() = std::move(plan); }
const Plan& plan() { return installed(); }

}  // namespace eo::faults
