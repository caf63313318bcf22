// eo-lora-gemm: the expert LoRA's tiny-rank grouped GEMMs one by one, on one MoE block's shapes,
// each timed from its own kernels (Kineto, as --breakdown) against the bytes it must move at
// least, libtorch's grouped GEMM beside what the step runs (eo's small-K kernel where K <= 64). Issue #14's every-linear step spends 0.04 s (Qwen3-30B-A3B, 2048 x 1) in these 20
// launches per block; this says which of them are far from the memory bound before any kernel
// is written for them.
//
//   eo-lora-gemm [--rows 16384] [--experts 128] [--hidden 2048] [--inter 768] [--r 16]
//                [--iters 20] [--hbm-gbs 4800]
//   rows: routed (token, slot) pairs, seq x mb x top_k (Qwen3: 2048 x 1 x 8)
//
// Every operand is laid out as the training step lays it out (models/lora.cpp and autograd's
// _grouped_mm backward of y = x · W^T with W^T a transposed view: dX = dY · W over the same
// offsets, d(W^T) = x^T · dY as a 2-D x 2-D grouped GEMM). Rows are routed uniformly at random (a seeded multinomial). On a CPU build it runs the
// same calls and times them by the wall clock (a functional check, not a measurement).
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench/breakdown.h"
#include "models/grouped_mm.h"
#include "runtime/device.h"

