// Tests for eo::checkpoint (runtime/checkpoint.h): non-reentrant activation checkpointing.
//
// The reference is the same chain of blocks run without checkpointing (same parameters, same RNG
// seed): gradients must match bit for bit on CPU. Instrumentation is independent of the code under
// test: the block function logs when it runs, weak references to its intermediates' storages show
// whether anything keeps them alive, and post-accumulate hooks on the LoRA parameters count
// gradient accumulations.
#include "runtime/checkpoint.h"

#include "common/error.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <functional>
#include <string>
#include <vector>

namespace {

constexpr int64_t kRows = 5, kHidden = 16, kRank = 4;
constexpr double kDropout = 0.3, kLoraScale = 0.5;

using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;

// One block: frozen linears W1, W2 with LoRA adapters (A, B trainable) and dropout, residual.
struct Block {
  at::Tensor W1, W2, A1, B1, A2, B2;
  std::vector<at::Tensor> trainable() const { return {A1, B1, A2, B2}; }
};

std::vector<Block> make_blocks(int count, uint64_t seed) {
  at::manual_seed(seed);
  std::vector<Block> blocks(count);
  for (auto& b : blocks) {
    b.W1 = at::randn({kHidden, kHidden}) * 0.3;
    b.W2 = at::randn({kHidden, kHidden}) * 0.3;
    b.A1 = (at::randn({kRank, kHidden}) * 0.3).requires_grad_(true);
    b.B1 = (at::randn({kHidden, kRank}) * 0.3).requires_grad_(true);  // nonzero so A gets a grad
    b.A2 = (at::randn({kRank, kHidden}) * 0.3).requires_grad_(true);
    b.B2 = (at::randn({kHidden, kRank}) * 0.3).requires_grad_(true);
  }
  return blocks;
}

void track(std::vector<WeakStorage>* out, const at::Tensor& t) {
  if (out) out->push_back(t.storage().getWeakStorageImpl());
}

bool all_expired(const std::vector<WeakStorage>& storages) {
  for (const auto& s : storages)
    if (!s.expired()) return false;
  return true;
}

// linear(+LoRA) -> gelu -> dropout -> linear(+LoRA), residual. Intermediates go to `tracked`.
at::Tensor block_forward(const Block& b, const at::Tensor& x, std::vector<WeakStorage>* tracked) {
  at::Tensor x_drop = at::dropout(x, kDropout, /*train=*/true);
  at::Tensor a1 = at::linear(x_drop, b.A1);
  at::Tensor h = at::linear(x, b.W1) + at::linear(a1, b.B1) * kLoraScale;
  at::Tensor g = at::gelu(h);
  at::Tensor d = at::dropout(g, kDropout, /*train=*/true);
  at::Tensor a2 = at::linear(d, b.A2);
  for (const auto* t : {&x_drop, &a1, &h, &g, &d, &a2}) track(tracked, *t);
  return x + at::linear(d, b.W2) + at::linear(a2, b.B2) * kLoraScale;
}

// What the block functions saw, filled from inside them.
struct Probe {
  std::vector<std::string> events;                       // "F k" forward, "R k" recompute
  std::vector<std::vector<WeakStorage>> forward_storage;    // per block
  std::vector<std::vector<WeakStorage>> recompute_storage;  // per block
  std::function<void(size_t block)> on_recompute;          // runs at the start of a recompute
  explicit Probe(size_t blocks) : forward_storage(blocks), recompute_storage(blocks) {}
};

enum class Mode { kPlain, kCheckpoint, kCheckpointNoRng };

// Runs the chain; each block checkpointed unless Mode::kPlain.
at::Tensor run_chain(const std::vector<Block>& blocks, const at::Tensor& x, Mode mode, Probe* probe = nullptr) {
  at::Tensor h = x;
  for (size_t k = 0; k < blocks.size(); ++k) {
    auto fn = [&blocks, k, probe](const std::vector<at::Tensor>& in) {
      std::vector<WeakStorage>* tracked = nullptr;
      if (probe) {
        const bool recompute = eo::checkpoint_is_recomputing();
        probe->events.push_back((recompute ? "R " : "F ") + std::to_string(k));
        if (recompute && probe->on_recompute) probe->on_recompute(k);
        tracked = recompute ? &probe->recompute_storage[k] : &probe->forward_storage[k];
      }
      return std::vector<at::Tensor>{block_forward(blocks[k], in[0], tracked)};
    };
    h = mode == Mode::kPlain ? fn({h})[0] : eo::checkpoint(fn, {h}, mode == Mode::kCheckpoint)[0];
  }
  return h;
}

at::Tensor loss_of(const at::Tensor& y) { return (y * y).sum(); }

// Counts post-accumulate-grad hook firings of each parameter (as the DDP buckets will use them).
class AccumulationCounter {
 public:
  explicit AccumulationCounter(const std::vector<at::Tensor>& params) : counts_(params.size(), 0) {
    for (size_t i = 0; i < params.size(); ++i) {
      accumulators_.push_back(torch::autograd::impl::grad_accumulator(params[i]));  // keep alive
      accumulators_.back()->add_post_hook(std::make_unique<Hook>(&counts_[i]));
    }
  }
  int count(size_t i) const { return counts_[i]; }
  size_t size() const { return counts_.size(); }

