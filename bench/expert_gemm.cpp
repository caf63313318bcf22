// eo-expert-gemm: one MoE layer's expert GEMMs, forward + backward, on each expert GEMM kernel side
// by side (models/grouped_mm.h: torch = at::_grouped_mm, portable = eo's CUTLASS grouped GEMM), on a
// model's shapes, and torch's kernel with a host read of the group sizes before each GEMM (what
// at::_grouped_mm's per-expert fallback does on cards without its device-scheduled kernel, minus
// the loop itself: a lower bound on that path's cost).
//
//   eo-expert-gemm [--model configs/models/qwen3-30b-a3b] [--tokens 2048,8192] [--iters 20]
//   eo-expert-gemm --nf4 [--model ...] [--tokens 8192] [--iters 20] [--blocksize 64] [--nested 1]
//
// The layer as the step runs it with frozen experts and LoRA on the attention (models/linear4bit.cpp):
// gate_up = x · W1_e^T, h = silu(gate) * up, y = h · W2_e^T; backward dH = dY · W2_e, the SwiGLU's
// gradient, dX = dGateUp · W1_e. Rows routed top-k at random (skewed, seeded). Each timing is one
// device-clock window (CUDA events) over --iters layers after 3 warm-up layers.
//
// --nf4: the frozen NF4 experts' four products (forward gate_up and down, backward dH = dY · W2 and
// dX = dGateUp · W1), each timed alone on the NF4 expert GEMM (models/nf4_expert_gemm.h: the
// dequantisation inside the mainloop) beside what the step does today, dequantise the bank
// (dequantize_stack) then the portable grouped GEMM, and beside the portable GEMM alone on a bank
// already dequantised; TFLOP/s of 2 M N K per product.
#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "bench/args.h"
#include "models/grouped_mm.h"
#include "models/hf_config.h"
#include "models/nf4.h"
#include "models/nf4_expert_gemm.h"
#include "models/quantized_weight.h"
#include "runtime/device.h"
#include "runtime/ddp/world.h"

using namespace eo;

namespace {

using bench::arg;
using bench::split;

// Skewed top-k routing: expert e drawn with weight 1 + (e * 7919 % 13), k distinct per token.
at::Tensor route_counts(std::int64_t tokens, std::int64_t experts, std::int64_t k) {
  std::mt19937_64 rng(42);
  std::vector<double> w(static_cast<std::size_t>(experts));
  for (std::int64_t e = 0; e < experts; ++e) w[static_cast<std::size_t>(e)] = 1.0 + double(e * 7919 % 13);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(experts), 0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::vector<double> left = w;
    for (std::int64_t j = 0; j < k; ++j) {
      std::discrete_distribution<std::int64_t> pick(left.begin(), left.end());
      const std::int64_t e = pick(rng);
      ++counts[static_cast<std::size_t>(e)];
      left[static_cast<std::size_t>(e)] = 0;
    }
  }
  return at::tensor(counts, at::kLong);
}

// Milliseconds per call of fn over `iters` calls after 3 warm-ups, on the device's clock.
template <typename Fn>
double time_ms(const at::Device& dev, int iters, Fn&& fn) {
  for (int i = 0; i < 3; ++i) fn();
  const DeviceMark begin = DeviceMark::record(dev);
  for (int i = 0; i < iters; ++i) fn();
  return DeviceMark::record(dev).seconds_since(begin) * 1e3 / iters;
}

