// GPU checks (label `cuda`): the offload engine's copies, memory and training on a real device.
// Without a CUDA device every test is reported as skipped (CTest shows them as "Skipped", never
// as passed).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "tests/bf16_yardstick.h"
#include "tests/grouped_mm_ref.h"
#include "common/files.h"
#include "models/fused.h"
#include "models/grouped_mm.h"
#include "models/hf_config.h"
#include "models/linear4bit.h"
#include "models/lora.h"
#include "models/moe_model.h"
#include "models/mxfp4.h"
#include "models/nvfp4.h"
#include "models/nf4.h"
#include "offload/engine.h"
#include "runtime/config.h"
#include "runtime/device.h"
#include "runtime/ddp/world.h"
#include "runtime/optimizer.h"
#include "runtime/trainer.h"
#include "tests/test_paths.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

using namespace eo;
namespace fs = std::filesystem;

#define REQUIRE_CUDA() \
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device (this test runs on the GPU machine: ctest -L cuda)"

namespace {

std::int64_t allocated_now(int device) {
#ifdef EO_WITH_CUDA
  const auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  return s.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
#else
  (void)device;
  return 0;
#endif
}

model::ResidentWeights::Bank big_bank(int layers, int experts, std::int64_t h, std::int64_t i) {
  at::manual_seed(1);
  model::ResidentWeights::Bank bank(layers);
  for (int l = 0; l < layers; ++l) {
    bank[l].resize(experts);
    for (int e = 0; e < experts; ++e) {
      bank[l][e][0] = nf4::quantize(at::randn({i, h}), 64);
      bank[l][e][1] = nf4::quantize(at::randn({i, h}), 64);
      bank[l][e][2] = nf4::quantize(at::randn({h, i}), 64);
    }
  }
  return bank;
}


// One loss and every LoRA gradient of model `m` (bf16) on a fixed batch, with the grouped expert
// GEMMs and with the per-expert loop: within 3e-2 of each other (of the gradient's norm). Given
// the same model in fp32 (`ref`, the loop in fp32 math), each is measured against it instead:
// the grouped path must be no less accurate than the loop it replaces (expect_bf16_no_worse);
// the two bf16 paths round differently (the grouped one adds the LoRA deltas in fp32 inside its
// kernels), so they need not be within 3e-2 of each other.
void expect_grouped_matches_loop(model::MoeModel& m, const at::Device& dev, model::MoeModel* ref = nullptr) {
  at::manual_seed(2);
  model::Batch b;
  b.input_ids = at::randint(0, m.config().vocab, {2, 64}, at::kLong).to(dev);
  b.labels = b.input_ids.clone();
  auto run = [&](model::MoeModel& mm, bool grouped) {
    model::set_grouped_gemm_enabled(grouped);
    for (auto& [n, p] : mm.lora_parameters()) p.mutable_grad() = at::Tensor();
    at::Tensor h = mm.embed(b.input_ids);
    const model::BlockContext ctx = mm.context(b, true);
    for (int i = 0; i < mm.num_layers(); ++i) {
      if (mm.block(i).is_moe()) mm.weight_provider().stage(i);
      h = mm.block(i).forward(h, ctx);
    }
    const at::Tensor loss = mm.loss_sum(h, b.labels);
    loss.backward();
    std::vector<at::Tensor> grads;
    for (auto& [n, p] : mm.lora_parameters()) grads.push_back(p.grad().to(at::kFloat).clone());
    return std::make_pair(loss.item<double>(), grads);
  };
  const auto [loop_loss, loop_grads] = run(m, false);
  const auto [grouped_loss, grouped_grads] = run(m, true);
  model::set_grouped_gemm_enabled(true);
  const auto names = m.lora_parameters();
  EXPECT_NEAR(grouped_loss, loop_loss, 5e-3 * std::abs(loop_loss));
  if (!ref) {
    for (std::size_t i = 0; i < loop_grads.size(); ++i) {
      const double scale = loop_grads[i].norm().item<double>();
      EXPECT_LT((grouped_grads[i] - loop_grads[i]).norm().item<double>(), 3e-2 * scale + 1e-6) << names[i].first;
    }
    return;
  }
  const auto [ref_loss, ref_grads] = run(*ref, false);
  // The loss as the gradients are judged: no further from fp32 than 3x the bf16 loop's distance,
  // or 0.5% of it. (A 128-token sum of bf16 logits' losses differs from fp32 by about that much.)
  std::printf("loss: grouped bf16 %.6g, loop bf16 %.6g, fp32 loop %.6g\n", grouped_loss, loop_loss, ref_loss);
  EXPECT_LE(std::abs(grouped_loss - ref_loss), std::max(3 * std::abs(loop_loss - ref_loss), 5e-3 * std::abs(ref_loss)));
  std::vector<std::string> labels;
  for (const auto& [n, p] : names) labels.push_back(n);
  eo::testing::expect_bf16_no_worse(labels, grouped_grads, loop_grads, ref_grads);
}

// The losses a run wrote to OUT/metrics.jsonl, in order (lines without a loss skipped).
std::vector<double> step_losses(const std::string& out) {
  std::vector<double> losses;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto k = line.find("\"loss\":");
    if (k != std::string::npos) losses.push_back(std::stod(line.substr(k + 7)));
  }
  return losses;
}

}  // namespace

TEST(Cuda, OffloadKeepsOnlyTheSlotsOnTheDevice) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  auto bank = big_bank(6, 16, 512, 256);
  std::vector<at::Tensor> ref;  // layer 3, every expert's down matrix, dequantised on the CPU
  for (int e = 0; e < 16; ++e) ref.push_back(eo::dequantize(bank[3][e][2], at::kFloat));
  synchronize(dev);
  const std::int64_t before = allocated_now(0);
  for (bool prefetch : {false, true}) {
    offload::OffloadOptions o;
    o.device = dev;
    o.prefetch = prefetch;
    offload::ExpertOffloader off(big_bank(6, 16, 512, 256), o);
    synchronize(dev);
    const std::int64_t installed = allocated_now(0) - before;
    // Only the slot(s) (and the tiny shared nested map) live on the device; the homes are host memory.
    EXPECT_EQ(installed, off.slot_bytes()) << "prefetch " << prefetch;
    EXPECT_EQ(off.slot_bytes(), (prefetch ? 2 : 1) * off.block_bytes(0));
    EXPECT_LT(off.slot_bytes() * 2, off.home_bytes());
    for (int l : {0, 1, 2, 3, 4, 5, 5, 4, 3}) off.stage(l);
    for (int e = 0; e < 16; ++e) {
      const auto& q = off.expert_weight(3, e, model::ExpertMatrix::Down);
      ASSERT_TRUE(q.packed.is_cuda());
      ASSERT_TRUE(at::equal(eo::dequantize(q, at::kFloat).cpu(), ref[e])) << "expert " << e;
    }
    const auto s = off.take_step_stats();
    EXPECT_GT(s.copy_seconds, 0);
    const double gbps = double(s.copied_bytes) / s.copy_seconds / 1e9;
    // Timed per copy by CUDA events: above the PCIe/C2C link's rate would mean the timing is wrong.
    EXPECT_LT(gbps, 80.0);
    std::printf("prefetch=%d: %lld copies, %.1f MB, %.2f GB/s, stall %.3f ms, pinned=%d\n", int(prefetch),
                static_cast<long long>(s.copies), s.copied_bytes / 1e6, gbps, s.stall_seconds * 1e3, 1);
  }
}

// Offloaded training on the GPU equals resident training (same kernels, same bytes).
TEST(Cuda, OffloadTrainingMatchesResidentOnGpu) {
  REQUIRE_CUDA();
  auto run = [](bool offload, bool prefetch, const std::string& out) {
    TrainConfig cfg = load_config_file(std::string(EO_SOURCE_DIR) + "/configs/tiny-qwen3-moe.yaml",
                                       {"max_steps=6", "save_steps=0", "output_dir=" + out, "bf16=true",
                                        "base_model=" + std::string(EO_SOURCE_DIR) + "/fixtures/tiny-qwen3-moe",
                                        "datasets.0.path=" + std::string(EO_SOURCE_DIR) + "/fixtures/tiny-data/train.jsonl",
                                        std::string("expert_offload=") + (offload ? "true" : "false"),
                                        std::string("expert_offload_prefetch=") + (prefetch ? "true" : "false")});
    remove_tree(out);
    train(cfg, ddp::World::get());
    return step_losses(out);
  };
  const std::string tmp = fs::temp_directory_path().string();
  const auto resident = run(false, false, tmp + "/eo_cuda_resident");
  const auto sync = run(true, false, tmp + "/eo_cuda_offload_sync");
  const auto pre = run(true, true, tmp + "/eo_cuda_offload_prefetch");
  ASSERT_EQ(resident.size(), 6u);
  ASSERT_EQ(sync.size(), 6u);
  ASSERT_EQ(pre.size(), 6u);
  for (int i = 0; i < 6; ++i) {
    EXPECT_NEAR(sync[i], resident[i], 1e-2 * std::abs(resident[i])) << "step " << i + 1;
    EXPECT_NEAR(pre[i], resident[i], 1e-2 * std::abs(resident[i])) << "step " << i + 1;
  }
}

