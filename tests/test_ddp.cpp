// Data-parallel gradient reduction (runtime/ddp/reducer.h, comm.h), run under mpirun with 2 and
// 3 ranks and as a world of one. The reference is independent of the code under test: each rank
// computes its own local gradients on separate leaf copies, the ranks exchange them with
// World::allgather (not the Communicator), and the expected result is their sum in float64.
//
// `test_ddp --fault=throw|hang` is not a gtest run: it makes the last rank fail in the middle of a
// step (an exception before its all-reduce, or a hang with a 3 s ddp_timeout) and is registered
// to expect the whole mpirun to exit non-zero, in bounded time, with a message naming the fault.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "common/error.h"
#include "runtime/ddp/comm.h"
#include "runtime/ddp/reducer.h"
#include "runtime/ddp/world.h"

using namespace eo::ddp;

namespace {
std::unique_ptr<Communicator> g_comm;
Communicator& comm() { return *g_comm; }
int rank() { return World::get().rank(); }
int world_size() { return World::get().size(); }

constexpr int kDim = 16, kRank = 4, kTokens = 8;

// Frozen weights: exist on every rank, never trainable. `expert` stands for a big expert weight.
struct Frozen {
  at::Tensor w1, w2, expert;
};
Frozen make_frozen() {
  at::manual_seed(7);  // same on every rank
  return {at::randn({kDim, kDim}) * 0.3, at::randn({kDim, kDim}) * 0.3, at::randn({256, 256})};
}

// Trainable "LoRA" params in order of use in forward; `unused.A` is never used by anyone.
std::vector<NamedTensor> make_lora(std::uint64_t seed = 11) {
  at::manual_seed(seed);
  auto p = [](std::int64_t r, std::int64_t c) { return (at::randn({r, c}) * 0.3).requires_grad_(true); };
  return {{"l1.A", p(kRank, kDim)}, {"l1.B", p(kDim, kRank)}, {"expert.A", p(kRank, kDim)},
          {"expert.B", p(kDim, kRank)}, {"l2.A", p(kRank, kDim)},     {"l2.B", p(kDim, kRank)},
          {"unused.A", p(kRank, kDim)}};
}

// Two LoRA linears with an optional "expert" in between (skipped when no token is routed to it).
at::Tensor loss_of(const std::vector<at::Tensor>& l, const Frozen& f, const at::Tensor& x, bool use_expert) {
  at::Tensor h = at::tanh(x.matmul(f.w1.t()) + x.matmul(l[0].t()).matmul(l[1].t()));
  if (use_expert) {
    at::Tensor e = h.matmul(f.expert.narrow(0, 0, kDim).narrow(1, 0, kDim).t());
    h = h + at::tanh(e + h.matmul(l[2].t()).matmul(l[3].t()));
  }
  at::Tensor y = h.matmul(f.w2.t()) + h.matmul(l[4].t()).matmul(l[5].t());
  return (y * y).sum() * 0.5;
}

std::vector<at::Tensor> tensors_of(const std::vector<NamedTensor>& named) {
  std::vector<at::Tensor> out;
  for (const auto& [n, t] : named) out.push_back(t);
  return out;
}

at::Tensor batch(int for_rank, int micro) {
  at::manual_seed(1000 + 17 * for_rank + micro);
  return at::randn({kTokens, kDim});
}

// This rank's own gradients on fresh leaf copies (no hooks, no reducer), zeros where unused.
std::vector<at::Tensor> local_grads(const std::vector<NamedTensor>& params, const Frozen& f,
                                    const std::vector<std::pair<at::Tensor, bool>>& micro_batches) {
  std::vector<at::Tensor> copies;
  for (const auto& [n, p] : params) copies.push_back(p.detach().clone().requires_grad_(true));
  for (const auto& [x, use_expert] : micro_batches) loss_of(copies, f, x, use_expert).backward();
  std::vector<at::Tensor> g;
  for (auto& c : copies) g.push_back(c.grad().defined() ? c.grad().clone() : at::zeros_like(c));
  return g;
}

// Every rank's tensor (same shape, fp32 or any dtype), exchanged through World::allgather.
std::vector<at::Tensor> gather(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  std::string mine(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
  std::vector<at::Tensor> out;
  for (const auto& s : World::get().allgather(mine)) {
    at::Tensor r = at::empty_like(c);
    EXPECT_EQ(s.size(), mine.size());
    std::memcpy(r.data_ptr(), s.data(), std::min(s.size(), mine.size()));
    out.push_back(r);
  }
  return out;
}

// Sum over ranks in float64 of each rank's local gradients.
std::vector<at::Tensor> reference_sum(const std::vector<at::Tensor>& local) {
  std::vector<at::Tensor> out;
  for (const auto& g : local) {
    at::Tensor s = at::zeros(g.sizes(), at::kDouble);
    for (const auto& r : gather(g)) s += r.to(at::kDouble);
    out.push_back(s);
  }
  return out;
}

std::int64_t trainable_bytes(const std::vector<NamedTensor>& params) {
  std::int64_t b = 0;
  for (const auto& [n, p] : params) b += p.numel() * 4;
  return b;
}

void expect_grads(const std::vector<NamedTensor>& params, const std::vector<at::Tensor>& expected, const char* what) {
  ASSERT_EQ(params.size(), expected.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& g = params[i].second.grad();
    ASSERT_TRUE(g.defined()) << what << ": " << params[i].first << " has no grad";
    const double err = (g.to(at::kDouble) - expected[i]).abs().max().item<double>();
    const double scale = expected[i].abs().max().item<double>();
    EXPECT_LE(err, 1e-5 * (1 + scale)) << what << ": " << params[i].first << " on rank " << rank();
  }
}

bool uses_expert(int r, int micro) { return (r + micro) % 2 == 0; }
}  // namespace

TEST(Buckets, RespectCapAndReverseOrderOfUse) {
  // Sizes in floats, in order of use; cap = 60 floats. Greedy packing in reverse order gives
  // [p5] [p4 (oversize, alone)] [p3] [p2 p1 p0].
  const std::vector<std::int64_t> sizes = {10, 20, 30, 40, 200, 5};
  std::vector<NamedTensor> params;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    params.push_back({"p" + std::to_string(i), at::zeros({sizes[i]}).requires_grad_(true)});
  const std::int64_t cap = 60 * 4;
  GradReducer reducer(params, comm(), {cap, ReduceOp::kSum});
  std::vector<std::vector<std::string>> expected = {{"p5"}, {"p4"}, {"p3"}, {"p2", "p1", "p0"}};
  ASSERT_EQ(reducer.num_buckets(), expected.size());
  std::vector<std::string> flat;
  for (std::size_t b = 0; b < reducer.num_buckets(); ++b) {
    EXPECT_EQ(reducer.bucket_param_names(b), expected[b]);
    const auto names = reducer.bucket_param_names(b);
    EXPECT_TRUE(reducer.bucket_bytes(b) <= cap || names.size() == 1) << "bucket " << b;
    flat.insert(flat.end(), names.begin(), names.end());
    if (b + 1 < reducer.num_buckets()) {  // greedy: the next parameter would not have fit
      const std::string next = reducer.bucket_param_names(b + 1).front();
      EXPECT_GT(reducer.bucket_bytes(b) + sizes[std::stoi(next.substr(1))] * 4, cap) << "bucket " << b;
    }
  }
  EXPECT_EQ(flat, (std::vector<std::string>{"p5", "p4", "p3", "p2", "p1", "p0"}));
  // The default 25 MB cap keeps this model in one bucket.
  GradReducer one(make_lora(), comm());
  EXPECT_EQ(one.num_buckets(), 1u);
}

TEST(Buckets, RejectFrozenAndNonFp32Parameters) {
  const Frozen f = make_frozen();
  EXPECT_THROW((GradReducer({{"frozen.expert", f.expert}}, comm())), eo::Error);
  EXPECT_THROW((GradReducer({{"bf16", at::zeros({4}, at::kBFloat16).requires_grad_(true)}}, comm())), eo::Error);
  const at::Tensor p = at::zeros({4}).requires_grad_(true);
  EXPECT_THROW((GradReducer({{"twice", p}, {"twice.again", p}}, comm())), eo::Error);
}

// Buckets follow the blocks from the top down, never span two blocks, and inside a block keep
// the reverse order of use and the cap (sizes in floats; cap 60 floats).
TEST(Buckets, GroupByBlockFromTheTop) {
  const std::vector<std::int64_t> sizes = {10, 20, 30, 40, 200, 5, 7};
  const std::vector<int> blocks = {0, 0, 1, 1, 1, 2, 0};
  const auto plan = assign_buckets(sizes, blocks, 60 * 4);
  std::vector<std::vector<std::size_t>> params;
  std::vector<int> of;
  for (const auto& b : plan) {
    params.push_back(b.params);
    of.push_back(b.block);
  }
  EXPECT_EQ(of, (std::vector<int>{2, 1, 1, 1, 0}));
  EXPECT_EQ(params, (std::vector<std::vector<std::size_t>>{{5}, {4}, {3}, {2}, {6, 1, 0}}));
  EXPECT_THROW(assign_buckets(sizes, {0, 1}, 240), eo::Error);
}

// Sum and mean over ranks equal the float64 sum of every rank's independently computed gradients;
// a parameter unused on some ranks (expert) or on all ranks (unused.A) reduces without a hang.
// block_done launches the buckets during the step (the runner calls it when a block's gradients
// are final); finalize launches whatever is left.
TEST(Reducer, SumAndMeanEqualIndependentReference) {
  const Frozen f = make_frozen();
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    for (bool early : {false, true}) {
      auto params = make_lora();
      const at::Tensor x = batch(rank(), 0);
      const bool expert = uses_expert(rank(), 0);
      auto expected = reference_sum(local_grads(params, f, {{x, expert}}));
      if (op == ReduceOp::kAvg)
        for (auto& e : expected) e /= world_size();
      GradReducer reducer(params, comm(), {2 * kDim * kRank * 4, op});  // two params per bucket
      ASSERT_EQ(reducer.num_buckets(), 4u);
      comm().reset_stats();
      loss_of(tensors_of(params), f, x, expert).backward();
      if (early) reducer.block_done(0);
      if (world_size() > 1) EXPECT_EQ(comm().stats().allreduce_calls, early ? 4 : 0);
      reducer.finalize();
      expect_grads(params, expected, early ? "launched by block_done" : "launched by finalize");
      EXPECT_TRUE(params[6].second.grad().eq(0).all().item<bool>()) << "unused.A must get zeros";
      if (world_size() > 1) EXPECT_EQ(comm().stats().allreduce_calls, 4);
    }
  }
}

