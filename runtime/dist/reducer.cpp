#include "runtime/dist/reducer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "common/error.h"

namespace eo::dist {
namespace {
using torch::autograd::variable_list;

// Runs `fn` after the parameter's AccumulateGrad node has written p.grad().
struct ReadyHook : torch::autograd::FunctionPostHook {
  explicit ReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }
  std::function<void()> fn_;
};

torch::autograd::Node* node_of(const std::shared_ptr<void>& keep) { return static_cast<torch::autograd::Node*>(keep.get()); }

// libtorch 2.11 returns std::shared_ptr<Node>, 2.13 c10::intrusive_ptr<Node>: keep either alive
// behind a shared_ptr<void> whose pointer is the Node.
template <typename Ptr>
std::shared_ptr<void> keep_alive(Ptr p) {
  torch::autograd::Node* raw = p.get();
  return std::shared_ptr<void>(raw, [keep = std::move(p)](void*) mutable { keep = Ptr(); });
}
}  // namespace

GradReducer::GradReducer(std::vector<NamedTensor> params_in_use_order, Communicator& comm, ReducerOptions options)
    : params_(std::move(params_in_use_order)), comm_(comm), options_(options) {
  EO_CHECK(options_.bucket_cap_bytes > 0, "ddp_bucket_cap_mb must be positive");
  std::set<const void*> seen;
  for (const auto& [name, p] : params_) {
    EO_CHECK(p.defined(), "DDP parameter '", name, "' is undefined");
    EO_CHECK(p.requires_grad() && p.is_leaf(), "DDP parameter '", name,
             "' must be a trainable leaf (requires_grad); frozen or offloaded weights never enter a bucket");
    EO_CHECK(p.scalar_type() == at::kFloat, "DDP parameter '", name, "' is ", p.scalar_type(),
             "; trainable parameters are kept and reduced in fp32");
    EO_CHECK(p.layout() == at::kStrided, "DDP parameter '", name, "' is sparse; only dense gradients are reduced");
    EO_CHECK(p.device() == comm_.device(), "DDP parameter '", name, "' is on ", p.device().str(),
             " but the communicator serves ", comm_.device().str());
    EO_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "DDP parameter '", name, "' is listed twice");
  }
  // Reverse order of use: the parameters used last in forward get their gradients first.
  const std::size_t n = params_.size();
  bucket_of_.assign(n, 0);
  slot_of_.assign(n, 0);
  std::int64_t filled = 0;
  for (std::size_t k = n; k-- > 0;) {
    const std::int64_t bytes = params_[k].second.numel() * 4;
    if (buckets_.empty() || (!buckets_.back().params.empty() && filled + bytes > options_.bucket_cap_bytes)) {
      buckets_.emplace_back();
      filled = 0;
    }
    Bucket& b = buckets_.back();
    bucket_of_[k] = buckets_.size() - 1;
    slot_of_[k] = b.params.size();
    b.offsets.push_back(filled / 4);
    b.params.push_back(k);
    filled += bytes;
  }
  ready_.assign(n, false);
  if (comm_.size() == 1) return;  // a world of one: no buffers, no hooks
  for (auto& b : buckets_) {
    std::int64_t numel = 0;
    for (std::size_t k : b.params) numel += params_[k].second.numel();
    b.flat = at::zeros({numel}, at::TensorOptions().dtype(at::kFloat).device(comm_.device()));
  }
  for (std::size_t k = 0; k < n; ++k) {
    auto acc = keep_alive(torch::autograd::impl::grad_accumulator(params_[k].second));
    EO_CHECK(acc, "DDP parameter '", params_[k].first, "' has no gradient accumulator");
    hook_keys_.push_back(node_of(acc)->add_post_hook(std::make_unique<ReadyHook>([this, k] { on_grad_ready(k); })));
    accumulators_.push_back(std::move(acc));
  }
  reset_step();
}

GradReducer::~GradReducer() {
  for (std::size_t k = 0; k < accumulators_.size(); ++k) node_of(accumulators_[k])->del_post_hook(hook_keys_[k]);
}

std::vector<std::string> GradReducer::bucket_param_names(std::size_t bucket) const {
  std::vector<std::string> out;
  for (std::size_t k : buckets_.at(bucket).params) out.push_back(params_[k].first);
  return out;
}

std::int64_t GradReducer::bucket_bytes(std::size_t bucket) const {
  std::int64_t bytes = 0;
  for (std::size_t k : buckets_.at(bucket).params) bytes += params_[k].second.numel() * 4;
  return bytes;
}

std::int64_t GradReducer::hook_firings() const {
  std::lock_guard<std::mutex> lk(mu_);
  return hook_firings_;
}

std::int64_t GradReducer::launched_from_hooks() const {
  std::lock_guard<std::mutex> lk(mu_);
  return launched_from_hooks_;
}

void GradReducer::reset_step() {
  std::fill(ready_.begin(), ready_.end(), false);
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.handle = 0;
    b.launched = false;
  }
  next_bucket_ = 0;
}