// Blocks streamed in groups (expert_group_size) on the GPU: the group slots are all the device holds of
// the experts, every expert reads back exactly through them in any order (copy stream, ready and
// released events), and training in groups of 3 of the tiny model's 8 experts (the grouped GEMMs group
// by group, a host read of the routing counts per block) follows resident training.
TEST(Cuda, ExpertGroupsOnTheGpu) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  auto bank = big_bank(4, 16, 512, 256);
  std::vector<std::vector<at::Tensor>> ref(4);  // every expert's down matrix, dequantised on the CPU
  for (int l = 0; l < 4; ++l)
    for (int e = 0; e < 16; ++e) ref[l].push_back(eo::dequantize(bank[l][e][2], at::kFloat));
  synchronize(dev);
  const std::int64_t before = allocated_now(0);
  offload::OffloadOptions o;
  o.device = dev;
  o.group_size = 5;  // 5, 5, 5, 1
  offload::ExpertOffloader off(std::move(bank), o);
  synchronize(dev);
  EXPECT_EQ(allocated_now(0) - before, off.slot_bytes());
  EXPECT_EQ(off.slot_bytes() * 16, 2 * 5 * off.block_bytes(0));
  off.set_schedule({0, 1, 2, 3, 3, 2, 1, 0});
  for (int pass = 0; pass < 2; ++pass)
    for (int l : (pass == 0 ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{3, 2, 1, 0})) {
      off.stage(l);
      std::vector<int> order;
      for (int e = 0; e < 16; ++e) order.push_back(pass == 0 ? e : 15 - e);
      for (int e : order)
        ASSERT_TRUE(at::equal(eo::dequantize(off.expert_weight(l, e, model::ExpertMatrix::Down), at::kFloat).cpu(), ref[l][e]))
            << "layer " << l << " expert " << e;
    }
  off.stage(0);
  for (int e : {7, 0, 15, 3, 12, 12, 1})
    ASSERT_TRUE(at::equal(eo::dequantize(off.expert_weight(0, e, model::ExpertMatrix::Down), at::kFloat).cpu(), ref[0][e]));

  auto run = [](const std::string& group, const std::string& out) {
    TrainConfig cfg = load_config_file(std::string(EO_SOURCE_DIR) + "/configs/tiny-qwen3-moe.yaml",
                                       {"max_steps=6", "save_steps=0", "output_dir=" + out, "bf16=true", "lora_dropout=0",
                                        "base_model=" + std::string(EO_SOURCE_DIR) + "/fixtures/tiny-qwen3-moe",
                                        "datasets.0.path=" + std::string(EO_SOURCE_DIR) + "/fixtures/tiny-data/train.jsonl",
                                        "lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]",
                                        std::string("expert_offload=") + (group.empty() ? "false" : "true"),
                                        "expert_group_size=" + (group.empty() ? std::string("auto") : group)});
    remove_tree(out);
    train(cfg, ddp::World::get());
    return step_losses(out);
  };
  const std::string tmp = fs::temp_directory_path().string();
  const auto resident = run("", tmp + "/eo_cuda_groups_resident");
  const auto groups = run("3", tmp + "/eo_cuda_groups_3");
  ASSERT_EQ(resident.size(), 6u);
  ASSERT_EQ(groups.size(), 6u);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(groups[i], resident[i], 1e-2 * std::abs(resident[i])) << "step " << i + 1;
}

// With a model whose experts are large enough to see (EO_CUDA_MODEL, made by scripts/device-check),
// the allocator peak of offloaded training is below resident training's by at least the experts'
// bytes minus the two slots.
TEST(Cuda, OffloadPeakIsBelowResidentByTheExperts) {
  REQUIRE_CUDA();
  const char* model_dir = std::getenv("EO_CUDA_MODEL");
  if (!model_dir) GTEST_SKIP() << "EO_CUDA_MODEL not set (scripts/device-check makes one)";
  auto peak_of = [&](bool offload, bool prefetch, const std::string& out) {
    TrainConfig cfg = load_config_file(std::string(EO_SOURCE_DIR) + "/configs/tiny-qwen3-moe.yaml",
                                       {"max_steps=2", "save_steps=0", "output_dir=" + out, "bf16=true",
                                        "base_model=" + std::string(model_dir), "sequence_len=512", "micro_batch_size=1",
                                        "datasets.0.path=" + std::string(EO_SOURCE_DIR) + "/fixtures/tiny-data/train.jsonl",
                                        std::string("expert_offload=") + (offload ? "true" : "false"),
                                        std::string("expert_offload_prefetch=") + (prefetch ? "true" : "false")});
    remove_tree(out);
    train(cfg, ddp::World::get());
    std::ifstream in(out + "/metrics.jsonl");
    std::int64_t peak = 0;
    for (std::string line; std::getline(in, line);) {
      const auto k = line.find("\"peak_mem_bytes\":");
      peak = std::max<std::int64_t>(peak, std::stoll(line.substr(k + 17)));
    }
    return peak;
  };
  const model::ModelConfig mc = model::load_config(model_dir);
  int moe = 0;
  for (int i = 0; i < mc.layers; ++i) moe += mc.is_moe_layer(i);
  const double per_matrix = double(mc.hidden) * double(mc.expert_width);
  const double block = double(mc.experts) * 3 * (per_matrix / 2 + per_matrix / 64 * 4);
  const std::string tmp = fs::temp_directory_path().string();
  const std::int64_t resident = peak_of(false, false, tmp + "/eo_cuda_peak_resident");
  const std::int64_t sync = peak_of(true, false, tmp + "/eo_cuda_peak_sync");
  const std::int64_t pre = peak_of(true, true, tmp + "/eo_cuda_peak_prefetch");
  std::printf("peak: resident %.1f MB, offload sync %.1f MB, prefetch %.1f MB; experts %.1f MB (%d blocks of %.1f MB)\n",
              resident / 1e6, sync / 1e6, pre / 1e6, block * moe / 1e6, moe, block / 1e6);
  EXPECT_GE(double(resident - sync), block * moe - 2 * block);
  EXPECT_GE(double(resident - pre), block * moe - 2 * block);
}

// The NF4 kernels give the CPU path's bits (and through it bitsandbytes', see test_nf4): every
// output dtype, blocksizes 32..4096, odd sizes (byte-per-thread kernel) and double quantisation.
TEST(Cuda, Nf4KernelsAreBitIdenticalToTheCpuPath) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(11);
  struct Case { std::int64_t out, in; int bs; bool dq; };
  for (const Case c : {Case{256, 512, 64, false}, Case{33, 65, 64, false}, Case{128, 96, 32, false},
                       Case{64, 4096, 4096, false}, Case{300, 200, 128, true}, Case{7, 9, 64, true}}) {
    at::Tensor w = at::randn({c.out, c.in}) * 0.05;
    w.index_put_({0, 0}, 3.0);  // an outlier block
    const QuantizedWeight cpu = nf4::quantize(w, c.bs, c.dq);
    const QuantizedWeight gpu = nf4::quantize(w.to(dev), c.bs, c.dq);
    ASSERT_TRUE(gpu.packed.is_cuda());
    EXPECT_TRUE(at::equal(gpu.packed.cpu(), cpu.packed)) << c.out << "x" << c.in << " bs " << c.bs;
    if (c.dq) {
      EXPECT_TRUE(at::equal(gpu.nested->absmax_codes.cpu(), cpu.nested->absmax_codes));
      EXPECT_TRUE(at::equal(gpu.nested->nested_absmax.cpu(), cpu.nested->nested_absmax));
      EXPECT_EQ(gpu.nested->offset, cpu.nested->offset);
    } else {
      EXPECT_TRUE(at::equal(gpu.absmax.cpu(), cpu.absmax));
    }
    for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const at::Tensor ref = eo::dequantize(cpu, dt);
      EXPECT_TRUE(at::equal(eo::dequantize(gpu, dt).cpu(), ref)) << c.out << "x" << c.in << " " << dt;
      const QuantizedWeight* two[] = {&gpu, &gpu};
      const at::Tensor stacked = eo::dequantize_stack({two[0], two[1]}, dt).cpu();
      EXPECT_TRUE(at::equal(stacked[1], ref)) << "stacked " << dt;
      if (c.in % 16 == 0) {  // a window of rows and of columns (multiples of 8), as the sliced bank reads it
        const std::int64_t r0 = c.out / 3, rows = c.out / 2, c0 = 8 * (c.in / 32), cols = 8 * (c.in / 16);
        const at::Tensor win = eo::dequantize_stack_window({two[0], two[1]}, dt, r0, rows, c0, cols).cpu();
        EXPECT_TRUE(at::equal(win[1], ref.narrow(0, r0, rows).narrow(1, c0, cols))) << "window " << dt;
      }
    }
  }
}