// Nothing is communicated while gradients accumulate; two micro-steps equal one big step,
// including a parameter that got its gradient only in the first micro-step.
TEST(Reducer, AccumulationIsLocalUntilTheBlockIsDone) {
  const Frozen f = make_frozen();
  auto params = make_lora();
  const at::Tensor x0 = batch(rank(), 0), x1 = batch(rank(), 1);
  // One big step on copies: both micro-batches in a single backward on fresh leaves.
  std::vector<at::Tensor> copies;
  for (const auto& [n, p] : params) copies.push_back(p.detach().clone().requires_grad_(true));
  (loss_of(copies, f, x0, uses_expert(rank(), 0)) + loss_of(copies, f, x1, uses_expert(rank(), 1))).backward();
  std::vector<at::Tensor> big;
  for (auto& c : copies) big.push_back(c.grad().defined() ? c.grad() : at::zeros_like(c));
  const auto expected = reference_sum(big);

  // Parameters 0-1 and 4-6 in block 0, the expert's in block 1.
  GradReducer reducer(params, comm(), {3 * kDim * kRank * 4, ReduceOp::kSum}, {0, 0, 1, 1, 0, 0, 0});
  comm().reset_stats();
  loss_of(tensors_of(params), f, x0, uses_expert(rank(), 0)).backward();
  loss_of(tensors_of(params), f, x1, uses_expert(rank(), 1)).backward();
  EXPECT_EQ(comm().stats().allreduce_calls, 0);
  reducer.block_done(1);
  EXPECT_EQ(comm().stats().allreduce_calls, world_size() > 1 ? 1 : 0) << "block 1's one bucket";
  reducer.block_done(0);
  reducer.finalize();
  expect_grads(params, expected, "two micro-steps vs one big step");
  const CommStats s = comm().stats();
  EXPECT_EQ(s.allreduce_calls, world_size() > 1 ? static_cast<std::int64_t>(reducer.num_buckets()) : 0);
  EXPECT_EQ(s.allreduce_bytes, world_size() > 1 ? trainable_bytes(params) : 0);
  EXPECT_EQ(reducer.launched_early(), world_size() > 1 ? static_cast<std::int64_t>(reducer.num_buckets()) : 0);
}

