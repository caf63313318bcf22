// GPU checks (label `cuda`): the offload engine's copies, memory and training on a real device.
// Without a CUDA device every test is reported as skipped (CTest shows them as "Skipped", never
// as passed).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <filesystem>
#include <fstream>

#include "models/hf_config.h"
#include "models/nf4.h"
#include "offload/engine.h"
#include "runtime/config.h"
#include "runtime/device.h"
#include "runtime/dist/world.h"
#include "runtime/trainer.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
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

}  // namespace

TEST(Cuda, OffloadKeepsOnlyTheSlotsOnTheDevice) {
  REQUIRE_CUDA();
  const at::Device dev(at::kCUDA, 0);
  auto bank = big_bank(6, 16, 512, 256);
  std::vector<at::Tensor> ref;  // layer 3, every expert's down matrix, dequantised on the CPU
  for (int e = 0; e < 16; ++e) ref.push_back(nf4::dequantize(bank[3][e][2], at::kFloat));
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
      ASSERT_TRUE(at::equal(nf4::dequantize(q, at::kFloat).cpu(), ref[e])) << "expert " << e;
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
    fs::remove_all(out);
    train(cfg, dist::World::get());
    std::vector<double> losses;
    std::ifstream in(out + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto k = line.find("\"loss\":");
      losses.push_back(std::stod(line.substr(k + 7)));
    }
    return losses;
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
    fs::remove_all(out);
    train(cfg, dist::World::get());
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

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  eo::dist::World::init(&argc, &argv);
  return RUN_ALL_TESTS();
}
