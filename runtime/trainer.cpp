#include "runtime/trainer.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <limits>

#include "common/error.h"
#include "common/log.h"
#include "common/text.h"
#include "models/moe_model.h"
#include "offload/engine.h"
#include "offload/host_memory.h"
#include "runtime/checkpoint.h"
#include "runtime/data/batcher.h"
#include "runtime/data/jsonl.h"
#include "runtime/data/tokens.h"
#include "runtime/device.h"
#include "runtime/dist/comm.h"
#include "runtime/dist/reducer.h"
#include "runtime/dist/world.h"
#include "runtime/metrics.h"
#include "runtime/optimizer.h"
#include "runtime/plan.h"
#include "runtime/signals.h"
#include "runtime/train_state.h"

namespace eo {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The config's datasets as one document source; token ids are checked against the vocabulary
// here, before training starts, with the file and line that is wrong.
std::shared_ptr<const data::DocumentSource> load_documents(const TrainConfig& cfg, std::int64_t vocab) {
  std::vector<std::shared_ptr<const data::DocumentSource>> parts;
  for (const auto& d : cfg.datasets) {
    if (d.type == "tokens") {
      parts.push_back(std::make_shared<data::TokenFileDocuments>(d.path, data::parse_token_dtype(d.dtype, d.path),
                                                                 d.eos_token_id, cfg.sequence_len, vocab));
    } else {
      std::vector<data::Example> examples;
      for (auto& line : data::read_tokenized_jsonl(d.path, vocab)) {
        data::Example e;
        e.input_ids.assign(line.input_ids.begin(), line.input_ids.end());
        e.labels.assign(line.labels.begin(), line.labels.end());
        examples.push_back(std::move(e));
      }
      parts.push_back(std::make_shared<data::InMemoryDocuments>(std::move(examples), d.path));
    }
  }
  if (parts.size() == 1) return parts[0];
  return std::make_shared<data::ConcatDocuments>(std::move(parts));
}

NamedTensors rng_state(const at::Device& device) {
  NamedTensors out;
  out.emplace_back("cpu", at::detail::getDefaultCPUGenerator().get_state());
  if (device.is_cuda()) out.emplace_back("cuda", at::globalContext().defaultGenerator(device).get_state());
  return out;
}

void restore_rng(const NamedTensors& state, const at::Device& device) {
  for (const auto& [name, t] : state) {
    if (name == "cpu") at::Generator(at::detail::getDefaultCPUGenerator()).set_state(t);  // copy shares the impl
    if (name == "cuda" && device.is_cuda()) {
      at::Generator g = at::globalContext().defaultGenerator(device);
      g.set_state(t);
    }
  }
}

// True when every row of a micro-batch's segment ids is one document (no packing boundary, no padding).
bool single_document_rows(const at::Tensor& segment_ids) {
  if (!segment_ids.defined() || segment_ids.numel() == 0) return true;
  const at::Tensor seg = segment_ids.to(at::kCPU);
  return (seg == seg.narrow(1, 0, 1)).all().item<bool>();
}

struct StepLoss {
  double ce_sum = 0;
  double aux_sum = 0;
  std::int64_t tokens = 0;
};

// Moves the model's NF4 experts into this rank's homes and streams them from there.
std::shared_ptr<offload::ExpertOffloader> start_offload(model::MoeModel& model, const TrainConfig& cfg, const at::Device& device) {
  auto* resident = dynamic_cast<model::ResidentWeights*>(&model.weight_provider());
  EO_CHECK(resident, "expert_offload: the model's experts are not held by a ResidentWeights store");
  bool any = false;
  for (const auto& layer : resident->bank()) any |= !layer.empty();
  if (!any)
    throw UsageError("expert_offload: true, but " + model.config().model_type + " checkpoint " + cfg.base_model +
                     " has no MoE expert blocks (looked for layers whose config makes them sparse — num_experts > 0, "
                     "decoder_sparse_step, mlp_only_layers — with " + model.config().moe_prefix() +
                     ".experts.* weights); set expert_offload: false");
  offload::OffloadOptions oo;
  oo.device = device;
  oo.pin_memory = cfg.expert_offload_pin_memory;
  oo.prefetch = cfg.expert_offload_prefetch;
  oo.prefetch_depth = cfg.expert_offload_prefetch_depth;
  const std::string& budget = cfg.expert_offload_vram_budget;
  if (budget == "auto") {
    // Sized after the first step, once the activation peak is known (see size_auto_budget).
    oo.vram_budget_bytes = 0;
  } else {
    oo.vram_budget_bytes = static_cast<std::int64_t>(parse_bytes(budget).value_or(0));
  }
  if (!device.is_cuda() && oo.vram_budget_bytes > 0)
    log::info("expert_offload_vram_budget applies to GPU memory; on the CPU the 'device' slots are host memory too");
  auto off = std::make_shared<offload::ExpertOffloader>(std::move(resident->bank()), oo);
  model.set_weight_provider(off);
  return off;
}

// Fault injection for the failure tests: EO_DDP_FAULT_STEP=<step>[,<step>...] or "all", with
// EO_DDP_FAULT=throw|kill|nan, on EO_DDP_FAULT_RANK (default: every rank). throw and kill end the
// rank (a rank that dies must take the job down with a message naming it); nan returns true and
// the step's loss on this rank becomes NaN (the non-finite step guard must skip the step).
bool inject_faults(std::int64_t step, int rank) {
  const char* at = std::getenv("EO_DDP_FAULT_STEP");
  if (!at) return false;
  const std::string steps = std::string(",") + at + ",";
  if (steps != ",all," && steps.find("," + std::to_string(step) + ",") == std::string::npos) return false;
  const char* who = std::getenv("EO_DDP_FAULT_RANK");
  if (who && std::to_string(rank) != who) return false;
  const std::string kind = std::getenv("EO_DDP_FAULT") ? std::getenv("EO_DDP_FAULT") : "throw";
  if (kind == "nan") return true;
  if (kind == "kill") std::raise(SIGKILL);
  EO_FAIL("fault injected at step ", step, " on rank ", rank, " (EO_DDP_FAULT_STEP)");
}

// Before any weight is read: the homes of every rank on this node must fit in the host RAM (and
// cgroup limit) available. Every rank measures, then the job takes the smallest measurement — an
// all-reduce that is also a barrier, so no rank has started filling its homes while another measures.
void check_host_memory_for_homes(const TrainConfig& cfg, dist::World& world) {
  const model::ModelConfig mc = model::load_config(cfg.base_model);
  const std::int64_t per_rank = offload::estimate_home_bytes(mc, cfg.bnb_4bit_blocksize, cfg.bnb_4bit_use_double_quant);
  offload::HostMemory mem = offload::host_memory_available();
  double v[2] = {-(mem.available < 0 ? 1e18 : double(mem.available)),
                 double(world.info().local_size)};
  world.allreduce_max(v, 2);
  const auto smallest = static_cast<std::int64_t>(-v[0]);
  if (mem.available >= 0 && smallest < mem.available) {
    mem.available = smallest;
    mem.source += ", the smallest of all ranks";
  }
  const int ranks_on_node = static_cast<int>(v[1]);
  offload::check_homes_fit(per_rank, ranks_on_node, mem);
  log::info("host memory: expert homes need " + human_bytes(double(per_rank)) + " per rank x " + std::to_string(ranks_on_node) +
            " rank(s) on the node; " + (mem.available < 0 ? std::string("available unknown") : human_bytes(double(mem.available)) +
            " available (" + mem.source + ")"));
}

// expert_offload_vram_budget: auto. After the first step: what the device can still give, less the
// step's activation peak (it recurs every step) and a safety margin, becomes resident blocks.
void size_auto_budget(offload::ExpertOffloader& off, const at::Device& device, std::int64_t step_start_allocated) {
  if (!device.is_cuda()) {
    log::info("expert_offload_vram_budget: auto keeps every block streamed on the CPU (no device memory to fill)");
    return;
  }
  synchronize(device);
  const std::int64_t activation_peak = std::max<std::int64_t>(0, peak_memory_bytes(device) - step_start_allocated);
  const std::int64_t margin = std::int64_t(512) << 20;
  const std::int64_t budget = free_device_memory(device) - activation_peak - margin;
  const int n = budget > 0 ? off.promote_resident(budget) : 0;
  log::info("expert_offload_vram_budget: auto -> " + human_bytes(double(std::max<std::int64_t>(0, budget))) + " free after a " +
            human_bytes(double(activation_peak)) + " activation peak: " + std::to_string(n) + " more block(s) resident (" +
            std::to_string(off.resident_layers().size()) + " in all)");
}

// Before any weight is read: cap the allocator (device_memory_limit) and refuse a run whose
// planned peak cannot fit, with the plan's numbers instead of an out-of-memory error mid-step.
// On the CPU only an explicit device_memory_limit is checked (host RAM is the "device").
void check_memory_plan(const TrainConfig& cfg, const at::Device& device, bool bf16, int local_size) {
  const MemoryPlan plan = plan_memory(cfg, model::load_config(cfg.base_model), bf16, local_size, device.is_cuda());
  if (device.is_cuda()) set_device_memory_limit(device, cfg.device_memory_limit);
  double available = 0;
  std::string what;
  if (cfg.device_memory_limit > 0) {
    available = double(cfg.device_memory_limit);
    what = "device_memory_limit " + human_bytes(available);
  } else if (device.is_cuda()) {
    available = double(free_device_memory(device));
    what = human_bytes(available) + " free on " + describe_device(device);
  } else {
    return;
  }
  log::info("memory plan: peak " + human_bytes(plan.device_peak) + " of " + what +
            (plan.host_pinned > 0 ? "; " + human_bytes(plan.host_pinned) + " pinned host RAM per rank" : std::string()));
  if (plan.device_peak <= available) return;
  std::string fixes;
  if (!cfg.expert_offload) fixes += "expert_offload: true (experts " + human_bytes(plan.expert_bytes) + " to host RAM), ";
  fixes += "a smaller micro_batch_size or sequence_len (activations scale with tokens per micro-batch)";
  throw UsageError("this run does not fit: the plan needs " + human_bytes(plan.device_peak) + " of device memory, " + what +
                   ".\n" + describe_plan(plan, available) + "Try " + fixes + ". (eo-ddp plan --config F --vram SIZE "
                   "shows the plan without starting.)");
}

}  // namespace

