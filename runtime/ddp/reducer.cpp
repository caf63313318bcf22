#include "runtime/ddp/reducer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cstring>
#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include "common/checksum.h"
#include "common/error.h"

namespace eo::ddp {

std::vector<BucketPlan> assign_buckets(const std::vector<std::int64_t>& sizes, const std::vector<int>& blocks,
                                       std::int64_t cap_bytes) {
  EO_CHECK(cap_bytes > 0, "ddp_bucket_cap_mb must be positive");
  EO_CHECK(blocks.empty() || blocks.size() == sizes.size(), "assign_buckets: ", sizes.size(), " sizes but ", blocks.size(),
           " block indices");
  auto block_of = [&](std::size_t k) { return blocks.empty() ? 0 : blocks[k]; };
  // Top block first; inside a block, reverse order of use (the last-used gradients are final first).
  std::vector<std::size_t> order(sizes.size());
  for (std::size_t k = 0; k < order.size(); ++k) order[k] = order.size() - 1 - k;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return block_of(a) > block_of(b); });
  std::vector<BucketPlan> out;
  std::int64_t filled = 0;
  for (std::size_t k : order) {
    const std::int64_t bytes = sizes[k] * 4;
    if (out.empty() || out.back().block != block_of(k) || (!out.back().params.empty() && filled + bytes > cap_bytes)) {
      out.push_back({{}, block_of(k), 0});
      filled = 0;
    }
    out.back().params.push_back(k);
    out.back().numel += sizes[k];
    filled += bytes;
  }
  return out;
}

GradReducer::GradReducer(std::vector<NamedTensor> params_in_use_order, Communicator& comm, ReducerOptions options,
                         std::vector<int> blocks)
    : params_(std::move(params_in_use_order)), comm_(comm), options_(options) {
  std::set<const void*> seen;
  std::vector<std::int64_t> sizes;
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
    sizes.push_back(p.numel());
  }
  for (BucketPlan& plan : assign_buckets(sizes, blocks, options_.bucket_cap_bytes)) {
    Bucket b;
    std::int64_t off = 0;
    for (std::size_t k : plan.params) {
      b.offsets.push_back(off);
      off += params_[k].second.numel();
    }
    b.plan = std::move(plan);
    if (comm_.size() > 1) b.flat = at::zeros({off}, at::TensorOptions().dtype(at::kFloat).device(comm_.device()));
    buckets_.push_back(std::move(b));
  }
}

std::vector<std::string> GradReducer::bucket_param_names(std::size_t bucket) const {
  std::vector<std::string> out;
  for (std::size_t k : buckets_.at(bucket).plan.params) out.push_back(params_[k].first);
  return out;
}

std::int64_t GradReducer::bucket_bytes(std::size_t bucket) const { return buckets_.at(bucket).plan.numel * 4; }

// Copies the bucket's gradients in (zeros for a parameter without one) and starts its all-reduce.
// Buckets launch strictly in index order, so every rank issues the same collectives in the same order.
void GradReducer::launch(Bucket& b, std::size_t index) {
  at::NoGradGuard no_grad;
  for (std::size_t j = 0; j < b.plan.params.size(); ++j) {
    const at::Tensor& p = params_[b.plan.params[j]].second;
    at::Tensor dst = b.flat.narrow(0, b.offsets[j], p.numel()).view(p.sizes());
    if (p.grad().defined()) dst.copy_(p.grad());
    else dst.zero_();
  }
  std::ostringstream what;
  what << "gradient bucket " << index << " (block " << b.plan.block << ", " << b.plan.params.size() << " params from '"
       << params_[b.plan.params.front()].first << "')";
  b.handle = comm_.allreduce_async(b.flat, options_.op, what.str());
  b.launched = true;
}

void GradReducer::block_done(int block) {
  if (comm_.size() == 1) return;
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].plan.block >= block) {
    launch(buckets_[next_bucket_], next_bucket_);
    ++next_bucket_;
    ++launched_early_;
  }
}

void GradReducer::finalize() {
  at::NoGradGuard no_grad;
  if (comm_.size() == 1) {
    for (auto& [name, p] : params_)
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    return;
  }
  for (; next_bucket_ < buckets_.size(); ++next_bucket_) launch(buckets_[next_bucket_], next_bucket_);
  for (auto& b : buckets_) comm_.wait(b.handle);
  for (auto& b : buckets_) {
    for (std::size_t j = 0; j < b.plan.params.size(); ++j) {
      at::Tensor& p = params_[b.plan.params[j]].second;
      at::Tensor reduced = b.flat.narrow(0, b.offsets[j], p.numel()).view(p.sizes());
      if (p.grad().defined()) p.mutable_grad().copy_(reduced);
      else p.mutable_grad() = reduced.clone();
    }
    b.handle = 0;
    b.launched = false;
  }
  next_bucket_ = 0;
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


std::uint64_t checksum_bytes(const std::vector<HostBytes>& ranges) {
  std::uint64_t h = mix64(ranges.size());
  for (std::size_t r = 0; r < ranges.size(); ++r)
    h = mix64(h ^ hash_bytes(ranges[r].data, ranges[r].size, r + 1));
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

}  // namespace eo::ddp
