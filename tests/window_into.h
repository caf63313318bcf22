// dequantize_stack_window's `dest` form, as the folded expert LoRA uses it: the window written into
// the first columns of a wider bank. Returns those columns (on the CPU) after checking that the
// call returned the bank itself and left every column past the window as it was.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "models/quantized_weight.h"

namespace eo::test {

inline at::Tensor window_into_wider(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype, std::int64_t r0,
                                    std::int64_t rows, std::int64_t c0, std::int64_t cols) {
  constexpr std::int64_t kExtra = 24;  // keeps 16-byte rows for every dtype when cols is a multiple of 8
  constexpr double kUntouched = 7.0;
  const at::Tensor wide = at::full({static_cast<std::int64_t>(qs.size()), rows, cols + kExtra}, kUntouched,
                                   at::TensorOptions().dtype(dtype).device(qs.front()->packed.device()));
  const at::Tensor got = eo::dequantize_stack_window(qs, dtype, r0, rows, c0, cols, wide.narrow(2, 0, cols));
  EXPECT_EQ(got.data_ptr(), wide.data_ptr()) << "the window was not written into the bank it was given";
  EXPECT_TRUE(wide.narrow(2, cols, kExtra).eq(kUntouched).all().item<bool>()) << "columns past the window were written";
  return wide.narrow(2, 0, cols).cpu();
}

}  // namespace eo::test
