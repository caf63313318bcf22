// eo-delta-rule: the gated delta rule alone (models/delta_rule.h), forward and forward + backward,
// on a model's delta-rule shapes, timed on the device's clock. bench/delta_rule_fla.py times
// flash-linear-attention's chunk_gated_delta_rule (and transformers' torch path) on the same shapes
// and checks fla's numbers against the ones this writes with --dump.
//
//   eo-delta-rule [--model configs/models/qwen3-next-80b-a3b] [--seq 2048] [--batches 1,4] [--packed 4]
//                 [--shape HK,HV,DK,DV] [--iters 20] [--dump DIR] [--json FILE] [--breakdown]
//
// Inputs as a Qwen3-Next / Qwen3.5 layer hands them to the op (models/linear_attention.cpp): q, k
// [B, T, Hk, dk] and v [B, T, Hv, dv] in the compute dtype (bf16 on a GPU, fp32 on the CPU), q and
// k L2-normalised inside the op, g = log decay in fp32, beta = sigmoid(b) in the compute dtype,
// chunks of 64. The decay is mild (g = logsigmoid(x + 4), about −0.02 a token) so the state
// carries across chunks and the --dump comparison sees the inter-chunk path too; the time does
// not depend on the values.
//   --packed N: one more row, B 1 holding N documents of T / N tokens (segment ids; fla: cu_seqlens).
//   --breakdown: after the table, one forward + backward of the first row under PyTorch's profiler
//               (bench/breakdown.h): its kernels by phase and the largest ones.
//   --dump DIR: the first row's inputs, output-gradient, output and input gradients as raw float32
//               files with an index (DIR/index.json), for bench/delta_rule_fla.py --check.
// On a GPU each shape has two rows: eo (the chain and UT-transform kernels) and eo-aten
// (set_delta_rule_kernels_enabled(false): batched ATen ops, one chunk at a time along the chain).
// A row's time is one device-clock window (CUDA events) over --iters calls after 3 warm-up calls;
// forward + backward is the forward with autograd and torch::autograd::grad of all five inputs.
// Peak: the allocator's peak over one forward + backward, above what was allocated before it.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "bench/args.h"
#include "bench/breakdown.h"
#include "common/error.h"
#include "models/delta_rule.h"
#include "models/hf_config.h"
#include "runtime/device.h"
#include "runtime/ddp/world.h"

namespace fs = std::filesystem;
using namespace eo;

namespace {

using bench::arg;
using bench::int_list;

struct Shape {
  std::int64_t B, T, docs;  // docs > 1: one row of that many equal documents (B 1)
};

struct Inputs {
  at::Tensor q, k, v, g, beta, segment_ids, dout;
};

Inputs make_inputs(const Shape& s, std::int64_t Hk, std::int64_t Hv, std::int64_t dk, std::int64_t dv, at::ScalarType dt,
                   const at::Device& dev) {
  at::manual_seed(1234 + s.B * 7 + s.docs);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
  Inputs in;
  in.q = at::randn({s.B, s.T, Hk, dk}, f32).to(dt);
  in.k = at::randn({s.B, s.T, Hk, dk}, f32).to(dt);
  in.v = at::randn({s.B, s.T, Hv, dv}, f32).to(dt);
  in.g = at::log_sigmoid(at::randn({s.B, s.T, Hv}, f32) + 4);
  in.beta = at::sigmoid(at::randn({s.B, s.T, Hv}, f32)).to(dt);
  in.dout = at::randn({s.B, s.T, Hv, dv}, f32).to(dt);
  if (s.docs > 1) in.segment_ids = at::arange(s.T, f32.dtype(at::kLong)).div(s.T / s.docs, "floor").unsqueeze(0);
  return in;
}

// Seconds per call over `iters` calls after 3 warm-up calls, on the device's clock.
double time_calls(const at::Device& dev, int iters, const std::function<void()>& call) {
  for (int i = 0; i < 3; ++i) call();
  const DeviceMark begin = DeviceMark::record(dev);
  for (int i = 0; i < iters; ++i) call();
  return DeviceMark::record(dev).seconds_since(begin) / iters;
}

void write_f32(const std::string& path, const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(c.data_ptr<float>()), c.numel() * 4);
}

