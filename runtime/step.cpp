#include "runtime/step.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <limits>
#include <utility>
#include <mutex>

#include "common/error.h"
#include "models/attention_path.h"
#include "models/moe_model.h"
#include "offload/activations.h"
#include "runtime/block_graphs.h"
#include "runtime/data/batcher.h"
#include "runtime/ddp/reducer.h"
#include "runtime/use_inputs.h"

namespace eo {
namespace {

using Kind = BlockUse::Kind;

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// One draw of the global CPU generator per step: the step's RNG stream depends on nothing else, so
// a resumed run (which restores the generator) draws the same masks.
std::uint64_t draw_step_seed() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
}

// For the scope of one (block, micro-batch) use: the CPU generator and the device's generator are
// seeded from (step seed, block, micro-batch); the states they had are put back afterwards.
class UseRng {
 public:
  UseRng(bool active, std::uint64_t step_seed, int block, int micro, const at::Device& device) : active_(active) {
    if (!active_) return;
    const std::uint64_t seed = splitmix64(step_seed ^ splitmix64((std::uint64_t(block) << 32) | std::uint32_t(micro)));
    gens_.push_back(at::detail::getDefaultCPUGenerator());
    if (device.is_cuda()) gens_.push_back(at::globalContext().defaultGenerator(device));
    for (auto& g : gens_) {
      std::lock_guard<std::mutex> lock(g.mutex());
      saved_.push_back(g.get_state());
      g.set_current_seed(seed);
    }
  }
  ~UseRng() {
    for (std::size_t i = 0; i < saved_.size(); ++i) {
      std::lock_guard<std::mutex> lock(gens_[i].mutex());
      gens_[i].set_state(saved_[i]);
    }
  }
  UseRng(const UseRng&) = delete;
  UseRng& operator=(const UseRng&) = delete;

 private:
  bool active_;
  std::vector<at::Generator> gens_;
  std::vector<at::Tensor> saved_;
};

// True when every row of a micro-batch's segment ids is one document (no packing boundary, no padding).
bool single_document_rows(const at::Tensor& segment_ids) {
  if (!segment_ids.defined() || segment_ids.numel() == 0) return true;
  const at::Tensor seg = segment_ids.to(at::kCPU);
  return (seg == seg.narrow(1, 0, 1)).all().item<bool>();
}

// A host batch tensor on the device without waiting: a copy from pageable memory first waits for
// the stream to drain, one from pinned memory is queued like a kernel.
at::Tensor to_device(const at::Tensor& t, const at::Device& device) {
  if (!device.is_cuda() || !t.is_cpu()) return t.to(device);
  return t.contiguous().pin_memory().to(device, /*non_blocking=*/true);
}

// A graph kept from Forward to Backward (no checkpointing).
struct KeptGraph {
  at::Tensor input;   // the leaf the block ran on
  at::Tensor output;  // with its graph
  at::Tensor router_logits;  // with its graph (aux loss)
};

}  // namespace

StepRunner::StepRunner(model::MoeModel& model, const StepOptions& options, int micro_batches, ddp::GradReducer* reducer)
    : model_(model), options_(options), reducer_(reducer) {
  const StepOrder order = step_order_in_effect(options_.checkpointing, options_.order);
  EO_CHECK(options_.checkpointing || !options_.activation_offloading,
           "activation_offloading parks checkpointed block inputs: it needs gradient_checkpointing");
  schedule_ = make_step_schedule(model_.num_layers(), micro_batches, order);
  last_backward_ = schedule_.last_backward_use();
  std::vector<bool> moe(model_.num_layers());
  for (int i = 0; i < model_.num_layers(); ++i) moe[i] = model_.block(i).is_moe();
  model_.weight_provider().set_schedule(schedule_.staging_order(moe));
  const at::Device device = model_.options().device;
  store_ = std::make_unique<offload::ActivationStore>(device, options_.activation_offloading);
  graphs_ = std::make_unique<BlockGraphs>(device, options_.cuda_graphs);
}

StepRunner::~StepRunner() { model_.weight_provider().set_schedule({}); }

bool StepRunner::graphs_enabled() const { return graphs_->enabled(); }
int StepRunner::graphs_captured() const { return graphs_->graphs(); }

std::int64_t StepRunner::peak_checkpoint_bytes() const { return store_->peak_device_bytes(); }
std::int64_t StepRunner::checkpoint_host_bytes() const { return store_->host_bytes(); }