// Dequantise bandwidth (read + write bytes / time) on a MoE block's worth of experts, the way
// the grouped expert GEMM calls it. Printed for docs/benchmarks.md; the floor catches regressions.
TEST(Cuda, Nf4DequantBandwidth) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  const int experts = 128;
  const std::int64_t out = 768, in = 2048;  // Qwen3-30B-A3B expert gate/up
  std::vector<QuantizedWeight> qs(experts);
  for (int e = 0; e < experts; ++e) {
    qs[e].shape = {out, in};
    qs[e].blocksize = 64;
    qs[e].dtype = at::kBFloat16;
    qs[e].packed = at::randint(0, 256, {out * in / 2, 1}, at::TensorOptions().dtype(at::kByte).device(dev));
    qs[e].absmax = at::rand({out * in / 64}, at::TensorOptions().device(dev));
  }
  std::vector<const QuantizedWeight*> ptrs;
  for (auto& q : qs) ptrs.push_back(&q);
  at::Tensor w = eo::dequantize_stack(ptrs, at::kBFloat16);  // warm-up
  const double bytes = double(experts) * out * in * (0.5 + 4.0 / 64 + 2);  // packed + absmax read, bf16 written
#ifdef EO_WITH_CUDA
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  const int reps = 20;
  cudaEventRecord(a, c10::cuda::getCurrentCUDAStream(0).stream());
  for (int i = 0; i < reps; ++i) w = eo::dequantize_stack(ptrs, at::kBFloat16);
  cudaEventRecord(b, c10::cuda::getCurrentCUDAStream(0).stream());
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  const double tbps = bytes * reps / (ms / 1e3) / 1e12;
  // The same bytes through a plain device copy, for scale.
  at::Tensor src = at::empty({static_cast<std::int64_t>(bytes / 2)}, at::TensorOptions().dtype(at::kByte).device(dev));
  at::Tensor dst = at::empty_like(src);
  dst.copy_(src);
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a, c10::cuda::getCurrentCUDAStream(0).stream());
  for (int i = 0; i < reps; ++i) dst.copy_(src);
  cudaEventRecord(b, c10::cuda::getCurrentCUDAStream(0).stream());
  cudaEventSynchronize(b);
  float copy_ms = 0;
  cudaEventElapsedTime(&copy_ms, a, b);
  const double copy_tbps = bytes * reps / (copy_ms / 1e3) / 1e12;
  std::printf("nf4 dequant: %.2f TB/s (read+write, %d experts of %lldx%lld to bf16, %.3f ms each); device copy %.2f TB/s\n",
              tbps, experts, static_cast<long long>(out), static_cast<long long>(in), ms / reps, copy_tbps);
  EXPECT_GT(tbps, 1.6) << "slower than a naive one-thread-per-byte kernel";
#endif
}

// The fused SwiGLU and RoPE kernels (models/fused_cuda.cu) against float64 math of the same
// formulas: fp32 to fp32 rounding, bf16 within one rounding of the exact value.
namespace {
at::Tensor rotate_half64(const at::Tensor& x) {
  const auto h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}
// HF's x * cos + rotate_half(x) * sin over the first rot dims of [B, T, H, D], cos/sin [B, T, rot].
at::Tensor rope64(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s) {
  const auto rot = c.size(-1), D = x.size(-1);
  const at::Tensor xr = x.narrow(-1, 0, rot);
  const at::Tensor out = xr * c.unsqueeze(2) + rotate_half64(xr) * s.unsqueeze(2);
  return rot == D ? out : at::cat({out, x.narrow(-1, rot, D - rot)}, -1);
}
double rel_max(const at::Tensor& got, const at::Tensor& want) {
  return (got.cpu().to(at::kDouble) - want).abs().max().item<double>() / want.abs().max().item<double>();
}
}  // namespace

// The small-K grouped GEMM kernel (the expert LoRA's B forward and A's dX) against float64:
// every K it takes (8 and 24 padded to the WMMA step), N of one 8-column chunk, one tile and a
// ragged second, both B layouts; experts without rows, tiles that straddle experts, rows past
// the last expert (written zero). Each value within bf16 rounding of the float64 product.
TEST(Cuda, SmallKGroupedMmMatchesFloat64) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(13);
  const std::vector<std::int64_t> counts = {0, 70, 1, 0, 129, 60, 0, 64};  // 324 of 350 rows
  const std::int64_t M = 350, E = static_cast<std::int64_t>(counts.size());
  const at::Tensor offsets = eo::testing::offsets_of(counts, dev);
  const auto bf = at::TensorOptions().dtype(at::kBFloat16).device(dev);
  for (const std::int64_t K : {8, 16, 24, 32, 64})
    for (const std::int64_t N : {8, 136, 768})
      for (const bool transposed : {false, true}) {
        SCOPED_TRACE("K " + std::to_string(K) + " N " + std::to_string(N) + (transposed ? " B^T stored" : " B stored"));
        const at::Tensor a = at::randn({M, K}, bf);
        const at::Tensor b = transposed ? at::randn({E, N, K}, bf).transpose(1, 2) : at::randn({E, K, N}, bf);
        ASSERT_TRUE(model::small_k_kernel_applies(a, b));
        const at::Tensor y = model::small_k_grouped_mm(a, b, offsets).cpu().to(at::kDouble);
        const at::Tensor ref = eo::testing::grouped_mm_f64(a, b, counts);
        // fp32 accumulation, one rounding to bf16 (half an ulp: 2^-9 of the value, 2^-8 here).
        const at::Tensor err = (y - ref).abs() - (ref.abs() * (1.0 / 256) + 1e-6 * ref.abs().max());
        EXPECT_LE(err.max().item<double>(), 0.0);
        EXPECT_TRUE(at::equal(y.narrow(0, 324, M - 324), at::zeros({M - 324, N}, y.options())));
      }
  // Enough tiles that each block runs several (row changes inside a block's run): 128 experts,
  // a quarter of them without rows, 39,000 routed rows of 40,000.
  {
    std::vector<std::int64_t> many(128);
    const at::Tensor draw = at::randint(0, 600, {128}, at::kLong);
    std::int64_t sum = 0;
    for (int e = 0; e < 128; ++e) sum += many[e] = e % 4 == 1 ? 0 : draw[e].item<std::int64_t>();
    many.back() += 39000 - sum;
    ASSERT_GE(many.back(), 0);
    const at::Tensor offs = eo::testing::offsets_of(many, dev);
    for (const std::int64_t K : {16, 32})
      for (const bool transposed : {false, true}) {
        SCOPED_TRACE("128 experts, K " + std::to_string(K) + (transposed ? " B^T stored" : " B stored"));
        const at::Tensor a = at::randn({40000, K}, bf);
        const at::Tensor b = transposed ? at::randn({128, 768, K}, bf).transpose(1, 2) : at::randn({128, K, 768}, bf);
        ASSERT_TRUE(model::small_k_kernel_applies(a, b));
        const at::Tensor y = model::small_k_grouped_mm(a, b, offs).cpu().to(at::kDouble);
        const at::Tensor ref = eo::testing::grouped_mm_f64(a, b, many);
        const at::Tensor err = (y - ref).abs() - (ref.abs() * (1.0 / 256) + 1e-6 * ref.abs().max());
        EXPECT_LE(err.max().item<double>(), 0.0);
        EXPECT_TRUE(at::equal(y.narrow(0, 39000, 1000), at::zeros({1000, 768}, y.options())));
      }
  }
  // Through autograd as the expert LoRA uses it: B forward (down [M, 16] · B^T) and the A GEMM
  // (x · A^T, whose dX is the small-K product d_down · A), on rows every expert covers.
  model::set_small_k_kernel_enabled(true);
  const std::vector<std::int64_t> full = {40, 0, 100, 70, 1, 0, 93, 16};
  const at::Tensor offs = eo::testing::offsets_of(full, dev);
  for (const auto& [K, N] : {std::pair<std::int64_t, std::int64_t>{16, 768}, {2048, 32}}) {
    SCOPED_TRACE("a [M, " + std::to_string(K) + "] . [E, " + std::to_string(K) + ", " + std::to_string(N) + "]");
    const at::Tensor a0 = at::randn({320, K}, bf), w0 = at::randn({E, N, K}, bf), dy = at::randn({320, N}, bf);
    const at::Tensor a = a0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    const at::Tensor y = model::grouped_mm(a, w.transpose(1, 2), offs);
    y.backward(dy);
    const double y_err = rel_max(y.detach(), eo::testing::grouped_mm_f64(a0, w0.transpose(1, 2), full));
    const double da_err = rel_max(a.grad(), eo::testing::grouped_mm_f64(dy, w0, full));
    at::Tensor dw = at::zeros({E, N, K}, at::kDouble);
    for (std::int64_t e = 0, row = 0; e < E; row += full[e], ++e)
      dw[e] = at::mm(dy.narrow(0, row, full[e]).t().cpu().to(at::kDouble), a0.narrow(0, row, full[e]).cpu().to(at::kDouble));
    EXPECT_LT(y_err, 8e-3);
    EXPECT_LT(da_err, 8e-3);
    EXPECT_LT(rel_max(w.grad(), dw), 8e-3);
  }
  model::set_small_k_kernel_enabled(false);
}