// The collectives carried exactly the trainable gradients and the broadcast set: the big frozen
// expert tensor that exists on the rank never went through.
TEST(Reducer, BytesCarriedAreExactlyTrainableGradsAndBroadcastSet) {
  const Frozen f = make_frozen();
  auto params = make_lora(100 + rank());  // different on every rank until the broadcast
  at::Tensor step_buffer = at::arange(5, at::kLong);
  std::vector<NamedTensor> bcast = params;
  bcast.push_back({"l1.base.weight", f.w1});
  bcast.push_back({"l2.base.weight", f.w2.to(at::kBFloat16)});
  bcast.push_back({"rope.buffer", step_buffer});
  std::int64_t bcast_bytes = 0;
  for (const auto& [n, t] : bcast) bcast_bytes += t.numel() * t.element_size();
  comm().reset_stats();
  broadcast_parameters(bcast, comm());
  GradReducer reducer(params, comm());
  loss_of(tensors_of(params), f, batch(rank(), 0), true).backward();
  reducer.finalize();
  const CommStats s = comm().stats();
  const bool many = world_size() > 1;
  EXPECT_EQ(s.broadcast_bytes, many ? bcast_bytes : 0);
  EXPECT_EQ(s.broadcast_calls, many ? 3 : 0) << "one coalesced broadcast per dtype";
  EXPECT_EQ(s.allreduce_bytes, many ? trainable_bytes(params) : 0);
  EXPECT_EQ(s.allgather_calls, 0);
  EXPECT_LT(trainable_bytes(params), f.expert.numel() * 4);
}