int nf4_mode(int argc, char** argv, const model::ModelConfig& mc, int iters, const at::Device& dev) {
  if (!dev.is_cuda() || !model::nf4_expert_gemm_runs(dev) || !model::portable_kernel_takes(at::kBFloat16, dev)) {
    std::printf("--nf4: needs a GPU this build has sm_80+ code for (the NF4 expert GEMM and the portable kernel)\n");
    return 1;
  }
  const int blocksize = std::atoi(arg(argc, argv, "--blocksize", "64").c_str());
  const bool nested = arg(argc, argv, "--nested", "1") != "0";
  const std::int64_t H = mc.hidden, I = mc.expert_width, E = mc.experts, k = mc.top_k;
  std::printf("# NF4 experts, blocksize %d, %s absmax\n", blocksize, nested ? "nested" : "plain");
  at::manual_seed(1);
  // The homes' layout: W1 [2I, H] (gate and up), W2 [H, I], one quantised matrix per expert.
  std::vector<QuantizedWeight> w1, w2;
  for (std::int64_t e = 0; e < E; ++e) {
    w1.push_back(nf4::quantize(at::randn({2 * I, H}, at::dtype(at::kFloat).device(dev)) * 0.02, blocksize, nested));
    w2.push_back(nf4::quantize(at::randn({H, I}, at::dtype(at::kFloat).device(dev)) * 0.02, blocksize, nested));
  }
  std::vector<const QuantizedWeight*> p1, p2;
  for (std::size_t e = 0; e < w1.size(); ++e) p1.push_back(&w1[e]), p2.push_back(&w2[e]);
  const model::Nf4ExpertTable t1 = model::nf4_expert_table(p1), t2 = model::nf4_expert_table(p2);
  const at::Tensor bank1 = dequantize_stack(p1, at::kBFloat16), bank2 = dequantize_stack(p2, at::kBFloat16);
  std::printf("\n| tokens | product | M x N x K | NF4 GEMM ms | TFLOP/s | dequantise + portable ms | TFLOP/s | "
              "portable alone ms | TFLOP/s | NF4 vs dequantise + portable | NF4 vs portable: max abs diff / max abs |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& tok : split(arg(argc, argv, "--tokens", "8192"), ',')) {
    const std::int64_t T = std::stoll(tok), M = T * k;
    const at::Tensor offsets = route_counts(T, E, k).cumsum(0).to(at::kInt).to(dev);
    auto rand_rows = [&](std::int64_t cols) {
      return at::randn({M, cols}, at::dtype(at::kFloat).device(dev)).to(at::kBFloat16);
    };
    const at::Tensor x = rand_rows(H), h = rand_rows(I), dy = rand_rows(H), dgu = rand_rows(2 * I);
    struct Product {
      const char* name;
      const at::Tensor* a;
      const model::Nf4ExpertTable* table;
      const std::vector<const QuantizedWeight*>* experts;
      const at::Tensor* bank;
      bool backward;
    };
    double sum[3] = {0, 0, 0}, flops_sum = 0;
    for (const Product& p : {Product{"gate_up = x · W1^T", &x, &t1, &p1, &bank1, false},
                             Product{"y = h · W2^T", &h, &t2, &p2, &bank2, false},
                             Product{"dH = dY · W2", &dy, &t2, &p2, &bank2, true},
                             Product{"dX = dGateUp · W1", &dgu, &t1, &p1, &bank1, true}}) {
      // bank [E, out, in]: the forward reads it as [E, in, out] (the transposed view), the backward as stored.
      const at::Tensor b = p.backward ? *p.bank : p.bank->transpose(1, 2);
      const std::int64_t N = b.size(2), K = b.size(1);
      const double flops = 2.0 * double(M) * double(N) * double(K);
      const double fused = time_ms(dev, iters, [&] {
        return p.backward ? model::nf4_grouped_mm_dx(*p.a, *p.table, offsets)
                          : model::nf4_grouped_mm(*p.a, *p.table, offsets);
      });
      const double unfused = time_ms(dev, iters, [&] {
        const at::Tensor bank = dequantize_stack(*p.experts, at::kBFloat16);
        return model::portable_grouped_mm(*p.a, p.backward ? bank : bank.transpose(1, 2), offsets);
      });
      const double alone = time_ms(dev, iters, [&] { return model::portable_grouped_mm(*p.a, b, offsets); });
      // A sanity column, not the test (tests/test_cuda_nf4_expert_gemm.cpp): both read the same bf16 weights.
      const at::Tensor mine = p.backward ? model::nf4_grouped_mm_dx(*p.a, *p.table, offsets)
                                         : model::nf4_grouped_mm(*p.a, *p.table, offsets);
      const at::Tensor theirs = model::portable_grouped_mm(*p.a, b, offsets).to(at::kFloat);
      const double diff =
          (mine.to(at::kFloat) - theirs).abs().max().item<double>() / theirs.abs().max().item<double>();
      sum[0] += fused, sum[1] += unfused, sum[2] += alone, flops_sum += flops;
      std::printf("| %lld | %s | %lld x %lld x %lld | %.3f | %.0f | %.3f | %.0f | %.3f | %.0f | %.2fx | %.1e |\n",
                  (long long)T, p.name, (long long)M, (long long)N, (long long)K, fused, flops / fused / 1e9, unfused,
                  flops / unfused / 1e9, alone, flops / alone / 1e9, unfused / fused, diff);
      std::fflush(stdout);
    }
    std::printf("| %lld | all four | | %.3f | %.0f | %.3f | %.0f | %.3f | %.0f | %.2fx | |\n", (long long)T, sum[0],
                flops_sum / sum[0] / 1e9, sum[1], flops_sum / sum[1] / 1e9, sum[2], flops_sum / sum[2] / 1e9,
                sum[1] / sum[0]);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::World& world = ddp::World::init(&argc, &argv);
  const std::string model_dir = arg(argc, argv, "--model", "configs/models/qwen3-30b-a3b");
  const int iters = std::atoi(arg(argc, argv, "--iters", "20").c_str());
  const model::ModelConfig mc = model::load_config(model_dir);
  const at::Device dev = at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const auto dt = dev.is_cuda() ? at::kBFloat16 : at::kFloat;
  const std::int64_t H = mc.hidden, I = mc.expert_width, E = mc.experts, k = mc.top_k;
  std::printf("# %s layer: %lld experts, top %lld, hidden %lld, expert intermediate %lld; %s\n", model_dir.c_str(),
              (long long)E, (long long)k, (long long)H, (long long)I, describe_device(dev).c_str());
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--nf4") {
      const int rc = nf4_mode(argc, argv, mc, iters, dev);
      world.finalize();
      return rc;
    }
  at::manual_seed(1);
  // HF layout [E, out, in], read as its transpose (the step's views).
  const at::Tensor w1 = (at::randn({E, 2 * I, H}, at::dtype(at::kFloat).device(dev)) * 0.02).to(dt);
  const at::Tensor w2 = (at::randn({E, H, I}, at::dtype(at::kFloat).device(dev)) * 0.02).to(dt);
  std::printf("\n| tokens | kernel | fwd + bwd ms per layer | vs torch |\n|---|---|---|---|\n");
  for (const auto& tok : split(arg(argc, argv, "--tokens", "2048,8192"), ',')) {
    const std::int64_t T = std::stoll(tok), M = T * k;
    const at::Tensor counts = route_counts(T, E, k);
    const at::Tensor offsets = counts.cumsum(0).to(at::kInt).to(dev);
    const at::Tensor x = at::randn({M, H}, at::dtype(at::kFloat).device(dev)).to(dt);
    const at::Tensor dy = at::randn({M, H}, at::dtype(at::kFloat).device(dev)).to(dt);
    auto layer = [&](bool host_read) {
      auto gemm = [&](const at::Tensor& a, const at::Tensor& b) {
        if (host_read) (void)offsets.to(at::kCPU);  // the fallback's copy of the sizes to the host
        return model::grouped_mm_product(a, b, offsets);
      };
      const at::Tensor gu = gemm(x, w1.transpose(1, 2));  // [M, 2I]
      const at::Tensor gate = gu.narrow(1, 0, I), up = gu.narrow(1, I, I);
      const at::Tensor h = at::silu(gate) * up;
      const at::Tensor y = gemm(h.contiguous(), w2.transpose(1, 2));  // [M, H]
      const at::Tensor dh = gemm(dy, w2);                              // [M, I]
      const at::Tensor sg = at::sigmoid(gate);
      const at::Tensor dgate = dh * up * sg * (1 + gate * (1 - sg)), dup = dh * at::silu(gate);
      const at::Tensor dx = gemm(at::cat({dgate, dup}, 1), w1);  // [M, H]
      (void)y;
      (void)dx;
    };
    double torch_ms = 0;
    for (const auto& [label, kernel, host_read] :
         std::vector<std::tuple<std::string, model::ExpertGemm, bool>>{
             {"torch", model::ExpertGemm::kTorch, false},
             {"portable", model::ExpertGemm::kPortable, false},
             {"torch + host read of sizes", model::ExpertGemm::kTorch, true}}) {
      if (kernel == model::ExpertGemm::kPortable && !model::portable_expert_gemm_built()) continue;
      model::set_expert_gemm(kernel);
      for (int i = 0; i < 3; ++i) layer(host_read);
      const DeviceMark begin = DeviceMark::record(dev);
      for (int i = 0; i < iters; ++i) layer(host_read);
      const double ms = DeviceMark::record(dev).seconds_since(begin) * 1e3 / iters;
      if (label == "torch") torch_ms = ms;
      std::printf("| %lld | %s | %.3f | %.2fx |\n", (long long)T, label.c_str(), ms, torch_ms > 0 ? ms / torch_ms : 0.0);
      std::fflush(stdout);
    }
    model::set_expert_gemm(model::ExpertGemm::kTorch);
  }
  world.finalize();
  return 0;
}