namespace {

struct Args {
  std::int64_t rows = 16384, experts = 128, hidden = 2048, inter = 768, r = 16, iters = 20;
  double hbm_gbs = 4800;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "eo-lora-gemm: %s needs a value\n", k.c_str());
      std::exit(2);
    }
    const char* v = argv[++i];
    if (k == "--rows") a.rows = std::atoll(v);
    else if (k == "--experts") a.experts = std::atoll(v);
    else if (k == "--hidden") a.hidden = std::atoll(v);
    else if (k == "--inter") a.inter = std::atoll(v);
    else if (k == "--r") a.r = std::atoll(v);
    else if (k == "--iters") a.iters = std::atoll(v);
    else if (k == "--hbm-gbs") a.hbm_gbs = std::atof(v);
    else {
      std::fprintf(stderr, "eo-lora-gemm: unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  if (a.rows <= 0 || a.experts <= 0 || a.hidden <= 0 || a.inter <= 0 || a.r <= 0 || a.r % 8 || a.iters <= 0) {
    std::fprintf(stderr, "eo-lora-gemm: sizes must be positive and r a multiple of 8\n");
    std::exit(2);
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const at::Device dev = eo::pick_device(0, 1);  // cuda:0 where this build and host have one
  const bool gpu = dev.is_cuda();
  const auto bf = at::TensorOptions().dtype(gpu ? at::kBFloat16 : at::kFloat).device(dev);
  const std::int64_t N = a.rows, E = a.experts, H = a.hidden, I = a.inter, r = a.r;
  at::manual_seed(1);
  const at::Tensor expert_of = at::multinomial(at::ones({E}), N, /*replacement=*/true);
  const at::Tensor offsets = at::bincount(expert_of, {}, E).cumsum(0).to(at::kInt).to(dev);

  // The block's activations and adapters (bf16 casts of the fp32 masters), as in the step.
  const at::Tensor x = at::randn({N, H}, bf), act = at::randn({N, I}, bf);
  const at::Tensor a_pair = at::randn({E, 2 * r, H}, bf), b_gate = at::randn({E, I, r}, bf);
  const at::Tensor a_down = at::randn({E, r, I}, bf), b_down = at::randn({E, H, r}, bf);
  const at::Tensor down_pair = at::randn({N, 2 * r}, bf), down_d = at::randn({N, r}, bf);
  // The paired A's output as the step splits it: each column block copied contiguous.
  const at::Tensor down_gate = down_pair.narrow(1, 0, r).contiguous();
  const at::Tensor d_gate = at::randn({N, I}, bf), d_y = at::randn({N, H}, bf);
  const at::Tensor w_up = at::randn({E, I, H}, bf);  // a base matrix, for scale
  const double el = gpu ? 2 : 4;

  struct Op {
    const char* name;
    int per_block;  // launches of this shape per block and step: forward + recompute, up's twin of gate's
    double bytes;   // what it must read and write at least
    at::Tensor a, b;  // at::_grouped_mm(a, b, offsets); the step runs grouped_mm_product(a, b, offsets)
  };
  const std::vector<Op> ops = {
      {"base: x [N,H] . W_up^T (for scale)", 0, el * (N * H + N * I + E * I * H), x, w_up.transpose(1, 2)},
      {"fwd: x . A_pair^T -> [N,2r]", 2, el * (N * H + N * 2 * r + E * 2 * r * H), x, a_pair.transpose(1, 2)},
      {"fwd: down_gate . B^T -> [N,I]", 4, el * (N * r + N * I + E * I * r), down_gate, b_gate.transpose(1, 2)},
      {"fwd: act . A_down^T -> [N,r]", 2, el * (N * I + N * r + E * r * I), act, a_down.transpose(1, 2)},
      {"fwd: down_d . B_down^T -> [N,H]", 2, el * (N * r + N * H + E * H * r), down_d, b_down.transpose(1, 2)},
      {"bwd dX: dDown_pair . A_pair -> [N,H]", 1, el * (N * 2 * r + N * H + E * 2 * r * H), down_pair, a_pair},
      {"bwd dA: x^T . dDown_pair -> [E,H,2r]", 1, el * (N * 2 * r + N * H + E * 2 * r * H), x.t(), down_pair},
      {"bwd dDown: dGate . B -> [N,r]", 2, el * (N * I + N * r + E * I * r), d_gate, b_gate},
      {"bwd dB: down_gate^T . dGate -> [E,r,I]", 2, el * (N * I + N * r + E * I * r), down_gate.t(), d_gate},
      {"bwd dDown: dY . B_down -> [N,r]", 1, el * (N * H + N * r + E * H * r), d_y, b_down},
      {"bwd dB: down_d^T . dY -> [E,r,H]", 1, el * (N * H + N * r + E * H * r), down_d.t(), d_y},
      {"bwd dX: dDown_d . A_down -> [N,I]", 1, el * (N * r + N * I + E * r * I), down_d, a_down},
      {"bwd dA: act^T . dDown_d -> [E,I,r]", 1, el * (N * r + N * I + E * r * I), act.t(), down_d},
  };

  std::printf("# eo-lora-gemm on %s: rows %lld, experts %lld, hidden %lld, inter %lld, r %lld, %lld iterations%s\n\n",
              gpu ? "cuda:0" : "cpu (wall clock, a functional check)", (long long)N, (long long)E, (long long)H,
              (long long)I, (long long)r, (long long)a.iters, gpu ? ", Kineto kernel time" : "");
  std::printf("eo: where K <= 64, eo's small-K kernel (models/grouped_mm.h; off in the step by default), else the same libtorch call.\n\n");
  std::printf("| grouped GEMM | per block | libtorch us | eo us | min bytes | eo GB/s | of %.0f GB/s | eo vs libtorch max |diff| / max |\n"
              "|---|---|---|---|---|---|---|---|\n",
              a.hbm_gbs);
  auto time_of = [&](const std::function<at::Tensor()>& run) {
    run();  // warm-up: kernel selection, allocator
    eo::synchronize(dev);
    if (gpu) {
      eo::bench::StepProfiler prof;
      prof.start();
      for (std::int64_t i = 0; i < a.iters; ++i) run();
      return prof.stop().compute_busy_s / double(a.iters);
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < a.iters; ++i) run();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / double(a.iters);
  };
  double torch_us = 0, eo_us = 0;
  int block_launches = 0;
  for (const Op& op : ops) {
    const bool small = eo::model::small_k_kernel_applies(op.a, op.b);
    const double t_torch = time_of([&] { return at::_grouped_mm(op.a, op.b, offsets); });
    const double t_eo = small ? time_of([&] { return eo::model::small_k_grouped_mm(op.a, op.b, offsets); }) : t_torch;
    double diff = 0;
    if (small) {
      const at::Tensor want = at::_grouped_mm(op.a, op.b, offsets).to(at::kFloat);
      diff = (eo::model::small_k_grouped_mm(op.a, op.b, offsets).to(at::kFloat) - want).abs().max().item<double>() /
             want.abs().max().item<double>();
    }
    const double gbs = op.bytes / t_eo / 1e9;
    torch_us += op.per_block * t_torch * 1e6;
    eo_us += op.per_block * t_eo * 1e6;
    block_launches += op.per_block;
    char eo_cell[32] = "(same)", diff_cell[32] = "";
    if (small) {
      std::snprintf(eo_cell, sizeof eo_cell, "%.1f", t_eo * 1e6);
      std::snprintf(diff_cell, sizeof diff_cell, "%.2g", diff);
    }
    std::printf("| %s | %d | %.1f | %s | %.1f MB | %.0f | %.0f%% | %s |\n", op.name, op.per_block, t_torch * 1e6, eo_cell,
                op.bytes / 1e6, gbs, 100 * gbs / a.hbm_gbs, diff_cell);
  }
  std::printf("\nLoRA GEMMs per block and step (gate + up paired, down; forward, recompute, backward): %d launches, "
              "libtorch %.1f us, eo %.1f us (%.2fx)\n",
              block_launches, torch_us, eo_us, torch_us / eo_us);
  // The write rate these outputs could have: a plain fill of [N, I] and [N, H], and a copy.
  for (const std::int64_t cols : {I, H}) {
    at::Tensor t = at::empty({N, cols}, bf);
    const double fill = time_of([&] { return t.zero_(); });
    const at::Tensor src = at::randn({N, cols}, bf);
    const double copy = time_of([&] { return t.copy_(src); });
    std::printf("write bound [N,%lld]: zero_ %.1f us (%.0f GB/s), copy_ %.1f us (%.0f GB/s read + write)\n", (long long)cols,
                fill * 1e6, el * N * cols / fill / 1e9, copy * 1e6, 2 * el * N * cols / copy / 1e9);
  }
  // The layout the step no longer uses: the column block read in place (row stride 2r). On the
  // H200 the paired LoRA's gradients went wrong that way (docs/benchmarks.md, session 6); this
  // says whether libtorch's grouped GEMM itself differs on such a slice, forward and dB form.
  const at::Tensor slice = down_pair.narrow(1, 0, r);
  auto max_diff = [](const at::Tensor& got, const at::Tensor& want) {
    return (got.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<double>() / want.to(at::kFloat).abs().max().item<double>();
  };
  std::printf("in-place column slice vs its contiguous copy (max |diff| / max): forward %.3g, dB form %.3g\n",
              max_diff(at::_grouped_mm(slice, b_gate.transpose(1, 2), offsets), at::_grouped_mm(down_gate, b_gate.transpose(1, 2), offsets)),
              max_diff(at::_grouped_mm(slice.t(), d_gate, offsets), at::_grouped_mm(down_gate.t(), d_gate, offsets)));
  return 0;
}