void GradReducer::begin_micro_step(bool sync) {
  std::lock_guard<std::mutex> lk(mu_);
  const bool started = next_bucket_ > 0 || std::find(ready_.begin(), ready_.end(), true) != ready_.end();
  EO_CHECK(!started, "GradReducer::begin_micro_step: the previous synchronised micro-step's gradients were not "
                     "finalised; call finalize() after the last micro-step's backward");
  sync_ = sync;
}

void GradReducer::copy_in(std::size_t k, bool zeros_if_missing) {
  const at::Tensor& p = params_[k].second;
  Bucket& b = buckets_[bucket_of_[k]];
  at::Tensor dst = b.flat.narrow(0, b.offsets[slot_of_[k]], p.numel()).view(p.sizes());
  const at::Tensor& g = p.grad();
  if (g.defined()) {
    dst.copy_(g);
  } else {
    EO_CHECK(zeros_if_missing, "DDP parameter '", params_[k].first, "' fired its gradient hook without a gradient");
    dst.zero_();
  }
}

void GradReducer::launch_ready_in_order() {
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    Bucket& b = buckets_[next_bucket_];
    std::ostringstream what;
    what << "gradient bucket " << next_bucket_ << " (" << b.params.size() << " params from '"
         << params_[b.params.front()].first << "')";
    b.handle = comm_.allreduce_async(b.flat, options_.op, what.str());
    b.launched = true;
    ++next_bucket_;
  }
}

// Autograd thread: p.grad() now holds this step's accumulated gradient.
void GradReducer::on_grad_ready(std::size_t k) {
  std::lock_guard<std::mutex> lk(mu_);
  ++hook_firings_;
  if (!sync_) return;  // gradient-accumulation micro-step: stay local
  EO_CHECK(!ready_[k], "DDP parameter '", params_[k].first,
           "' received its gradient twice in one synchronised backward; each trainable parameter may be "
           "accumulated once per micro-step");
  at::NoGradGuard no_grad;
  copy_in(k, /*zeros_if_missing=*/false);
  ready_[k] = true;
  const std::size_t launched_before = next_bucket_;
  if (--buckets_[bucket_of_[k]].pending == 0) launch_ready_in_order();
  launched_from_hooks_ += static_cast<std::int64_t>(next_bucket_ - launched_before);
}

void GradReducer::prepare_for_backward(const at::Tensor& loss) {
  if (comm_.size() == 1) return;
  std::lock_guard<std::mutex> lk(mu_);
  if (!sync_) return;
  std::set<const torch::autograd::Node*> reachable;
  std::vector<torch::autograd::Node*> stack;
  if (loss.grad_fn()) stack.push_back(loss.grad_fn().get());
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!reachable.insert(node).second) continue;
    for (const auto& edge : node->next_edges())
      if (edge.function) stack.push_back(edge.function.get());
  }
  at::NoGradGuard no_grad;
  for (std::size_t k = 0; k < params_.size(); ++k) {
    if (ready_[k] || reachable.count(node_of(accumulators_[k]))) continue;
    copy_in(k, /*zeros_if_missing=*/true);
    ready_[k] = true;
    --buckets_[bucket_of_[k]].pending;
  }
  launch_ready_in_order();
}

void GradReducer::finalize() {
  std::lock_guard<std::mutex> lk(mu_);
  EO_CHECK(sync_, "GradReducer::finalize after begin_micro_step(false): the last micro-step must be synchronised");
  at::NoGradGuard no_grad;
  if (comm_.size() == 1) {
    for (auto& [name, p] : params_)
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    return;
  }
  // Parameters that got no gradient in the last backward: their earlier micro-steps' gradient,
  // or zeros. Same buckets, same order on every rank.
  for (std::size_t bi = next_bucket_; bi < buckets_.size(); ++bi) {
    Bucket& b = buckets_[bi];
    for (std::size_t k : b.params) {
      if (ready_[k]) continue;
      copy_in(k, /*zeros_if_missing=*/true);
      ready_[k] = true;
    }
    b.pending = 0;
  }
  launch_ready_in_order();
  for (auto& b : buckets_) comm_.wait(b.handle);
  for (std::size_t k = 0; k < params_.size(); ++k) {
    at::Tensor& p = params_[k].second;
    const Bucket& b = buckets_[bucket_of_[k]];
    at::Tensor reduced = b.flat.narrow(0, b.offsets[slot_of_[k]], p.numel()).view(p.sizes());
    if (p.grad().defined())
      p.mutable_grad().copy_(reduced);
    else
      p.mutable_grad() = reduced.clone();
  }
  reset_step();
}