// The expert LoRA's deltas in the kernels: SwiGLU over g0 + g1 and u0 + u1 (its two outputs'
// gradients summed in the backward kernel); the combine
// (routing-weighted gather-sum, with and without the down delta; its scaled-gather and gather-dot
// backward); the dispatch's gather-and-sum backward (vectorised rows of 64 and a row of 67 values
// that is not).
TEST(Cuda, SwiGluDeltasAndMoeGathersMatchFloat64) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(6);
  for (const auto dt : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(dt == at::kFloat ? "fp32" : "bf16");
    const double tol = dt == at::kFloat ? 1e-6 : 8e-3;
    for (const std::int64_t cols : {40, 41}) {  // 16-byte chunks, and one value per thread
      SCOPED_TRACE("swiglu cols " + std::to_string(cols));
      std::vector<at::Tensor> host, leaves, leaves64;
      for (int i = 0; i < 4; ++i) {
        host.push_back((at::randn({199, cols}) * (i == 0 ? 3 : 1)).to(dt));
        leaves.push_back(host.back().to(dev).requires_grad_(true));
        leaves64.push_back(host.back().to(at::kDouble).requires_grad_(true));
      }
      // h's two outputs, each with its own gradient (the down GEMM's and the down LoRA's): the
      // kernel sums them.
      const at::Tensor dh = at::randn({199, cols}).to(dt), dh2 = at::randn({199, cols}).to(dt);
      const auto [h, h2] = model::swiglu_twice(leaves[0], leaves[1], leaves[2], leaves[3]);
      torch::autograd::backward({h, h2}, {dh.to(dev), dh2.to(dev)});
      const at::Tensor g64 = leaves64[0] + leaves64[2], u64 = leaves64[1] + leaves64[3];
      const at::Tensor ref = g64 * at::sigmoid(g64) * u64;
      ref.backward(dh.to(at::kDouble) + dh2.to(at::kDouble));
      EXPECT_LT(rel_max(h.detach(), ref.detach()), tol);
      for (int i = 0; i < 4; ++i) EXPECT_LT(rel_max(leaves[i].grad(), leaves64[i].grad()), tol) << "input " << i;
    }

    for (const std::int64_t cols : {64, 67}) {
      SCOPED_TRACE("cols " + std::to_string(cols));
      // 100 tokens routed to k = 3 of 7 experts, their (token, slot) pairs in expert order.
      const std::int64_t tokens = 100, k = 3;
      const at::Tensor experts = at::randint(0, 7, {tokens * k}, at::kLong);
      const at::Tensor ord = at::argsort(experts, /*stable=*/true, 0, false);
      const at::Tensor pos = at::empty_like(ord).scatter_(0, ord, at::arange(tokens * k, at::kLong));
      const at::Tensor token_of = at::floor_divide(ord, k);
      // The combine: each token's k rows in expert order, routing-weighted and summed, with and
      // without the down LoRA's delta; the rows', delta's and weights' gradients.
      {
        const at::Tensor dout = at::randn({tokens, cols}).to(dt);
        for (const bool with_delta : {false, true}) {
          SCOPED_TRACE(with_delta ? "combine with the delta" : "combine");
          const at::Tensor y0 = at::randn({tokens * k, cols}).to(dt), d0 = at::randn({tokens * k, cols}).to(dt);
          const at::Tensor w0 = at::rand({tokens, k}).to(dt);
          at::Tensor y = y0.to(dev).requires_grad_(true), w = w0.to(dev).requires_grad_(true);
          at::Tensor d = with_delta ? d0.to(dev).requires_grad_(true) : at::Tensor();
          const at::Tensor out = model::combine_rows(y, d, w, pos.to(dev), token_of.to(dev), ord.to(dev));
          out.backward(dout.to(dev));
          at::Tensor y64 = y0.to(at::kDouble).requires_grad_(true), w64 = w0.to(at::kDouble).requires_grad_(true);
          at::Tensor d64 = d0.to(at::kDouble).requires_grad_(true);
          const at::Tensor rows64 = (with_delta ? y64 + d64 : y64).index_select(0, pos).view({tokens, k, cols});
          const at::Tensor ref = at::bmm(w64.view({tokens, 1, k}), rows64).view({tokens, cols});
          ref.backward(dout.to(at::kDouble));
          EXPECT_LT(rel_max(out.detach(), ref.detach()), tol);
          EXPECT_LT(rel_max(y.grad(), y64.grad()), tol);
          EXPECT_LT(rel_max(w.grad(), w64.grad()), tol);
          if (with_delta) EXPECT_TRUE(at::equal(d.grad().cpu(), y.grad().cpu()));  // the same gradient
        }
      }

      // The dispatch: every token copied k times in expert order; its backward gathers and sums
      // each token's k gradients in one kernel.
      const at::Tensor t0 = at::randn({tokens, cols}).to(dt), dz = at::randn({tokens * k, cols}).to(dt);
      at::Tensor t = t0.to(dev).requires_grad_(true);
      const at::Tensor z = model::gather_rows(t, token_of.to(dev), pos.to(dev), k);
      EXPECT_TRUE(at::equal(z.detach().cpu(), t0.index_select(0, token_of)));
      z.backward(dz.to(dev));
      at::Tensor t64 = t0.to(at::kDouble).requires_grad_(true);
      t64.index_select(0, token_of).backward(dz.to(at::kDouble));
      EXPECT_LT(rel_max(t.grad(), t64.grad()), tol);
    }
  }
}