 private:
  struct Hook : torch::autograd::FunctionPostHook {
    explicit Hook(int* counter) : counter(counter) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      ++*counter;
      return outputs;
    }
    int* counter;
  };
  std::vector<int> counts_;  // sized once: hooks point into it
  std::vector<decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor>()))> accumulators_;
};

std::vector<at::Tensor> all_trainable(const std::vector<Block>& blocks) {
  std::vector<at::Tensor> params;
  for (const auto& b : blocks)
    for (const auto& p : b.trainable()) params.push_back(p);
  return params;
}

void expect_same_grads(const std::vector<at::Tensor>& expected, const std::vector<at::Tensor>& actual) {
  ASSERT_EQ(expected.size(), actual.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_EQ(expected[i].grad().defined(), actual[i].grad().defined()) << "parameter " << i;
    if (expected[i].grad().defined())
      EXPECT_TRUE(at::equal(expected[i].grad(), actual[i].grad())) << "parameter " << i << " gradient differs";
  }
}

class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    eo::install_checkpoint_engine();  // before any autograd work in this process
    eo::reset_checkpoint_stats();
  }
};

TEST_F(Checkpoint, PlainGraphsUnaffectedByInstalledEngine) {
  at::manual_seed(3);
  at::Tensor x = at::randn({kRows, kHidden}, at::kDouble);
  at::Tensor w = at::randn({kHidden, 3}, at::kDouble).requires_grad_(true);
  at::Tensor y = at::tanh(at::matmul(x, w));
  y.sum().backward();
  // d/dw sum(tanh(xw)) = x^T (1 - tanh^2(xw)), computed without autograd.
  at::Tensor t = at::tanh(at::matmul(x, w.detach()));
  EXPECT_TRUE(at::allclose(w.grad(), at::matmul(x.t(), 1 - t * t)));

  at::Tensor z = at::sigmoid(at::matmul(x, w)).sum();
  auto grads = torch::autograd::grad({z}, {w});
  at::Tensor s = at::sigmoid(at::matmul(x, w.detach()));
  EXPECT_TRUE(at::allclose(grads[0], at::matmul(x.t(), s * (1 - s))));
  EXPECT_EQ(eo::checkpoint_stats().handles_packed, 0);  // no frame active: no hooks
}