void broadcast_parameters(const std::vector<NamedTensor>& tensors, Communicator& comm, int root, std::int64_t chunk_bytes) {
  if (comm.size() == 1) return;
  EO_CHECK(chunk_bytes > 0, "broadcast_parameters: chunk_bytes must be positive");
  at::NoGradGuard no_grad;
  // Group by (device, dtype), keeping the given order inside each group (same on every rank).
  std::map<std::pair<std::string, int>, std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i].second;
    EO_CHECK(t.defined(), "broadcast_parameters: tensor '", tensors[i].first, "' is undefined");
    if (t.numel() == 0) continue;
    groups[{t.device().str(), static_cast<int>(t.scalar_type())}].push_back(i);
  }
  const bool is_root = comm.rank() == root;
  for (const auto& [key, members] : groups) {
    std::size_t i = 0;
    while (i < members.size()) {
      // One chunk: consecutive tensors up to chunk_bytes (a larger tensor goes alone).
      std::size_t j = i;
      std::int64_t numel = 0, bytes = 0;
      while (j < members.size()) {
        const at::Tensor& t = tensors[members[j]].second;
        const std::int64_t b = t.numel() * static_cast<std::int64_t>(t.element_size());
        if (j > i && bytes + b > chunk_bytes) break;
        numel += t.numel();
        bytes += b;
        ++j;
      }
      const at::Tensor& first = tensors[members[i]].second;
      const std::string what = "'" + tensors[members[i]].first + "' and " + std::to_string(j - i - 1) + " more (" +
                               std::to_string(bytes) + " bytes)";
      if (j == i + 1 && first.is_contiguous()) {
        comm.broadcast(first, root, what);  // in place
      } else {
        at::Tensor flat = at::empty({numel}, first.options().requires_grad(false));
        std::int64_t off = 0;
        if (is_root)
          for (std::size_t m = i; m < j; ++m) {
            const at::Tensor& t = tensors[members[m]].second;
            flat.narrow(0, off, t.numel()).view(t.sizes()).copy_(t);
            off += t.numel();
          }
        comm.broadcast(flat, root, what);
        off = 0;
        for (std::size_t m = i; m < j; ++m) {
          const at::Tensor& t = tensors[members[m]].second;
          if (!is_root) t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
          off += t.numel();
        }
      }
      i = j;
    }
  }
}

namespace {
inline std::uint64_t mix64(std::uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
inline std::uint64_t rotl(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// Four independent lanes over 32-byte blocks (fast enough for tens of GB of homes), then a tail.
std::uint64_t hash_range(const unsigned char* p, std::size_t n, std::uint64_t seed) {
  constexpr std::uint64_t kMul = 0x9E3779B97F4A7C15ULL;
  std::uint64_t lane[4] = {seed ^ 0x243F6A8885A308D3ULL, seed ^ 0x13198A2E03707344ULL, seed ^ 0xA4093822299F31D0ULL,
                           seed ^ 0x082EFA98EC4E6C89ULL};
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int l = 0; l < 4; ++l) {
      std::uint64_t w;
      std::memcpy(&w, p + i + 8 * l, 8);
      lane[l] = rotl(lane[l] ^ (w * kMul), 31) * 0xC2B2AE3D27D4EB4FULL;
    }
  std::uint64_t h = mix64(n) ^ lane[0] ^ rotl(lane[1], 17) ^ rotl(lane[2], 29) ^ rotl(lane[3], 43);
  for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001B3ULL;
  return mix64(h);
}
}  // namespace

std::uint64_t checksum_bytes(const std::vector<HostBytes>& ranges) {
  std::uint64_t h = mix64(ranges.size());
  for (std::size_t r = 0; r < ranges.size(); ++r)
    h = mix64(h ^ hash_range(static_cast<const unsigned char*>(ranges[r].data), ranges[r].size, r + 1));
  return h;
}

ChecksumReport checksum_allreduce(const std::vector<HostBytes>& ranges, Communicator& comm, const std::string& what) {
  ChecksumReport rep;
  rep.per_rank = comm.allgather(checksum_bytes(ranges), "checksum of " + what);
  // The majority value is "right" (ties go to rank 0's), so a lone bad rank is the one named.
  std::map<std::uint64_t, int> votes;
  for (auto v : rep.per_rank) ++votes[v];
  std::uint64_t majority = rep.per_rank[0];
  for (const auto& [v, c] : votes)
    if (c > votes[majority]) majority = v;
  std::ostringstream msg;
  for (std::size_t r = 0; r < rep.per_rank.size(); ++r)
    if (rep.per_rank[r] != majority) rep.differing_ranks.push_back(static_cast<int>(r));
  rep.agree = rep.differing_ranks.empty();
  if (!rep.agree) {
    msg << what << " differ across ranks: rank" << (rep.differing_ranks.size() > 1 ? "s" : "");
    for (std::size_t i = 0; i < rep.differing_ranks.size(); ++i) msg << (i ? ", " : " ") << rep.differing_ranks[i];
    msg << " hold checksum" << (rep.differing_ranks.size() > 1 ? "s" : "") << std::hex;
    for (std::size_t i = 0; i < rep.differing_ranks.size(); ++i) msg << (i ? ", " : " ") << "0x" << rep.per_rank[rep.differing_ranks[i]];
    msg << " where the other ranks hold 0x" << majority << std::dec
        << "; every rank must load the same checkpoint (check the model path and that no file changed)";
    rep.message = msg.str();
  }
  return rep;
}

void check_same_bytes(const std::vector<HostBytes>& ranges, Communicator& comm, const std::string& what) {
  const ChecksumReport rep = checksum_allreduce(ranges, comm, what);
  EO_CHECK(rep.agree, rep.message);
}

}  // namespace eo::dist