int run(int argc, char** argv) {
  const std::string model_dir = arg(argc, argv, "--model", "configs/models/qwen3-next-80b-a3b");
  const std::int64_t T = std::stoll(arg(argc, argv, "--seq", "2048"));
  const std::vector<std::int64_t> batches = int_list(arg(argc, argv, "--batches", "1,4"));
  const std::int64_t packed = std::stoll(arg(argc, argv, "--packed", "4"));
  const int iters = std::stoi(arg(argc, argv, "--iters", "20"));
  const std::string dump = arg(argc, argv, "--dump", "");
  const std::string json_out = arg(argc, argv, "--json", "");
  const bool breakdown = bench::flag(argc, argv, "--breakdown");
  std::int64_t Hk = 0, Hv = 0, dk = 0, dv = 0;
  const std::string shape = arg(argc, argv, "--shape", "");
  if (!shape.empty()) {
    const auto v = int_list(shape);
    if (v.size() != 4) throw UsageError("--shape: expected HK,HV,DK,DV, got '" + shape + "'");
    Hk = v[0], Hv = v[1], dk = v[2], dv = v[3];
  } else {
    const model::ModelConfig mc = model::load_config(model_dir);
    if (!mc.linear_attn)
      throw UsageError(model_dir + " has no gated delta-rule layers (Qwen3-Next, Qwen3.5-MoE); pass --shape HK,HV,DK,DV");
    Hk = mc.linear_attn->k_heads, Hv = mc.linear_attn->v_heads, dk = mc.linear_attn->k_dim, dv = mc.linear_attn->v_dim;
  }
  if (Hk <= 0 || Hv % Hk != 0 || dk <= 0 || dv <= 0 || T <= 0 || iters < 1)
    throw UsageError("need key heads > 0 dividing value heads, positive dims, --seq and --iters");
  if (packed > 1 && T % packed != 0) throw UsageError("--packed N must divide --seq");
  const at::Device dev = at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const at::ScalarType dt = dev.is_cuda() ? at::kBFloat16 : at::kFloat;
  std::vector<Shape> shapes;
  for (const auto b : batches) shapes.push_back({b, T, 1});
  if (packed > 1) shapes.push_back({1, T, packed});
  std::printf("# eo gated delta rule (models/delta_rule.h): key heads %lld x %lld, value heads %lld x %lld, %s, chunk 64, "
              "L2-normalised q/k; %s; %d calls per row\n",
              (long long)Hk, (long long)dk, (long long)Hv, (long long)dv, dt == at::kBFloat16 ? "bf16" : "fp32",
              describe_device(dev).c_str(), iters);
  std::printf("\n| impl | B x T | documents | forward ms | forward + backward ms | peak MiB (fwd + bwd) |\n|---|---|---|---|---|---|\n");
  model::GatedDeltaRuleOptions opt;
  opt.l2norm_qk = true;
  nlohmann::json rows = nlohmann::json::array();
  // On a GPU, eo with the chain and UT-transform kernels, and with the batched ATen ops alone.
  const std::vector<std::string> impls = dev.is_cuda() ? std::vector<std::string>{"eo", "eo-aten"} : std::vector<std::string>{"eo"};
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    Inputs in = make_inputs(s, Hk, Hv, dk, dv, dt, dev);
    at::Tensor out;
    std::vector<at::Tensor> grads;
    for (const std::string& impl : impls) {
      model::set_delta_rule_kernels_enabled(impl == "eo");
      const double fwd = time_calls(dev, iters, [&] {
        at::NoGradGuard no_grad;
        (void)model::gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), in.segment_ids, opt);
      });
      std::vector<at::Tensor> leaves = {in.q.detach().requires_grad_(), in.k.detach().requires_grad_(),
                                        in.v.detach().requires_grad_(), in.g.detach().requires_grad_(),
                                        in.beta.detach().requires_grad_()};
      auto forward_backward = [&] {
        const auto r = model::gated_delta_rule(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], at::Tensor(),
                                               in.segment_ids, opt);
        return std::make_pair(r.out, torch::autograd::grad({r.out}, leaves, {in.dout}));
      };
      const double fb = time_calls(dev, iters, [&] { (void)forward_backward(); });
      synchronize(dev);
      const std::int64_t before = allocated_memory_bytes(dev);
      reset_peak_memory(dev);
      auto [o, g] = forward_backward();
      synchronize(dev);
      if (impl == "eo") out = o, grads = g;
      const double peak_mib = dev.is_cuda() ? double(peak_memory_bytes(dev) - before) / (1 << 20) : 0.0;
      const std::string peak = dev.is_cuda() ? std::to_string(static_cast<long long>(peak_mib + 0.5)) : "-";
      std::printf("| %s | %lldx%lld | %lld | %.3f | %.3f | %s |\n", impl.c_str(), (long long)s.B, (long long)s.T,
                  (long long)s.docs, fwd * 1e3, fb * 1e3, peak.c_str());
      std::fflush(stdout);
      rows.push_back({{"impl", impl}, {"B", s.B}, {"T", s.T}, {"docs", s.docs}, {"fwd_ms", fwd * 1e3}, {"fwd_bwd_ms", fb * 1e3},
                      {"peak_mib", peak_mib}, {"k_heads", Hk}, {"v_heads", Hv}, {"k_dim", dk}, {"v_dim", dv},
                      {"dtype", dt == at::kBFloat16 ? "bf16" : "fp32"}, {"device", describe_device(dev)}});
    }
    model::set_delta_rule_kernels_enabled(false);
    if (i == 0 && !dump.empty()) {
      fs::create_directories(dump);
      const std::vector<std::pair<std::string, at::Tensor>> tensors = {
          {"q", in.q},      {"k", in.k},      {"v", in.v},      {"g", in.g},      {"beta", in.beta}, {"dout", in.dout},
          {"out", out},     {"dq", grads[0]}, {"dk", grads[1]}, {"dv", grads[2]}, {"dg", grads[3]},  {"dbeta", grads[4]}};
      nlohmann::json index = {{"B", s.B}, {"T", s.T}, {"docs", s.docs}, {"dtype", dt == at::kBFloat16 ? "bf16" : "fp32"},
                              {"tensors", nlohmann::json::object()}};
      for (const auto& [name, t] : tensors) {
        write_f32(dump + "/" + name + ".f32", t);
        index["tensors"][name] = t.sizes().vec();
      }
      std::ofstream(dump + "/index.json") << index.dump(1) << "\n";
    }
  }
  if (!json_out.empty()) std::ofstream(json_out) << rows.dump(1) << "\n";
  if (breakdown) {  // eo's row: with the kernels
    model::set_delta_rule_kernels_enabled(true);
    const Shape& s = shapes.front();
    Inputs in = make_inputs(s, Hk, Hv, dk, dv, dt, dev);
    std::vector<at::Tensor> leaves = {in.q.requires_grad_(), in.k.requires_grad_(), in.v.requires_grad_(),
                                      in.g.requires_grad_(), in.beta.requires_grad_()};
    bench::StepProfiler profiler;
    profiler.start();
    const auto r = model::gated_delta_rule(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], at::Tensor(),
                                           in.segment_ids, opt);
    (void)torch::autograd::grad({r.out}, leaves, {in.dout});
    const bench::StepBreakdown b = profiler.stop();
    std::printf("\n%s", bench::describe(b, "one forward + backward, B " + std::to_string(s.B) + " x T " + std::to_string(s.T),
                                        {}).c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::World& world = ddp::World::init(&argc, &argv);
  int rc = 0;
  try {
    rc = run(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "eo-delta-rule: %s\n", e.what());
    rc = kExitUsage;
  }
  world.finalize();
  return rc;
}