TEST_F(Checkpoint, MatchesPlainBitForBitAndRecomputesLazilyInReverse) {
  constexpr size_t kBlocks = 3;
  const auto plain_blocks = make_blocks(kBlocks, 11), ckpt_blocks = make_blocks(kBlocks, 11);
  at::manual_seed(5);
  at::Tensor x_plain = at::randn({kRows, kHidden}).requires_grad_(true);
  at::Tensor x_ckpt = x_plain.detach().clone().requires_grad_(true);

  // Reference: no checkpoint. Its intermediates must be alive after forward (sanity of the probe).
  Probe plain_probe(kBlocks);
  at::manual_seed(42);
  at::Tensor plain_loss = loss_of(run_chain(plain_blocks, x_plain, Mode::kPlain, &plain_probe));
  bool plain_keeps_activations = false;
  for (const auto& s : plain_probe.forward_storage) plain_keeps_activations |= !all_expired(s);
  EXPECT_TRUE(plain_keeps_activations);
  plain_loss.backward();
  const at::Tensor rng_after_plain = at::rand({4});

  // Checkpointed, with instrumentation.
  const auto params = all_trainable(ckpt_blocks);
  AccumulationCounter counter(params);
  Probe probe(kBlocks);
  std::vector<bool> next_block_done(kBlocks, true), this_block_untouched(kBlocks, true),
      next_block_freed(kBlocks, true);
  probe.on_recompute = [&](size_t k) {
    for (size_t j = 0; j < 4; ++j) {
      if (k + 1 < kBlocks) next_block_done[k] = next_block_done[k] && counter.count((k + 1) * 4 + j) == 1;
      this_block_untouched[k] = this_block_untouched[k] && counter.count(k * 4 + j) == 0;
    }
    if (k + 1 < kBlocks) next_block_freed[k] = all_expired(probe.recompute_storage[k + 1]);
  };
  at::manual_seed(42);
  at::Tensor loss = loss_of(run_chain(ckpt_blocks, x_ckpt, Mode::kCheckpoint, &probe));
  EXPECT_TRUE(at::equal(loss, plain_loss));

  // After forward: no activation is kept (only handles) and nothing recomputed yet.
  for (size_t k = 0; k < kBlocks; ++k) EXPECT_TRUE(all_expired(probe.forward_storage[k])) << "block " << k;
  auto stats = eo::checkpoint_stats();
  EXPECT_EQ(stats.forwards, 3);
  EXPECT_EQ(stats.recomputes, 0);
  EXPECT_GT(stats.handles_packed, 0);
  EXPECT_EQ(stats.handles_packed % kBlocks, 0);
  EXPECT_EQ(stats.live_recomputed_tensors, 0);

  loss.backward();
  stats = eo::checkpoint_stats();
  EXPECT_EQ(probe.events, (std::vector<std::string>{"F 0", "F 1", "F 2", "R 2", "R 1", "R 0"}));
  EXPECT_EQ(stats.recomputes, 3);
  for (size_t k = 0; k < kBlocks; ++k) {
    EXPECT_TRUE(next_block_done[k]) << "block " << k << " recomputed before block " << k + 1 << "'s grads";
    EXPECT_TRUE(this_block_untouched[k]) << "block " << k << " got grads before its recompute";
    EXPECT_TRUE(next_block_freed[k]) << "block " << k + 1 << "'s recomputed activations alive during block " << k;
    EXPECT_TRUE(all_expired(probe.recompute_storage[k])) << "block " << k;
  }
  // At most one block's recomputed saved tensors were alive at any time, none are left.
  EXPECT_GT(stats.peak_live_recomputed_tensors, 0);
  EXPECT_LE(stats.peak_live_recomputed_tensors, stats.handles_packed / static_cast<int64_t>(kBlocks));
  EXPECT_EQ(stats.live_recomputed_tensors, 0);
  EXPECT_EQ(stats.live_recomputed_bytes, 0);

  for (size_t i = 0; i < counter.size(); ++i) EXPECT_EQ(counter.count(i), 1) << "parameter " << i;
  expect_same_grads(all_trainable(plain_blocks), params);
  EXPECT_TRUE(at::equal(x_plain.grad(), x_ckpt.grad()));
  // The recompute forked the RNG: the stream after backward is the one the plain run left.
  EXPECT_TRUE(at::equal(at::rand({4}), rng_after_plain));
}

TEST_F(Checkpoint, DropoutNeedsTheRestoredRngState) {
  // Without restoring the RNG the recompute draws other dropout masks and the gradients differ:
  // this is what makes the bit-for-bit comparisons above sensitive to the RNG handling.
  const auto plain_blocks = make_blocks(2, 7), ckpt_blocks = make_blocks(2, 7);
  at::manual_seed(5);
  at::Tensor x = at::randn({kRows, kHidden});
  at::manual_seed(9);
  loss_of(run_chain(plain_blocks, x, Mode::kPlain)).backward();
  at::manual_seed(9);
  loss_of(run_chain(ckpt_blocks, x, Mode::kCheckpointNoRng)).backward();
  bool any_differs = false;
  const auto a = all_trainable(plain_blocks), b = all_trainable(ckpt_blocks);
  for (size_t i = 0; i < a.size(); ++i) any_differs |= !at::equal(a[i].grad(), b[i].grad());
  EXPECT_TRUE(any_differs);
}