TEST(Broadcast, MakesEveryRankBitwiseEqualToRoot) {
  at::manual_seed(500 + rank());  // different values on every rank
  at::Tensor big = at::randn({40, 30});
  std::vector<NamedTensor> set = {
      {"lora.A", at::randn({kRank, kDim}).requires_grad_(true)},
      {"frozen.bf16", at::randn({kDim, kDim}).to(at::kBFloat16)},
      {"buffer.i64", at::randint(0, 1 << 30, {33}, at::kLong)},
      {"transposed.view", big.t()},  // non-contiguous: goes through a flat buffer
      {"big.single", at::randn({600})},
      {"scalar", at::randn({})},
  };
  std::vector<std::vector<at::Tensor>> before;  // every rank's values before, from World::allgather
  for (const auto& [n, t] : set) before.push_back(gather(t));
  for (std::int64_t chunk : {std::int64_t(1000), std::int64_t(256) << 20}) {
    comm().reset_stats();
    broadcast_parameters(set, comm(), 0, chunk);
    for (std::size_t i = 0; i < set.size(); ++i) {
      const at::Tensor root = before[i][0];
      const at::Tensor mine = set[i].second.contiguous();
      ASSERT_EQ(std::memcmp(mine.data_ptr(), root.data_ptr(), root.numel() * root.element_size()), 0)
          << set[i].first << " differs from rank 0 on rank " << rank() << " (chunk " << chunk << ")";
    }
    // Coalesced: one call per dtype group (fp32, bf16, i64) when the chunk holds them all.
    if (world_size() > 1) {
      if (chunk > 1000) {
        EXPECT_EQ(comm().stats().broadcast_calls, 3);
      } else {
        EXPECT_GT(comm().stats().broadcast_calls, 3);
      }
    }
  }
  EXPECT_TRUE(set[0].second.requires_grad() && set[0].second.is_leaf());
}