TEST(Cuda, FusedSwiGluAndRopeMatchFloat64) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(5);
  for (const auto dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(dt == at::kFloat ? "fp32" : dt == at::kBFloat16 ? "bf16" : "fp16");
    // One rounding is 2^-9 relative in bf16, 2^-11 in fp16 (the T4's compute dtype): four of them.
    const double tol = dt == at::kFloat ? 1e-6 : dt == at::kBFloat16 ? 8e-3 : 2e-3;
    {
      const at::Tensor g0 = (at::randn({300, 67}) * 3).to(dt), u0 = at::randn({300, 67}).to(dt), dh0 = at::randn({300, 67}).to(dt);
      at::Tensor g = g0.to(dev).requires_grad_(true), u = u0.to(dev).requires_grad_(true);
      const at::Tensor h = model::swiglu(g, u);
      h.backward(dh0.to(dev));
      at::Tensor g64 = g0.to(at::kDouble).requires_grad_(true), u64 = u0.to(at::kDouble).requires_grad_(true);
      const at::Tensor ref = g64 * at::sigmoid(g64) * u64;
      ref.backward(dh0.to(at::kDouble));
      EXPECT_EQ(h.scalar_type(), dt);
      EXPECT_LT(rel_max(h.detach(), ref.detach()), tol);
      EXPECT_LT(rel_max(g.grad(), g64.grad()), tol);
      EXPECT_LT(rel_max(u.grad(), u64.grad()), tol);
    }
    for (const std::int64_t rot : {16, 8}) {  // full and partial rotary
      SCOPED_TRACE("rot " + std::to_string(rot));
      const std::int64_t B = 2, T = 37, H = 3, D = 16;
      const at::Tensor x0 = at::randn({B, T, H, D}).to(dt), dy0 = at::randn({B, T, H, D}).to(dt);
      const at::Tensor ang = at::rand({B, T, rot / 2}) * 20;
      const at::Tensor emb = at::cat({ang, ang}, -1);
      const at::Tensor c0 = emb.cos().to(dt), s0 = emb.sin().to(dt);
      at::Tensor x = x0.to(dev).requires_grad_(true);
      // The projection's layout as the decoder hands it over, and a transposed gradient as SDPA
      // gives it back.
      const at::Tensor y = model::rope(x, c0.to(dev), s0.to(dev));
      y.transpose(1, 2).backward(dy0.to(dev).transpose(1, 2));
      at::Tensor x64 = x0.to(at::kDouble).requires_grad_(true);
      const at::Tensor ref = rope64(x64, c0.to(at::kDouble), s0.to(at::kDouble));
      ref.backward(dy0.to(at::kDouble));
      EXPECT_LT(rel_max(y.detach(), ref.detach()), tol);
      EXPECT_LT(rel_max(x.grad(), x64.grad()), tol);
    }
  }
}

// The sliced bank (ExpertBank::max_bytes: forward in slices of output rows, backward in slices of
// input columns) against the whole bank, on the same NF4 experts and token-sorted rows: each
// output element is the same dot product, so only the GEMM's own tiling may differ.
TEST(Cuda, GroupedExpertSlicesMatchTheWholeBank) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  const int E = 4;
  const std::int64_t h = 256, i = 192;
  model::ResidentWeights::Bank bank = big_bank(1, E, h, i);
  for (auto& e : bank[0])
    for (auto& q : e) q = nf4::quantize(eo::dequantize(q, at::kFloat).to(dev), 64, /*double_quant=*/true);
  model::ResidentWeights provider(std::move(bank));
  const std::vector<std::int64_t> counts = {37, 0, 64, 27};
  const at::Tensor offsets = at::tensor(counts, at::kLong).cumsum(0).to(at::kInt).to(dev);
  at::manual_seed(3);
  const at::Tensor x0 = at::randn({128, h}).to(dev, at::kBFloat16), x2 = at::randn({128, i}).to(dev, at::kBFloat16);
  for (const auto m : {model::ExpertMatrix::Gate, model::ExpertMatrix::Down}) {
    const bool down = m == model::ExpertMatrix::Down;
    const at::Tensor& xin = down ? x2 : x0;
    const std::int64_t out = down ? h : i;
    const at::Tensor dy = at::randn({128, out}).to(dev, at::kBFloat16);
    auto run = [&](std::int64_t max_bytes) {
      model::ExpertBank b;
      b.provider = &provider;
      b.layer = 0;
      b.experts = E;
      b.matrix = m;
      b.max_bytes = max_bytes;
      at::Tensor x = xin.clone().requires_grad_(true);
      const at::Tensor y = model::grouped_expert_linear(x, offsets, b);
      y.backward(dy);
      return std::make_pair(y.detach(), x.grad());
    };
    const auto [y_whole, dx_whole] = run(0);
    // 64-row and 64-column slices: 3 or 4 of each.
    const auto [y_sliced, dx_sliced] = run(std::int64_t(E) * 64 * 256 * 2);
    auto rel = [](const at::Tensor& a, const at::Tensor& b) {
      return (a.to(at::kFloat) - b.to(at::kFloat)).norm().item<double>() / b.to(at::kFloat).norm().item<double>();
    };
    EXPECT_LT(rel(y_sliced, y_whole), 1e-3) << (down ? "down" : "gate");
    EXPECT_LT(rel(dx_sliced, dx_whole), 1e-3) << (down ? "down" : "gate");
    std::printf("sliced bank (%s): forward %s, backward %s to the whole bank\n", down ? "down" : "gate",
                at::equal(y_sliced, y_whole) ? "bitwise equal" : "close", at::equal(dx_sliced, dx_whole) ? "bitwise equal" : "close");
  }
}

// The grouped-GEMM expert path (GPU, bf16) against the per-expert loop it replaces: same loss and
// LoRA gradients within bf16 rounding, for NF4 experts.
TEST(Cuda, GroupedExpertsMatchThePerExpertLoop) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  model::LoadOptions lo;
  lo.dtype = at::kBFloat16;
  lo.load_in_4bit = true;
  lo.device = dev;
  auto m = model::MoeModel::load(std::string(EO_SOURCE_DIR) + "/fixtures/tiny-qwen3-moe", lo);
  model::LoraSpec spec;
  spec.r = 8;
  spec.alpha = 16;
  spec.targets = {"q_proj", "v_proj", "o_proj"};
  m->add_lora(spec);
  {
    at::NoGradGuard ng;  // non-zero B so every LoRA factor gets a gradient
    for (auto& [n, p] : m->lora_parameters()) p.normal_(0, 0.05);
  }
  expect_grouped_matches_loop(*m, dev);
}

namespace {
// One expert LoRA's factors drawn once and copied into its CPU and GPU twins.
void draw_same_lora(model::ExpertLora& cpu, model::ExpertLora& gpu) {
  at::NoGradGuard ng;
  const auto E = cpu.A().size(0), r = cpu.A().size(1), in = cpu.A().size(2), out = cpu.B().size(1);
  const at::Tensor a = at::rand({E, r, in}) * 0.1 - 0.05, b = at::randn({E, out, r}) * 0.05;
  cpu.A().copy_(a);
  cpu.B().copy_(b);
  gpu.A().copy_(a.to(gpu.A().device()));
  gpu.B().copy_(b.to(gpu.B().device()));
}
// Rows per expert for the grouped LoRA tests: uneven, one expert without a row.
const std::vector<std::int64_t> kLoraRows = {40, 0, 17, 64, 3, 1, 30, 101};
// |got - want| / |want| (Frobenius), in float64 on the CPU.
double norm_rel(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor w = want.detach().to(at::kCPU, at::kDouble);
  return (got.detach().to(at::kCPU, at::kDouble) - w).norm().item<double>() / w.norm().item<double>();
}
}  // namespace

// Expert LoRA as grouped GEMMs (GPU, bf16) against the CPU fp32 per-expert path on the same
// block-sized problem, forward and backward, with an expert that gets no row. Tolerance: bf16
// rounds x, A, B, dy, the [N, r] intermediate and the output once each (unit roundoff 2^-9 ≈
// 2e-3, accumulation in fp32), ≈ 5e-3 norm-relative in all; 2e-2 leaves a 4x margin.
TEST(Cuda, GroupedExpertLoraMatchesCpuFp32) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  const int E = 8;
  const std::int64_t in = 256, out = 128;
  model::LoraSpec spec;
  spec.r = 16;
  spec.alpha = 32;
  model::ExpertLora cpu(E, in, out, spec, at::kCPU), gpu(E, in, out, spec, dev);
  at::manual_seed(11);
  draw_same_lora(cpu, gpu);
  const std::vector<std::int64_t>& counts = kLoraRows;
  std::int64_t N = 0;
  for (auto c : counts) N += c;
  const at::Tensor x0 = at::randn({N, in}), dy = at::randn({N, out});

  at::Tensor xc = x0.clone().requires_grad_(true);
  const model::ExpertLora::Slices s = cpu.slices();
  std::vector<at::Tensor> ys;
  std::int64_t off = 0;
  for (int e = 0; e < E; ++e) {
    if (counts[e]) ys.push_back(cpu.add_to(s, e, at::zeros({counts[e], out}), xc.narrow(0, off, counts[e]), false));
    off += counts[e];
  }
  const at::Tensor y_ref = at::cat(ys);
  y_ref.backward(dy);

  at::Tensor xg = x0.to(dev, at::kBFloat16).requires_grad_(true);
  const at::Tensor offsets = at::tensor(counts, at::kLong).cumsum(0).to(at::kInt).to(dev);
  const at::Tensor y = gpu.delta_grouped(xg, offsets, false);
  y.backward(dy.to(dev, at::kBFloat16));
  ASSERT_EQ(y.scalar_type(), at::kBFloat16);
  ASSERT_EQ(gpu.A().grad().scalar_type(), at::kFloat);  // fp32 master gradients

  EXPECT_LT(norm_rel(y, y_ref), 2e-2);
  EXPECT_LT(norm_rel(xg.grad(), xc.grad()), 2e-2);
  EXPECT_LT(norm_rel(gpu.A().grad(), cpu.A().grad()), 2e-2);
  EXPECT_LT(norm_rel(gpu.B().grad(), cpu.B().grad()), 2e-2);
  // The expert without rows: exactly zero gradients (no stale memory from the grouped kernel).
  EXPECT_EQ(gpu.A().grad()[1].abs().max().item<double>(), 0.0);
  EXPECT_EQ(gpu.B().grad()[1].abs().max().item<double>(), 0.0);
}