TEST_F(Checkpoint, InputWithoutGradStillTrainsParameters) {
  const auto plain_blocks = make_blocks(2, 21), ckpt_blocks = make_blocks(2, 21);
  at::manual_seed(5);
  at::Tensor x = at::randn({kRows, kHidden});  // does not require grad
  at::manual_seed(1);
  loss_of(run_chain(plain_blocks, x, Mode::kPlain)).backward();
  const auto params = all_trainable(ckpt_blocks);
  AccumulationCounter counter(params);
  at::manual_seed(1);
  loss_of(run_chain(ckpt_blocks, x, Mode::kCheckpoint)).backward();
  EXPECT_EQ(eo::checkpoint_stats().recomputes, 2);
  for (size_t i = 0; i < counter.size(); ++i) EXPECT_EQ(counter.count(i), 1) << "parameter " << i;
  for (const auto& p : params) ASSERT_TRUE(p.grad().defined());
  expect_same_grads(all_trainable(plain_blocks), params);
  EXPECT_FALSE(x.grad().defined());
}

TEST_F(Checkpoint, TwoMicroStepsAccumulate) {
  const auto plain_blocks = make_blocks(2, 31), ckpt_blocks = make_blocks(2, 31);
  at::manual_seed(5);
  const at::Tensor x1 = at::randn({kRows, kHidden}), x2 = at::randn({kRows, kHidden});
  at::manual_seed(77);
  for (const auto& x : {x1, x2}) loss_of(run_chain(plain_blocks, x, Mode::kPlain)).backward();
  const auto params = all_trainable(ckpt_blocks);
  AccumulationCounter counter(params);
  at::manual_seed(77);
  for (const auto& x : {x1, x2}) loss_of(run_chain(ckpt_blocks, x, Mode::kCheckpoint)).backward();
  const auto stats = eo::checkpoint_stats();
  EXPECT_EQ(stats.forwards, 4);
  EXPECT_EQ(stats.recomputes, 4);
  for (size_t i = 0; i < counter.size(); ++i) EXPECT_EQ(counter.count(i), 2) << "parameter " << i;
  expect_same_grads(all_trainable(plain_blocks), params);
}

TEST_F(Checkpoint, RetainedGraphRecomputesPerBackward) {
  const auto plain_blocks = make_blocks(2, 41), ckpt_blocks = make_blocks(2, 41);
  at::manual_seed(5);
  const at::Tensor x = at::randn({kRows, kHidden});
  at::manual_seed(8);
  at::Tensor plain_loss = loss_of(run_chain(plain_blocks, x, Mode::kPlain));
  plain_loss.backward({}, /*retain_graph=*/true);
  plain_loss.backward();
  at::manual_seed(8);
  at::Tensor loss = loss_of(run_chain(ckpt_blocks, x, Mode::kCheckpoint));
  loss.backward({}, /*retain_graph=*/true);
  loss.backward();
  EXPECT_EQ(eo::checkpoint_stats().recomputes, 4);
  expect_same_grads(all_trainable(plain_blocks), all_trainable(ckpt_blocks));
}

// Block 1's output is unused; block 2 returns two outputs of which the loss uses one.
at::Tensor branchy_loss(const std::vector<Block>& blocks, const at::Tensor& x, bool checkpointed) {
  auto run = [checkpointed](const eo::CheckpointFn& fn, const at::Tensor& in) {
    return checkpointed ? eo::checkpoint(fn, {in}) : fn({in});
  };
  auto single = [&blocks](size_t k) {
    return [&blocks, k](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{block_forward(blocks[k], in[0], nullptr)};
    };
  };
  const at::Tensor used = run(single(0), x)[0];
  const at::Tensor unused = run(single(1), x)[0];
  const auto pair = run(
      [&blocks](const std::vector<at::Tensor>& in) {
        at::Tensor y = block_forward(blocks[2], in[0], nullptr);
        return std::vector<at::Tensor>{y, at::exp(y)};  // exp saves its output: a handle never unpacked
      },
      used);
  (void)unused;
  return loss_of(pair[0]);
}

TEST_F(Checkpoint, UnusedBlockOutputs) {
  const auto plain_blocks = make_blocks(3, 51), ckpt_blocks = make_blocks(3, 51);
  at::manual_seed(5);
  const at::Tensor x_plain = at::randn({kRows, kHidden}).requires_grad_(true);
  const at::Tensor x_ckpt = x_plain.detach().clone().requires_grad_(true);
  at::manual_seed(2);
  branchy_loss(plain_blocks, x_plain, false).backward();
  at::manual_seed(2);
  branchy_loss(ckpt_blocks, x_ckpt, true).backward();
  const auto stats = eo::checkpoint_stats();
  EXPECT_EQ(stats.recomputes, 2);  // block 1 is never needed
  EXPECT_EQ(stats.live_recomputed_tensors, 0);  // the graph is gone: so are never-unpacked tensors
  for (const auto& p : ckpt_blocks[1].trainable()) EXPECT_FALSE(p.grad().defined());
  expect_same_grads(all_trainable(plain_blocks), all_trainable(ckpt_blocks));
  EXPECT_TRUE(at::equal(x_plain.grad(), x_ckpt.grad()));
}