TEST(Checksum, CatchesARankWithDifferentBytesAndNamesIt) {
  at::manual_seed(3);  // same bytes on every rank
  at::Tensor home_a = at::randint(0, 255, {(1 << 20) + 7}, at::kByte);
  at::Tensor home_b = at::randint(0, 255, {4099}, at::kByte);
  std::vector<HostBytes> homes = {{home_a.data_ptr(), static_cast<std::size_t>(home_a.numel())},
                                  {home_b.data_ptr(), static_cast<std::size_t>(home_b.numel())}};
  ChecksumReport same = checksum_allreduce(homes, comm(), "expert homes");
  EXPECT_TRUE(same.agree) << same.message;
  EXPECT_EQ(static_cast<int>(same.per_rank.size()), world_size());
  EXPECT_NO_THROW(check_same_bytes(homes, comm(), "expert homes"));

  const std::uint64_t clean = checksum_bytes(homes);
  const int bad = world_size() - 1;
  if (rank() == bad) home_a.data_ptr<std::uint8_t>()[12345] ^= 1;  // one bit on the last rank
  if (rank() == bad) {
    EXPECT_NE(checksum_bytes(homes), clean) << "one flipped bit must change the checksum";
  } else {
    EXPECT_EQ(checksum_bytes(homes), clean);
  }
  if (world_size() == 1) return;  // nothing to compare against in a world of one
  ChecksumReport diff = checksum_allreduce(homes, comm(), "expert homes");
  EXPECT_FALSE(diff.agree);
  EXPECT_EQ(diff.differing_ranks, std::vector<int>{bad});
  EXPECT_NE(diff.message.find("rank " + std::to_string(bad) + " hold"), std::string::npos) << diff.message;
  try {
    check_same_bytes(homes, comm(), "expert homes");
    ADD_FAILURE() << "check_same_bytes did not throw";
  } catch (const eo::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(bad)), std::string::npos) << e.what();
  }
}

TEST(Comm, WorldOfOneDoesNothingAndCountsNothing) {
  if (world_size() > 1) {
    // A communicator of this world counts exactly what it carried.
    at::Tensor t = at::ones({10});
    comm().reset_stats();
    comm().allreduce(t, ReduceOp::kAvg, "ones");
    EXPECT_TRUE(t.eq(1).all().item<bool>());
    EXPECT_EQ(comm().stats().allreduce_bytes, 40);
    return;
  }
  at::Tensor t = at::ones({10});
  comm().reset_stats();
  comm().allreduce(t, ReduceOp::kSum, "ones");
  comm().broadcast(t, 0, "ones");
  const CommStats s = comm().stats();
  EXPECT_EQ(s.allreduce_calls + s.allreduce_bytes + s.broadcast_calls + s.broadcast_bytes, 0);
  EXPECT_TRUE(t.eq(1).all().item<bool>());
}

namespace {
// The last rank fails mid-step while the others enter the all-reduce.
int run_fault(const std::string& mode) {
  const Frozen f = make_frozen();
  auto params = make_lora();
  GradReducer reducer(params, comm(), {std::int64_t(25) << 20, ReduceOp::kSum});
  if (rank() == world_size() - 1) {
    if (mode == "throw") EO_FAIL("injected fault on rank ", rank(), " before its all-reduce");
    std::this_thread::sleep_for(std::chrono::seconds(120));  // "hang": the peers must time out
  }
  loss_of(tensors_of(params), f, batch(rank(), 0), true).backward();
  reducer.finalize();
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  World& w = World::init(&argc, &argv);
  std::string fault;
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--fault=", 8) == 0) fault = argv[i] + 8;
  try {
    g_comm = std::make_unique<Communicator>(w, at::Device(at::kCPU), fault == "hang" ? 3.0 : 60.0);
    if (!fault.empty()) return run_fault(fault);
  } catch (const std::exception& e) {
    // As launch/main.cpp does: an escaping error ends every rank.
    std::fprintf(stderr, "test_ddp: rank %d: %s\n", w.rank(), e.what());
    std::fflush(stderr);
    if (w.size() > 1) w.abort(1);
    return 1;
  }
  if (w.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int failed = RUN_ALL_TESTS();
  double any = failed ? 1 : 0;
  w.allreduce_max(&any, 1);
  g_comm.reset();
  w.finalize();
  return any > 0 ? 1 : 0;
}