// Gate's and up's LoRA as one paired A GEMM (delta_grouped_pair, as the MoE block runs them):
// both deltas, dX and all four factors' gradients against the per-expert fp32 loop on the CPU.
TEST(Cuda, GroupedExpertLoraPairMatchesCpuFp32) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  const int E = 8;
  const std::int64_t in = 256, out = 192;
  model::LoraSpec spec;
  spec.r = 16;
  spec.alpha = 32;
  model::ExpertLora c1(E, in, out, spec, at::kCPU), c2(E, in, out, spec, at::kCPU);
  model::ExpertLora g1(E, in, out, spec, dev), g2(E, in, out, spec, dev);
  at::manual_seed(12);
  draw_same_lora(c1, g1);
  draw_same_lora(c2, g2);
  const std::vector<std::int64_t>& counts = kLoraRows;
  std::int64_t N = 0;
  for (auto c : counts) N += c;
  const at::Tensor x0 = at::randn({N, in}), dy1 = at::randn({N, out}), dy2 = at::randn({N, out});

  at::Tensor xc = x0.clone().requires_grad_(true);
  const model::ExpertLora::Slices s1 = c1.slices(), s2 = c2.slices();
  std::vector<at::Tensor> y1s, y2s;
  std::int64_t off = 0;
  for (int e = 0; e < E; ++e) {
    if (counts[e]) {
      const at::Tensor xe = xc.narrow(0, off, counts[e]), z = at::zeros({counts[e], out});
      y1s.push_back(c1.add_to(s1, e, z, xe, false));
      y2s.push_back(c2.add_to(s2, e, z, xe, false));
    }
    off += counts[e];
  }
  const at::Tensor y1_ref = at::cat(y1s), y2_ref = at::cat(y2s);
  ((y1_ref * dy1).sum() + (y2_ref * dy2).sum()).backward();

  ASSERT_TRUE(g1.can_pair_with(g2, true));
  at::Tensor xg = x0.to(dev, at::kBFloat16).requires_grad_(true);
  const at::Tensor offsets = at::tensor(counts, at::kLong).cumsum(0).to(at::kInt).to(dev);
  const auto [y1, y2] = model::ExpertLora::delta_grouped_pair(g1, g2, xg, offsets, true);
  ((y1.to(at::kFloat) * dy1.to(dev)).sum() + (y2.to(at::kFloat) * dy2.to(dev)).sum()).backward();

  EXPECT_LT(norm_rel(y1, y1_ref), 2e-2);
  EXPECT_LT(norm_rel(y2, y2_ref), 2e-2);
  EXPECT_LT(norm_rel(xg.grad(), xc.grad()), 2e-2);
  EXPECT_LT(norm_rel(g1.A().grad(), c1.A().grad()), 2e-2);
  EXPECT_LT(norm_rel(g1.B().grad(), c1.B().grad()), 2e-2);
  EXPECT_LT(norm_rel(g2.A().grad(), c2.A().grad()), 2e-2);
  EXPECT_LT(norm_rel(g2.B().grad(), c2.B().grad()), 2e-2);
}

namespace {

// fused: lora_target_parameters (gate_up_proj's one LoRA over [gate; up], down_proj's).
std::unique_ptr<model::MoeModel> tiny_bf16_with_expert_lora(const at::Device& dev, bool fused = false,
                                                            at::ScalarType dtype = at::kBFloat16) {
  model::LoadOptions lo;
  lo.dtype = dtype;
  lo.load_in_4bit = true;
  lo.device = dev;
  auto m = model::MoeModel::load(std::string(EO_SOURCE_DIR) + "/fixtures/tiny-qwen3-moe", lo);
  model::LoraSpec spec;
  spec.r = 8;
  spec.alpha = 16;
  spec.targets = {"q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"};
  if (fused) spec.target_parameters = {model::kGateUpParam, model::kDownParam};
  m->add_lora(spec);
  at::NoGradGuard ng;  // non-zero B so every LoRA factor gets a gradient
  at::manual_seed(3);
  for (auto& [n, p] : m->lora_parameters()) p.normal_(0, 0.05);
  return m;
}

}  // namespace

// The whole tiny model with expert LoRA on every expert matrix: the grouped path (base and
// LoRA grouped GEMMs) against the per-expert loop over the same stacked adapters, bf16 both,
// with GroupedExpertsMatchThePerExpertLoop's tolerances.
TEST(Cuda, GroupedExpertLoraModelMatchesThePerExpertLoop) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  auto m = tiny_bf16_with_expert_lora(dev);
  auto ref = tiny_bf16_with_expert_lora(dev, false, at::kFloat);
  expect_grouped_matches_loop(*m, dev, ref.get());
}

// The same with lora_target_parameters: the fused gate_up delta as one grouped GEMM pair split
// into gate and up, against the loop's per-expert [gate; up] LoRA.
TEST(Cuda, GroupedFusedExpertLoraModelMatchesThePerExpertLoop) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  auto m = tiny_bf16_with_expert_lora(dev, /*fused=*/true);
  auto ref = tiny_bf16_with_expert_lora(dev, /*fused=*/true, at::kFloat);
  expect_grouped_matches_loop(*m, dev, ref.get());
}