StepLosses StepRunner::run(const std::vector<data::MicroBatch>& micro, double global_tokens,
                           const std::function<bool(int)>& poison, const at::Tensor& loss_scale) {
  const int g = schedule_.micro_batches, n = schedule_.blocks;
  EO_CHECK(static_cast<int>(micro.size()) == g, "step: ", micro.size(), " micro-batches for a schedule of ", g);
  const at::Device device = model_.options().device;
  const std::uint64_t step_seed = options_.random_blocks ? draw_step_seed() : 0;
  const auto& mc = model_.config();

  // Per micro-batch: labels and the blocks' context on the device, the embedded hidden state.
  std::vector<at::Tensor> labels(g), hidden(g), dh(g);
  std::vector<model::BlockContext> ctx(g);
  StepLosses out;
  for (int m = 0; m < g; ++m) {
    const data::MicroBatch& mb = micro[m];
    model::Batch b;
    b.input_ids = to_device(mb.input_ids, device);
    b.positions = to_device(mb.position_ids, device);
    // Rows holding one document need no mask: plain causal attention takes the fused kernel.
    if (!single_document_rows(mb.segment_ids)) {
      b.segment_ids = to_device(mb.segment_ids.to(at::kLong), device);
      const at::Tensor starts = model::packed_document_starts(mb.segment_ids);  // undefined: the mask decides
      if (starts.defined()) b.document_starts = to_device(starts, device);
    }
    ctx[m] = model_.context(b, /*training=*/true);
    labels[m] = to_device(mb.labels, device);
    at::NoGradGuard no_grad;
    hidden[m] = model_.embed(mb.input_ids);  // host ids: the table may be host-held
    out.tokens += mb.num_target_tokens;
  }
  // Router logits of every (block, micro-batch) for the aux loss, and their gradients.
  std::vector<std::vector<at::Tensor>> logits(n, std::vector<at::Tensor>(g)), dlogits = logits;
  std::vector<std::vector<KeptGraph>> kept(n, std::vector<KeptGraph>(g));
  at::Tensor ce_sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  at::Tensor aux_sum = options_.aux_loss ? at::zeros_like(ce_sum) : at::Tensor();
  // The loss use's scalars as device tensors, so a graph of it reads this step's values.
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const at::Tensor tokens_t = at::full({}, global_tokens, f32), one_t = at::ones({}, f32);
  const at::Tensor nan_t = poison ? at::full({}, std::numeric_limits<double>::quiet_NaN(), f32) : at::Tensor();
  const at::Tensor scale_t = loss_scale.defined() ? loss_scale.to(device, at::kFloat).reshape({}) : one_t;

  // Runs block i on micro-batch m; `router` receives its router logits (MoE blocks) when set.
  auto run_block = [&](int i, int m, const at::Tensor& x, model::BlockContext c, at::Tensor* router) {
    std::vector<at::Tensor> captured;
    c.router_logits = router ? &captured : nullptr;
    UseRng rng(options_.random_blocks, step_seed, i, m, device);
    at::Tensor y = model_.block(i).forward(x, c);
    if (router && !captured.empty()) *router = captured.front();
    return y;
  };

  // A use's graph: its kind, its block and where the block's experts are staged now.
  auto use_key = [&](const char* kind, int i) {
    const std::int64_t where = model_.block(i).is_moe() ? model_.weight_provider().placement(i) : 0;
    return std::string(kind) + std::to_string(i) + "@" + std::to_string(where);
  };
  int staged_last = -1;  // the block of the previous use: consecutive uses of a block stage it once
  for (std::size_t k = 0; k < schedule_.uses.size(); ++k) {
    const BlockUse& u = schedule_.uses[k];
    if (u.kind != Kind::Loss && u.block != staged_last) {
      staged_last = u.block;
      if (model_.block(u.block).is_moe()) model_.weight_provider().stage(u.block);
      if (u.kind == Kind::Backward && u.block > 0) store_->prefetch(u.block - 1);
    }
    if (u.kind == Kind::Backward && model_.block(u.block).is_moe()) model_.weight_provider().before_backward(u.block);
    const int i = u.block, m = u.micro;
    at::Tensor* router = options_.aux_loss && i >= 0 && model_.block(i).is_moe() ? &logits[i][m] : nullptr;
    switch (u.kind) {
      case Kind::Forward: {
        if (options_.checkpointing) {
          store_->put(i, m, hidden[m]);
          const auto outs = graphs_->run(use_key("F", i), BlockUseInputs(hidden[m], ctx[m]).pack(),
                                         [&](const std::vector<at::Tensor>& packed) {
                                           at::NoGradGuard no_grad;
                                           const BlockUseInputs in = BlockUseInputs::unpack(packed);
                                           at::Tensor r;
                                           at::Tensor y = run_block(i, m, in.x, in.context(ctx[m]), router ? &r : nullptr);
                                           return std::vector<at::Tensor>{y, r};
                                         });
          hidden[m] = outs[0];
          if (router) *router = outs[1];
        } else {
          KeptGraph& kg = kept[i][m];
          kg.input = i > 0 ? hidden[m].detach().requires_grad_(true) : hidden[m];
          kg.output = run_block(i, m, kg.input, ctx[m], router ? &kg.router_logits : nullptr);
          hidden[m] = kg.output.detach();
          if (router) logits[i][m] = kg.router_logits.detach();
        }
        break;
      }
      case Kind::Loss: {
        LossUseInputs in{hidden[m], labels[m], tokens_t, poison && poison(m) ? nan_t : one_t, scale_t, {}};
        hidden[m] = at::Tensor();
        if (options_.aux_loss)
          for (int b = 0; b < n; ++b) in.router_logits.push_back(std::exchange(logits[b][m], at::Tensor()));
        const auto out = LossUseOutputs::unpack(graphs_->run("L", in.pack(), [&](const std::vector<at::Tensor>& packed) {
          const LossUseInputs x = LossUseInputs::unpack(packed);
          const at::Tensor h = x.h.detach().requires_grad_(true);
          const at::Tensor ce = model_.loss_sum(h, x.labels) * x.poison;
          at::Tensor loss = ce / x.tokens;
          std::vector<at::Tensor> leaves(x.router_logits.size());  // the router logits, as leaves
          std::vector<at::Tensor> present;
          for (std::size_t b = 0; b < leaves.size(); ++b)
            if (x.router_logits[b].defined()) present.push_back(leaves[b] = x.router_logits[b].detach().requires_grad_(true));
          at::Tensor aux;
          if (!present.empty()) {
            aux = model::load_balancing_loss(present, mc.experts, mc.top_k, at::Tensor());
            loss = loss + aux * options_.aux_coef;
          }
          // × the loss scale (1 unless fp16): a power of two, so this only shifts exponents.
          (loss * x.scale).backward();
          LossUseOutputs o{h.grad(), ce.detach(), aux.defined() ? aux.detach() : at::Tensor(), {}};
          for (const auto& l : leaves) o.drouter.push_back(l.defined() ? l.grad() : at::Tensor());
          return o.pack();
        }));
        dh[m] = out.dh;
        ce_sum.add_(out.ce.to(at::kDouble));
        if (out.aux.defined()) aux_sum.add_(out.aux.to(at::kDouble));
        for (std::size_t b = 0; b < out.drouter.size(); ++b) dlogits[b][m] = out.drouter[b];
        break;
      }
      case Kind::Backward: {
        // backward(roots = output (+ router logits), their gradients) from the block's input.
        auto backward = [&](const at::Tensor& input, std::vector<at::Tensor> roots, const at::Tensor& dy, const at::Tensor& dr) {
          std::vector<at::Tensor> grads{dy};
          if (roots.size() > 1) {
            EO_CHECK(dr.defined(), "step: block ", i, " has router logits but no aux-loss gradient for them");
            grads.push_back(dr);
          }
          // Block 0 without LoRA (peft_layers_to_transform leaves it out): nothing below it to reach.
          if (i == 0 && std::none_of(roots.begin(), roots.end(), [](const at::Tensor& t) { return t.requires_grad(); }))
            return at::Tensor();
          torch::autograd::backward(roots, grads);
          return i > 0 ? input.grad() : at::Tensor();
        };
        if (options_.checkpointing) {
          const at::Tensor x = store_->take(i, m);
          const auto outs = graphs_->run(
              use_key("B", i), BlockUseInputs(x, ctx[m], dh[m], dlogits[i][m]).pack(), [&](const std::vector<at::Tensor>& packed) {
                const BlockUseInputs in = BlockUseInputs::unpack(packed);
                const at::Tensor input = i > 0 ? in.x.detach().requires_grad_(true) : in.x;
                at::Tensor r;
                std::vector<at::Tensor> roots{run_block(i, m, input, in.context(ctx[m]), router ? &r : nullptr)};
                if (r.defined()) roots.push_back(r);
                return std::vector<at::Tensor>{backward(input, roots, in.dy, in.drouter)};
              });
          dh[m] = outs[0];
        } else {
          KeptGraph& kg = kept[i][m];
          std::vector<at::Tensor> roots{kg.output};
          if (router && kg.router_logits.defined()) roots.push_back(kg.router_logits);
          dh[m] = backward(kg.input, roots, dh[m], dlogits[i][m]);
          kg = KeptGraph{};
        }
        dlogits[i][m] = at::Tensor();
        if (reducer_ && k == last_backward_[i]) reducer_->block_done(i);
        break;
      }
    }
  }
  out.ce_sum = ce_sum;
  out.aux_sum = aux_sum;
  return out;
}

}  // namespace eo