TrainResult train(const TrainConfig& cfg, dist::World& world) {
  install_checkpoint_engine();
  install_stop_signals();
  // A write past RLIMIT_FSIZE (ulimit -f) must fail with EFBIG and a message, like a full disk,
  // instead of killing the process with SIGXFSZ in the middle of a checkpoint.
  std::signal(SIGXFSZ, SIG_IGN);
  const auto& wi = world.info();
  const at::Device device = pick_device(wi.local_rank, wi.local_size);
  const bool bf16 = config_use_bf16(cfg, device.is_cuda());
  at::manual_seed(static_cast<std::uint64_t>(cfg.seed));
  check_memory_plan(cfg, device, bf16, wi.local_size);
  const auto t_load = Clock::now();
  if (cfg.expert_offload) check_host_memory_for_homes(cfg, world);

  // ---- data: read and checked before any weight, so a bad file costs no loading time
  auto docs = load_documents(cfg, model::load_config(cfg.base_model).vocab);
  data::BatcherOptions bo;
  bo.sequence_len = cfg.sequence_len;
  bo.sample_packing = cfg.sample_packing;
  bo.micro_batch_size = cfg.micro_batch_size;
  bo.seed = cfg.seed;
  bo.rank = wi.rank;
  bo.world_size = wi.world_size;
  data::Batcher batcher(docs, bo);
  const std::int64_t per_epoch = batcher.num_batches_per_epoch();
  const std::int64_t accum = cfg.gradient_accumulation_steps;
  if (per_epoch < accum)  // one optimizer step would see some sequences twice
    throw UsageError("dataset " + docs->name() + " has " + std::to_string(batcher.num_sequences()) + " sequences of " +
                     std::to_string(cfg.sequence_len) + " tokens; one optimizer step needs " +
                     std::to_string(cfg.micro_batch_size * accum * wi.world_size) + " (micro_batch_size " +
                     std::to_string(cfg.micro_batch_size) + " x gradient_accumulation_steps " + std::to_string(accum) + " x " +
                     std::to_string(wi.world_size) + " ranks). Add data or lower micro_batch_size, gradient_accumulation_steps "
                     "or the number of ranks.");
  const std::int64_t total_steps =
      cfg.max_steps ? *cfg.max_steps
                    : std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(cfg.num_epochs * double(per_epoch) / double(accum))));
  const std::int64_t warmup = resolve_warmup_steps(cfg, total_steps);
  log::info("data: " + std::to_string(docs->num_documents()) + " documents -> " + std::to_string(batcher.num_sequences()) +
            " sequences of " + std::to_string(cfg.sequence_len) + " tokens; " + std::to_string(per_epoch) +
            " micro-batches per epoch; " + std::to_string(total_steps) + " optimizer steps");

  // ---- model
  model::LoadOptions lo;
  lo.dtype = bf16 ? at::kBFloat16 : at::kFloat;
  lo.load_in_4bit = cfg.load_in_4bit;
  lo.blocksize = cfg.bnb_4bit_blocksize;
  lo.double_quant = cfg.bnb_4bit_use_double_quant;
  lo.device = device;
  lo.experts_on_host = cfg.expert_offload;
  if (cfg.synthetic_weights) lo.random_seed = static_cast<std::uint64_t>(cfg.seed);
  log::info("loading " + cfg.base_model + (cfg.load_in_4bit ? " (quantising decoder linears to NF4)" : "") + " on " +
            describe_device(device) + ", " + (bf16 ? "bf16" : "fp32") + " compute");
  auto model = model::MoeModel::load(cfg.base_model, lo);
  const auto& mc = model->config();
  std::shared_ptr<offload::ExpertOffloader> offloader;
  if (cfg.expert_offload) offloader = start_offload(*model, cfg, device);
  model::LoraSpec spec;
  spec.r = cfg.lora_r;
  spec.alpha = cfg.lora_alpha;
  spec.dropout = cfg.lora_dropout;
  spec.use_rslora = cfg.peft_use_rslora;
  spec.targets = cfg.lora_target_modules;
  spec.seed = static_cast<std::uint64_t>(cfg.seed);
  model->add_lora(spec);
  const NamedTensors lora = model->lora_parameters();
  EO_CHECK(!lora.empty(), "no LoRA target found in ", cfg.base_model, " for lora_target_modules [",
           join(cfg.lora_target_modules, ", "), "]");
  std::vector<at::Tensor> params;
  std::int64_t trainable = 0;
  for (const auto& [n, p] : lora) {
    params.push_back(p);
    trainable += p.numel();
  }
  log::info("model " + mc.model_type + ": " + std::to_string(model->num_layers()) + " layers, LoRA r=" +
            std::to_string(cfg.lora_r) + " on " + std::to_string(lora.size() / 2) + " modules (" +
            std::to_string(trainable) + " trainable parameters); loaded in " + std::to_string(seconds_since(t_load)).substr(0, 5) + " s");

  // ---- optimizer and resume
  Optimizer optimizer(lora, cfg);
  std::int64_t step = 0;
  nlohmann::json resumed_extra = nlohmann::json::object();  // counters saved in the checkpoint
  std::string resume = cfg.resume_from_checkpoint;
  if (resume == "auto") {
    auto latest = latest_checkpoint(cfg.output_dir);
    resume = latest.value_or("");
    if (!latest) log::info("resume_from_checkpoint: auto found no checkpoint in " + cfg.output_dir + "; starting fresh");
  }
  if (!resume.empty()) {
    TrainingState s = load_checkpoint(resume);
    std::map<std::string, at::Tensor> saved(s.lora.begin(), s.lora.end());
    for (const auto& [n, p] : lora) {
      auto it = saved.find(n);
      EO_CHECK(it != saved.end(), "checkpoint ", resume, " has no tensor ", n, " (different model or lora_target_modules?)");
      EO_CHECK(it->second.sizes() == p.sizes(), "checkpoint ", resume, ": ", n, " has shape ", it->second.sizes(),
               ", the model ", p.sizes(), " (different lora_r?)");
      at::NoGradGuard ng;
      p.copy_(it->second);
    }
    EO_CHECK(saved.size() == lora.size(), "checkpoint ", resume, " has ", saved.size(), " LoRA tensors, the model ", lora.size());
    optimizer.load_state(std::map<std::string, at::Tensor>(s.optimizer.begin(), s.optimizer.end()));
    restore_rng(s.rng, device);
    batcher.restore(s.data_cursor);
    step = s.step;
    resumed_extra = s.extra.is_object() ? s.extra : nlohmann::json::object();
    log::info("resumed from " + resume + " at step " + std::to_string(step));
  }

  // ---- data parallel: rank 0's LoRA everywhere, homes checked equal, gradients in buckets.
  // The expert homes are never sent: each rank loaded them itself; a checksum proves they agree.
  dist::Communicator comm(world, device, cfg.ddp_timeout);
  if (wi.world_size > 1) {
    {
      at::NoGradGuard ng;
      dist::broadcast_parameters(lora, comm, 0);
    }
    if (offloader) {
      std::vector<dist::HostBytes> homes;
      for (const auto& [ptr, n] : offloader->home_ranges()) homes.push_back({ptr, n});
      dist::check_same_bytes(homes, comm, "expert homes (did every rank load the same checkpoint?)");
    }
    log::info("data parallel: " + std::to_string(wi.world_size) + " ranks, LoRA broadcast from rank 0" +
              (offloader ? ", expert homes identical on every rank (" + human_bytes(double(offloader->home_bytes())) +
                               " pinned per rank, " + human_bytes(double(offloader->home_bytes()) * wi.local_size) + " on this node)"
                         : std::string()));
  }
  dist::ReducerOptions ro;
  ro.bucket_cap_bytes = static_cast<std::int64_t>(cfg.ddp_bucket_cap_mb) << 20;
  ro.op = dist::ReduceOp::kSum;  // the loss is already normalised by the global token count
  std::unique_ptr<dist::GradReducer> reducer;
  if (wi.world_size > 1) reducer = std::make_unique<dist::GradReducer>(lora, comm, ro);

  std::unique_ptr<MetricsLog> metrics;
  if (wi.rank == 0) metrics = std::make_unique<MetricsLog>(cfg.output_dir, resume.empty() ? 0 : step);
  // Non-finite steps skipped in all (metrics' skipped_nonfinite) and in a row; kept in checkpoints.
  std::int64_t skipped_nonfinite = resumed_extra.value("skipped_nonfinite", std::int64_t(0));
  std::int64_t nonfinite_streak = resumed_extra.value("nonfinite_streak", std::int64_t(0));
  auto save = [&](const std::string& why) {
    TrainingState s;
    s.step = step;
    s.data_cursor = batcher.state();
    s.world_size = wi.world_size;
    s.lora = model->lora_parameters();
    s.optimizer = optimizer.state();
    s.rng = rng_state(device);
    s.extra = {{"skipped_nonfinite", skipped_nonfinite}, {"nonfinite_streak", nonfinite_streak}};
    if (wi.rank == 0) {
      const std::string dir = save_checkpoint(cfg.output_dir, s, cfg, cfg.save_total_limit);
      log::info("saved " + dir + " (" + why + ")");
    }
  };

  // ---- loop
  TrainResult result;
  const auto t_start = Clock::now();
  const double aux_coef = cfg.router_aux_loss_coef.value_or(mc.router_aux_loss_coef);
  reset_peak_memory(device);
  bool auto_budget_pending = offloader && cfg.expert_offload_vram_budget == "auto";
  while (step < total_steps) {
    const bool inject_nan = inject_faults(step + 1, wi.rank);
    const auto t_step = Clock::now();
    const std::int64_t step_start_allocated = allocated_memory_bytes(device);
    std::vector<data::MicroBatch> micro;
    std::int64_t tokens[1] = {0};
    for (std::int64_t m = 0; m < accum; ++m) {
      micro.push_back(batcher.next());
      tokens[0] += micro.back().num_target_tokens;
    }
    world.allreduce_sum(tokens, 1);
    const double global_tokens = double(std::max<std::int64_t>(1, tokens[0]));
    StepLoss sl;
    for (std::size_t m = 0; m < micro.size(); ++m) {
      const data::MicroBatch& mb = micro[m];
      const bool last = m + 1 == micro.size();
      if (reducer) reducer->begin_micro_step(/*sync=*/last);
      model::Batch b;
      b.input_ids = mb.input_ids.to(device);
      b.labels = mb.labels.to(device);
      b.positions = mb.position_ids.to(device);
      // Rows holding one document need no mask: plain causal attention takes the fused kernel.
      if (!single_document_rows(mb.segment_ids)) b.segment_ids = mb.segment_ids.to(device, at::kLong);
      std::vector<at::Tensor> router_logits;
      model::BlockContext ctx = model->context(b, /*training=*/true);
      if (cfg.output_router_logits) ctx.router_logits = &router_logits;
      at::Tensor hidden = model->embed(mb.input_ids);  // host ids: the table may be host-held
      for (int i = 0; i < model->num_layers(); ++i) {
        const model::DecoderBlock& block = model->block(i);
        if (cfg.gradient_checkpointing)
          hidden = checkpoint([&block, ctx](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{block.forward(in[0], ctx)}; },
                              {hidden})[0];
        else
          hidden = block.forward(hidden, ctx);
      }
      at::Tensor ce_sum = model->loss_sum(hidden, b.labels);
      const std::int64_t count = mb.num_target_tokens;
      if (inject_nan) ce_sum = ce_sum * std::numeric_limits<double>::quiet_NaN();  // EO_DDP_FAULT=nan
      at::Tensor loss = ce_sum / global_tokens;
      if (cfg.output_router_logits && !router_logits.empty()) {
        at::Tensor aux = model::load_balancing_loss(router_logits, mc.experts, mc.top_k, at::Tensor());
        loss = loss + aux * (aux_coef / double(accum * wi.world_size));
        sl.aux_sum += aux.item<double>();
      }
      if (reducer && last) reducer->prepare_for_backward(loss);
      loss.backward();
      sl.ce_sum += ce_sum.item<double>();
      sl.tokens += count;
    }
    if (reducer) reducer->finalize();
    const double grad_norm = clip_grad_norm(params, cfg.max_grad_norm);  // scales nothing when not finite
    const double lr = cfg.learning_rate * lr_multiplier(cfg.lr_scheduler, step, warmup, total_steps);
    // Non-finite guard. The gradients are all-reduced, but the loss is not, so each rank adds a
    // flag and every rank takes the same decision from the summed flags. A skipped step leaves the
    // LoRA and the optimizer state (AdamW's step count included) untouched; it still counts as a
    // step (its batch is consumed and the LR schedule, a function of the step, moves on), as
    // transformers' Trainer does when the AMP grad scaler skips an update.
    const bool loss_finite_here = std::isfinite(sl.ce_sum) && std::isfinite(sl.aux_sum);
    double sums[4] = {sl.ce_sum, sl.aux_sum, loss_finite_here ? 0.0 : 1.0, std::isfinite(grad_norm) ? 0.0 : 1.0};
    world.allreduce_sum(sums, 4);
    const bool skip = sums[2] > 0 || sums[3] > 0;
    if (skip) {
      ++skipped_nonfinite;
      ++nonfinite_streak;
      if (wi.rank == 0)
        log::warn("step " + std::to_string(step + 1) + ": loss " + std::to_string(sums[0] / global_tokens) + ", gradient norm " +
                  std::to_string(grad_norm) + " (non-finite loss on " + std::to_string(int(sums[2])) + " of " +
                  std::to_string(wi.world_size) + " rank(s)); skipped without an optimizer update (" + std::to_string(nonfinite_streak) + " in a row, " +
                  std::to_string(cfg.max_nonfinite_steps) + " stop the run)");
    } else {
      optimizer.step(lr);
      nonfinite_streak = 0;
    }
    optimizer.zero_grad();
    ++step;
    StepReport r;
    r.step = step;
    r.total_steps = total_steps;
    r.epoch = double(micro.back().epoch) + double(micro.back().position + 1) / double(std::max<std::int64_t>(1, batcher.num_sequences()));
    r.loss = sums[0] / global_tokens;
    r.lr = lr;
    r.grad_norm = grad_norm;
    r.tokens = tokens[0];
    r.step_time_s = seconds_since(t_step);
    r.tokens_per_sec = double(tokens[0]) / std::max(1e-9, r.step_time_s);
    r.peak_mem_bytes = peak_memory_bytes(device);
    r.elapsed_s = seconds_since(t_start);
    if (cfg.output_router_logits) r.extra["aux_loss"] = sums[1] / double(accum * wi.world_size);
    if (offloader) {
      const offload::OffloadStats os = offloader->take_step_stats();
      r.extra["staged_bytes"] = os.copied_bytes;
      r.extra["stagings"] = os.copies;
      r.extra["stage_calls"] = os.stage_calls;
      r.extra["h2d_gbps"] = os.copy_seconds > 0 ? double(os.copied_bytes) / os.copy_seconds / 1e9 : 0.0;
      r.extra["copy_s"] = os.copy_seconds;
      r.extra["stall_s"] = os.stall_seconds;
      r.extra["resident_blocks"] = offloader->resident_layers().size();
    }
    if (result.steps == 0) result.first_loss = r.loss;
    result.last_loss = r.loss;
    result.steps = step;
    r.extra["skipped_nonfinite"] = skipped_nonfinite;
    if (wi.rank == 0 && (skip || step % cfg.logging_steps == 0 || step == total_steps)) {
      log::progress(progress_line(r), step == total_steps);
      metrics->write(r);
    }
    if (nonfinite_streak >= cfg.max_nonfinite_steps)
      EO_FAIL("the loss or gradients were NaN/Inf for ", nonfinite_streak, " consecutive steps (", step - nonfinite_streak + 1,
              " to ", step, ", max_nonfinite_steps: ", cfg.max_nonfinite_steps,
              "); stopping. Those steps did not change the adapter. Lower learning_rate, check the data, or start from an "
              "earlier checkpoint (resume_from_checkpoint)");
    // A stop request on any rank stops every rank at this same step.
    double stop[1] = {stop_requested() ? 1.0 : 0.0};
    world.allreduce_max(stop, 1);
    if (stop[0] > 0) {
      save("stop requested by signal " + std::to_string(stop_signal()));
      log::info("stopped at step " + std::to_string(step) + "; resume with resume_from_checkpoint: auto");
      result.exit_code = kExitPreempted;
      return result;
    }
    if (cfg.save_steps > 0 && step % cfg.save_steps == 0 && step < total_steps) save("save_steps");
    if (auto_budget_pending) {
      size_auto_budget(*offloader, device, step_start_allocated);
      auto_budget_pending = false;
    }
  }
  save("end of training");
  if (wi.world_size > 1) {
    // Every rank must end with the same adapter; a difference is a bug worth failing loudly on.
    std::vector<at::Tensor> host;
    std::vector<dist::HostBytes> ranges;
    for (const auto& [n, p] : lora) host.push_back(p.detach().to(at::kCPU).contiguous());
    for (const auto& t : host) ranges.push_back({t.data_ptr(), static_cast<std::size_t>(t.numel() * t.element_size())});
    const dist::CommStats cs = comm.stats();
    dist::check_same_bytes(ranges, comm, "LoRA parameters after training");
    log::info("LoRA identical on all " + std::to_string(wi.world_size) + " ranks; collectives: allreduce " +
              std::to_string(cs.allreduce_bytes) + " bytes, broadcast " + std::to_string(cs.broadcast_bytes) + " bytes");
  }
  if (wi.rank == 0) {
    write_adapter(cfg.output_dir, model->lora_parameters(), cfg);
    log::info("adapter written to " + cfg.output_dir + " (adapter_model.safetensors, adapter_config.json)");
  }
  result.adapter_dir = cfg.output_dir;
  return result;
}

}  // namespace eo