// One MoE block with expert LoRA, forward and backward, never waits for the device on the host
// (CUDA's sync debug mode turns any synchronising call into an error).
TEST(Cuda, ExpertLoraBlockRunsWithoutHostSync) {
  REQUIRE_CUDA();
#ifdef EO_WITH_CUDA
  const at::Device dev(at::kCUDA, 0);
  auto m = tiny_bf16_with_expert_lora(dev);
  model::Batch b;
  b.input_ids = at::randint(0, m->config().vocab, {2, 64}, at::kLong).to(dev);
  const model::BlockContext ctx = m->context(b, true);
  const at::Tensor x = m->embed(b.input_ids).detach().requires_grad_(true);
  synchronize(dev);
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  std::string error;
  try {
    const at::Tensor y = m->block(0).forward(x, ctx);
    y.backward(at::ones_like(y));
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  EXPECT_EQ(error, "") << "a host synchronisation inside the block";
  synchronize(dev);
  for (const auto& [n, p] : m->lora_parameters())
    if (n.find("layers.0.") != std::string::npos) EXPECT_TRUE(p.grad().defined()) << n;
#endif
}

// The fused multi-tensor AdamW and the clip on CUDA tensors against the same on the CPU (the
// CPU path is checked against torch's AdamW in test_optimizer): 4 steps, fp32 both sides, so
// only the kernels' rounding differs (1e-5 relative); one clip norm within 1e-6. The trainer's
// form, the clip as AdamW's grad_scale, gives the same parameters and moments.
TEST(Cuda, FusedAdamWAndClipMatchTheCpu) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  TrainConfig cfg;
  cfg.learning_rate = 1e-2;
  cfg.weight_decay = 0.1;
  at::manual_seed(5);
  NamedTensors cpu, gpu;
  for (int i = 0; i < 50; ++i) {
    const at::Tensor t = at::randn({3 + i, 8});
    const std::string name = "m.layers." + std::to_string(i) + (i % 7 == 3 ? ".norm.weight" : ".q_proj.lora_A.weight");
    cpu.emplace_back(name, t.clone().requires_grad_(true));
    gpu.emplace_back(name, t.to(dev).requires_grad_(true));
  }
  NamedTensors gpu_in_step;  // the trainer's form: the clip as the fused kernel's grad_scale
  for (const auto& [n, t] : gpu) gpu_in_step.emplace_back(n, t.detach().clone().requires_grad_(true));
  Optimizer oc(cpu, cfg), og(gpu, cfg), os(gpu_in_step, cfg);
  for (int step = 0; step < 4; ++step) {
    for (std::size_t i = 0; i < cpu.size(); ++i) {
      const at::Tensor g = at::randn_like(cpu[i].second) * (1 + step);
      cpu[i].second.mutable_grad() = g;
      gpu[i].second.mutable_grad() = g.to(dev);
      gpu_in_step[i].second.mutable_grad() = g.to(dev);
    }
    std::vector<at::Tensor> pc, pg, ps;
    for (std::size_t i = 0; i < cpu.size(); ++i) {
      pc.push_back(cpu[i].second);
      pg.push_back(gpu[i].second);
      ps.push_back(gpu_in_step[i].second);
    }
    const double nc = clip_grad_norm(pc, 5.0), ng = clip_grad_norm(pg, 5.0);
    EXPECT_NEAR(ng, nc, 1e-6 * nc) << "step " << step;
    oc.step(1e-2);
    og.step(1e-2);
    os.step(1e-2, at::Tensor(), clip_divisor(grad_norm_on_device(ps), 5.0));
  }
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    const double scale = cpu[i].second.detach().abs().max().item<double>();
    const at::Tensor d = (gpu[i].second.detach().cpu() - cpu[i].second.detach()).abs().max();
    EXPECT_LT(d.item<double>(), 1e-5 * scale) << cpu[i].first;
    const at::Tensor ds = (gpu_in_step[i].second.detach().cpu() - cpu[i].second.detach()).abs().max();
    EXPECT_LT(ds.item<double>(), 1e-5 * scale) << cpu[i].first << " (clipped inside the step)";
  }
  // The moments saw the clipped gradients. Clipped inside the step against clipped first, both
  // on CUDA: within fp32 rounding. Against the CPU: torch's CUDA kernel forms 1 - beta2 from an
  // fp32 beta2 (0.999f: 1 - beta2 is 1.29e-5 low), the CPU kernel in double, so exp_avg_sq
  // differs by that much (a missing clip would be off by (norm / 5)^2, over 100x).
  const auto sc = oc.state(), sg = og.state(), ss = os.state();
  ASSERT_EQ(sc.size(), ss.size());
  ASSERT_EQ(sg.size(), ss.size());
  for (std::size_t i = 0; i < sc.size(); ++i) {
    const double scale = sc[i].second.abs().max().item<double>();
    EXPECT_LT((ss[i].second - sg[i].second).abs().max().item<double>(), 1e-6 * scale + 1e-12) << ss[i].first;
    EXPECT_LT((ss[i].second.cpu() - sc[i].second).abs().max().item<double>(), 2e-5 * scale + 1e-12) << sc[i].first;
  }
}


// ---- MXFP4 experts (gpt-oss as the Hub ships it): the CUDA kernel against the CPU path, bit for bit
// (the CPU path is checked against transformers in test_model, Mxfp4.*), and the kernel in use.
namespace {

bool same_bits(const at::Tensor& a, const at::Tensor& b) {  // -0 and +0 differ, inf equals inf
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  return a.scalar_type() == at::kFloat ? a.view(at::kInt).equal(b.view(at::kInt)) : a.view(at::kShort).equal(b.view(at::kShort));
}

// A tiny gpt-oss config.json whose experts are MXFP4 (quant_method mxfp4), for synthetic weights:
// H = I = 256 (multiples of 32), 8 experts, top-4, the tiny fixture's vocabulary.
std::string tiny_mxfp4_gpt_oss(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / name;
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
    "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 256, "num_local_experts": 8, "num_experts_per_tok": 4, "experts_per_token": 4,
    "vocab_size": 256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 7.0,
    "attention_bias": true, "tie_word_embeddings": false, "initializer_range": 0.02, "router_aux_loss_coef": 0.9,
    "output_router_logits": false,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
      "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}})";
  return dir.string();
}

}  // namespace

// Every code at every scale byte (256 rows of 16 groups, each group's 16 bytes all different),
// gpt-oss-20b's row length (2880: 90 groups), odd row counts; every output dtype; whole matrices,
// stacks of more matrices than one launch takes (64) and windows of rows and columns (multiples
// of 8), as the grouped GEMM's sliced bank reads them.
TEST(Cuda, Mxfp4KernelIsBitIdenticalToTheCpuPath) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(13);
  const auto u8 = at::TensorOptions().dtype(at::kByte);
  at::Tensor all_blocks = at::arange(256, at::kInt).to(at::kByte).view({1, 16, 16}).expand({256, 16, 16}).contiguous();
  at::Tensor all_scales = at::arange(256, at::kInt).to(at::kByte).view({256, 1}).expand({256, 16}).contiguous();
  struct Case { at::Tensor blocks, scales; };
  std::vector<Case> cases = {{all_blocks, all_scales}};
  for (const auto& [rows, groups] : std::vector<std::pair<std::int64_t, std::int64_t>>{{96, 90}, {33, 2}, {7, 1}})
    cases.push_back({at::randint(0, 256, {rows, groups, 16}, u8), at::randint(110, 140, {rows, groups}, u8)});
  for (const Case& c : cases) {
    const QuantizedWeight cpu = mxfp4::weight(c.blocks, c.scales);
    const QuantizedWeight gpu = mxfp4::weight(c.blocks.to(dev), c.scales.to(dev));
    ASSERT_TRUE(gpu.packed.is_cuda() && gpu.scales.is_cuda());
    const std::int64_t rows = cpu.shape[0], cols = cpu.shape[1];
    for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
      SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + " " + std::string(at::toString(dt)));
      const at::Tensor ref = eo::dequantize(cpu, dt);
      EXPECT_TRUE(same_bits(eo::dequantize(gpu, dt).cpu(), ref)) << "whole";
      std::vector<const QuantizedWeight*> many(70, &gpu);  // two launches
      const at::Tensor stacked = eo::dequantize_stack(many, dt).cpu();
      EXPECT_TRUE(same_bits(stacked[0], ref) && same_bits(stacked[69], ref)) << "stacked";
      const std::int64_t r0 = rows / 3, nr = std::max<std::int64_t>(1, rows / 2), c0 = 8 * (cols / 32), nc = 8 * std::max<std::int64_t>(1, cols / 16);
      const at::Tensor win = eo::dequantize_stack_window({&gpu, &gpu}, dt, r0, nr, c0, nc).cpu();
      EXPECT_TRUE(same_bits(win[1], ref.narrow(0, r0, nr).narrow(1, c0, nc).contiguous())) << "window";
      EXPECT_TRUE(same_bits(win[1], eo::dequantize_stack_window({&cpu}, dt, r0, nr, c0, nc)[0])) << "window vs CPU window";
    }
  }
}

// NVFP4 (modelopt checkpoints): the CUDA kernel against the CPU path (checked against the float64
// definition in test_model, Nvfp4.*), NaN where it is NaN (NaN payloads differ) and bitwise
// elsewhere: every code at every E4M3 scale byte under global scales from fp32 subnormals to
// overflow, a real row length (2048: 128 groups) and odd row counts; whole, stacked past one launch
// (64), and windowed.
TEST(Cuda, Nvfp4KernelIsBitIdenticalToTheCpuPath) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(19);
  const auto u8 = at::TensorOptions().dtype(at::kByte);
  auto same = [](const at::Tensor& a, const at::Tensor& b) {
    const at::Tensor an = a.isnan(), bn = b.isnan();
    return an.equal(bn) && same_bits(a.masked_fill(an, 0), b.masked_fill(bn, 0));
  };
  const at::Tensor all_codes = (at::arange(64, at::kInt).view({1, 64}) + 64 * (at::arange(256, at::kInt).view({256, 1}) % 4)).to(at::kByte);
  const at::Tensor all_scales = at::arange(256, at::kInt).to(at::kByte).view({256, 1}).expand({256, 8}).contiguous();
  struct Case { at::Tensor codes, scales; float global; };
  std::vector<Case> cases;
  for (float g : {1.0f, 3.7e-4f, std::ldexp(1.0f, -140), 3.4e38f, 0.0f, -0.75f}) cases.push_back({all_codes, all_scales, g});
  for (const auto& [rows, in] : std::vector<std::pair<std::int64_t, std::int64_t>>{{96, 2048}, {33, 32}, {7, 16}})
    cases.push_back({at::randint(0, 256, {rows, in / 2}, u8), at::randint(0, 127, {rows, in / 16}, u8), 2.5e-3f});
  for (const Case& c : cases) {
    const at::Tensor global = at::full({1}, c.global, at::TensorOptions().dtype(at::kFloat));
    const QuantizedWeight cpu = nvfp4::weight(c.codes, c.scales, global);
    const QuantizedWeight gpu = nvfp4::weight(c.codes.to(dev), c.scales.to(dev), global.to(dev));
    ASSERT_TRUE(gpu.packed.is_cuda() && gpu.scales.is_cuda() && gpu.global_scale.is_cuda());
    const std::int64_t rows = cpu.shape[0], cols = cpu.shape[1];
    for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
      SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + " global " + std::to_string(c.global) + " " +
                   std::string(at::toString(dt)));
      const at::Tensor ref = eo::dequantize(cpu, dt);
      EXPECT_TRUE(same(eo::dequantize(gpu, dt).cpu(), ref)) << "whole";
      std::vector<const QuantizedWeight*> many(70, &gpu);  // two launches
      const at::Tensor stacked = eo::dequantize_stack(many, dt).cpu();
      EXPECT_TRUE(same(stacked[0], ref) && same(stacked[69], ref)) << "stacked";
      const std::int64_t r0 = rows / 3, nr = std::max<std::int64_t>(1, rows / 2), c0 = 8 * (cols / 32), nc = 8 * std::max<std::int64_t>(1, cols / 16);
      const at::Tensor win = eo::dequantize_stack_window({&gpu, &gpu}, dt, r0, nr, c0, nc).cpu();
      EXPECT_TRUE(same(win[1], ref.narrow(0, r0, nr).narrow(1, c0, nc).contiguous())) << "window";
    }
  }
}