TEST_F(Checkpoint, ViewAndDetachedInputs) {
  const auto plain_blocks = make_blocks(1, 61), ckpt_blocks = make_blocks(1, 61);
  auto fn_for = [](const std::vector<Block>& blocks) {
    return [&blocks](const std::vector<at::Tensor>& in) {
      // in[0]: a view of a tensor that requires grad; in[1]: a detached tensor made a leaf again.
      return std::vector<at::Tensor>{block_forward(blocks[0], in[0], nullptr) + at::sin(in[1]) * in[0]};
    };
  };
  auto run = [&](const std::vector<Block>& blocks, bool checkpointed, at::Tensor& base, at::Tensor& leaf) {
    at::manual_seed(5);
    base = at::randn({kRows + 2, kHidden}).requires_grad_(true);
    at::Tensor view = (base * 2).narrow(0, 1, kRows);
    leaf = (base * 3).narrow(0, 2, kRows).detach().requires_grad_(true);
    at::manual_seed(6);
    auto fn = fn_for(blocks);
    at::Tensor y = checkpointed ? eo::checkpoint(fn, {view, leaf})[0] : fn({view, leaf})[0];
    loss_of(y).backward();
  };
  at::Tensor base_plain, leaf_plain, base_ckpt, leaf_ckpt;
  run(plain_blocks, false, base_plain, leaf_plain);
  run(ckpt_blocks, true, base_ckpt, leaf_ckpt);
  EXPECT_EQ(eo::checkpoint_stats().recomputes, 1);
  expect_same_grads(all_trainable(plain_blocks), all_trainable(ckpt_blocks));
  EXPECT_TRUE(at::equal(base_plain.grad(), base_ckpt.grad()));
  EXPECT_TRUE(at::equal(leaf_plain.grad(), leaf_ckpt.grad()));
}

// Runs loss.backward() and returns the error message (empty if none).
std::string backward_error(const at::Tensor& loss) {
  try {
    loss.backward();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST_F(Checkpoint, InputModifiedInPlaceAfterForwardIsReported) {
  const auto blocks = make_blocks(1, 71);
  at::Tensor x = at::randn({kRows, kHidden});
  at::Tensor loss = loss_of(run_chain(blocks, x, Mode::kCheckpoint));
  x.add_(1.0);
  EXPECT_NE(backward_error(loss).find("modified in place"), std::string::npos);
}

TEST_F(Checkpoint, NondeterministicFunctionIsReported) {
  at::Tensor w = at::randn({kHidden}).requires_grad_(true);
  for (bool more_on_recompute : {true, false}) {
    int calls = 0;
    auto fn = [&](const std::vector<at::Tensor>& in) {
      const bool extra = (calls++ == 0) != more_on_recompute;
      at::Tensor y = at::sin(in[0] * w);
      return std::vector<at::Tensor>{extra ? at::exp(y) : y};  // exp saves one more tensor
    };
    at::Tensor loss = eo::checkpoint(fn, {at::randn({kRows, kHidden})})[0].sum();
    EXPECT_NE(backward_error(loss).find("not deterministic"), std::string::npos) << more_on_recompute;
  }
}

TEST_F(Checkpoint, NestedCheckpointIsRefused) {
  at::Tensor w = at::randn({kHidden}).requires_grad_(true);
  auto inner = [&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{at::sin(in[0] * w)}; };
  auto outer = [&](const std::vector<at::Tensor>& in) { return eo::checkpoint(inner, in); };
  EXPECT_THROW(eo::checkpoint(outer, {at::randn({kHidden})}), eo::Error);
  // The failed call left no frame behind: a plain checkpoint still works.
  at::Tensor loss = eo::checkpoint(inner, {at::randn({kHidden})})[0].sum();
  loss.backward();
  EXPECT_TRUE(w.grad().defined());
}

}  // namespace