// fp16 (the T4's compute dtype) out of the dequantisation kernels against float64. MXFP4: each
// value is e2m1 x 2^(scale - 127), computed here in float64 from the bytes (OCP MX's e2m1 table),
// exact in bf16 for the scales used, so the kernel's fp16 is that value rounded to nearest-even
// (bit for bit: subnormals, and inf past 65504 at the largest scales). NF4: within half an fp16
// ulp (and 2^-13 of one for the fp32 product the kernel rounds from) of the fp32 dequantisation
// read as float64 (itself 2^-24 relative of code x absmax).
TEST(Cuda, Fp16DequantisationMatchesFloat64WithinRounding) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(17);
  {
    const std::int64_t rows = 64, groups = 4;
    const at::Tensor blocks = at::randint(0, 256, {rows, groups, 16}, at::TensorOptions().dtype(at::kByte));
    const at::Tensor scales = at::randint(100, 150, {rows, groups}, at::TensorOptions().dtype(at::kByte));
    const double e2m1[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
    at::Tensor want = at::empty({rows, groups * 32}, at::TensorOptions().dtype(at::kDouble));
    auto b = blocks.accessor<std::uint8_t, 3>();
    auto sc = scales.accessor<std::uint8_t, 2>();
    auto w = want.accessor<double, 2>();
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t g = 0; g < groups; ++g)
        for (int j = 0; j < 16; ++j)
          for (int half = 0; half < 2; ++half) {  // low nibble: the even element
            const int code = half ? b[r][g][j] >> 4 : b[r][g][j] & 15;
            const double v = e2m1[code & 7] * std::ldexp(1.0, int(sc[r][g]) - 127);
            w[r][g * 32 + 2 * j + half] = code & 8 ? -v : v;
          }
    const QuantizedWeight q = mxfp4::weight(blocks.to(dev), scales.to(dev));
    const at::Tensor got = eo::dequantize(q, at::kHalf).cpu();
    ASSERT_EQ(got.sizes(), want.sizes());
    EXPECT_TRUE(same_bits(got, want.to(at::kHalf))) << "MXFP4 -> fp16";
    EXPECT_GT(at::isinf(got).sum().item<std::int64_t>(), 0) << "the largest scales overflow fp16 (inf, as the rounding does)";
  }
  for (const bool dq : {false, true}) {
    at::Tensor w = at::randn({96, 256}) * 0.05;
    w.index_put_({0, 0}, 3.0);
    w.index_put_({1, 5}, 1e-3);
    const QuantizedWeight gpu = nf4::quantize(w.to(dev), 64, dq);
    const at::Tensor want = eo::dequantize(gpu, at::kFloat).cpu().to(at::kDouble);
    const at::Tensor got = eo::dequantize(gpu, at::kHalf).cpu().to(at::kDouble);
    // fp16's ulp at each value: 2^(exponent - 10) for normals, 2^-24 below 2^-14.
    const at::Tensor e = at::floor(at::log2(want.abs().clamp_min(std::ldexp(1.0, -14))));
    const at::Tensor ulp = at::exp2(e - 10);
    const double worst = ((got - want).abs() / ulp).max().item<double>();
    EXPECT_LE(worst, 0.5 + std::ldexp(1.0, -13)) << (dq ? "double quant" : "absmax fp32");
  }
}

// A bf16 gpt-oss model whose experts are held in MXFP4 on the GPU: the grouped GEMMs over the
// kernel's bank (whole and in 64-row/column slices) against the per-expert loop.
TEST(Cuda, GroupedExpertsOverAnMxfp4BankMatchThePerExpertLoop) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  for (std::int64_t bank_bytes : {std::int64_t(0), std::int64_t(8) * 64 * 256 * 2}) {
    model::LoadOptions lo;
    lo.dtype = at::kBFloat16;
    lo.load_in_4bit = true;
    lo.device = dev;
    lo.random_seed = 7;
    lo.expert_bank_bytes = bank_bytes;
    auto m = model::MoeModel::load(tiny_mxfp4_gpt_oss("eo_cuda_mxfp4_model"), lo);
    const auto& q = m->weight_provider().expert_weight(0, 3, model::ExpertMatrix::Down);
    ASSERT_EQ(q.format, QuantFormat::Mxfp4);
    ASSERT_TRUE(q.packed.is_cuda());
    model::LoraSpec spec;
    spec.r = 8;
    spec.alpha = 16;
    spec.targets = {"q_proj", "v_proj", "o_proj"};
    m->add_lora(spec);
    {
      at::NoGradGuard ng;
      for (auto& [n, p] : m->lora_parameters()) p.normal_(0, 0.05);
    }
    expect_grouped_matches_loop(*m, dev);
  }
}

// Offloaded training with MXFP4 homes equals resident training on the GPU (the same kernels over
// the same bytes), and the homes are the MXFP4 arena.
TEST(Cuda, Mxfp4OffloadTrainingMatchesResident) {
  REQUIRE_CUDA();
  const std::string model_dir = tiny_mxfp4_gpt_oss("eo_cuda_mxfp4_train");
  auto run = [&](bool offload, bool prefetch, const std::string& out) {
    TrainConfig cfg = load_config_file(std::string(EO_SOURCE_DIR) + "/configs/tiny-qwen3-moe.yaml",
                                       {"max_steps=4", "save_steps=0", "output_dir=" + out, "bf16=true", "synthetic_weights=true",
                                        "base_model=" + model_dir, "lora_target_linear=true",
                                        "datasets.0.path=" + std::string(EO_SOURCE_DIR) + "/fixtures/tiny-data/train.jsonl",
                                        std::string("expert_offload=") + (offload ? "true" : "false"),
                                        std::string("expert_offload_prefetch=") + (prefetch ? "true" : "false")});
    EXPECT_TRUE(experts_in_mxfp4(cfg, model::load_config(model_dir)));
    remove_tree(out);
    train(cfg, ddp::World::get());
    return step_losses(out);
  };
  const std::string tmp = fs::temp_directory_path().string();
  const auto resident = run(false, false, tmp + "/eo_cuda_mxfp4_resident");
  const auto sync = run(true, false, tmp + "/eo_cuda_mxfp4_sync");
  const auto pre = run(true, true, tmp + "/eo_cuda_mxfp4_prefetch");
  ASSERT_EQ(resident.size(), 4u);
  ASSERT_EQ(sync.size(), 4u);
  ASSERT_EQ(pre.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(std::isfinite(resident[i])) << "step " << i + 1;
    EXPECT_NEAR(sync[i], resident[i], 1e-2 * std::abs(resident[i])) << "step " << i + 1;
    EXPECT_NEAR(pre[i], resident[i], 1e-2 * std::abs(resident[i])) << "step " << i + 1;
  }
}


int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  eo::ddp::World::init(&argc, &argv);
  return RUN_ALL_TESTS();
}
