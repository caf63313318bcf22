// expert_offload_homes: per_numa_node. The frozen experts are identical on every rank, so one copy
// per NUMA node serves all its ranks: the node's leader creates one memory file (HostBuffer's
// shared mode), fills every block into it and shares it; the node's other ranks map it read-only.
#include <algorithm>

#include "common/text.h"
#include "offload/home_store.h"

namespace eo::offload {
namespace {

class NodeSharedHomes final : public HomeStore {
 public:
  NodeSharedHomes(const std::vector<ArenaExtent>& blocks, std::int64_t copy_bytes, const ArenaSource& source,
                  const HomeNode& node, bool pinned, const HomeSharing& sharing)
      : node_(node), leader_(sharing.leader) {
    const auto bytes = static_cast<std::size_t>(copy_bytes);
    if (leader_) shared_ = HostBuffer::create_shared(bytes, node);
    for (const ArenaExtent& b : blocks) {
      if (static_cast<std::size_t>(b.layer) >= offsets_.size()) offsets_.resize(static_cast<std::size_t>(b.layer) + 1, -1);
      offsets_[static_cast<std::size_t>(b.layer)] = b.offset;
      if (leader_) source.fill(b.layer, shared_->data() + b.offset);
      source.drop(b.layer);
      extents_.push_back(b);
      total_ += b.bytes;
    }
    // The leader's copy is complete: the other ranks of its node map it, then it stops sharing.
    const ShareHandle handle = sharing.exchange(leader_ ? shared_->share() : ShareHandle{});
    if (leader_) {
      if (pinned) shared_->pin(/*read_only=*/false);
    } else {
      shared_ = HostBuffer::open_shared(handle, bytes, pinned);
    }
    sharing.barrier();
    shared_->stop_sharing();
  }
  HomeKind kind() const override { return HomeKind::NodeShared; }
  const std::uint8_t* acquire(int layer) override { return shared_->data() + offsets_[static_cast<std::size_t>(layer)]; }
  void release(int, std::function<void()>) override {}
  bool pinned() const override { return shared_->pinned(); }
  std::int64_t host_ram_bytes() const override { return total_; }
  std::vector<int> page_nodes() const override { return shared_->resident_nodes(); }
  std::pair<std::uint64_t, std::uint64_t> file_id() const override { return shared_->file_id(); }
  std::vector<std::pair<const void*, std::size_t>> checked_ranges() const override {
    std::vector<std::pair<const void*, std::size_t>> out;
    for (const ArenaExtent& b : extents_) out.emplace_back(shared_->data() + b.offset, static_cast<std::size_t>(b.bytes));
    return out;
  }
  std::string describe(std::int64_t total_bytes) const override {
    return human_bytes(double(total_bytes)) + " in " + (pinned() ? "pinned" : "pageable") + " host homes (" + node_.reason + ")" +
           (leader_ ? ", created and shared with this node's ranks" : ", the node leader's copy mapped read-only");
  }

 private:
  HomeNode node_;
  bool leader_ = true;
  std::unique_ptr<HostBuffer> shared_;
  std::vector<std::int64_t> offsets_;  // by layer
  std::vector<ArenaExtent> extents_;
  std::int64_t total_ = 0;
};

}  // namespace

std::unique_ptr<HomeStore> make_node_shared_homes(const std::vector<ArenaExtent>& blocks, std::int64_t copy_bytes,
                                                  const ArenaSource& source, const HomeNode& node, bool pinned,
                                                  const HomeSharing& sharing) {
  return std::make_unique<NodeSharedHomes>(blocks, copy_bytes, source, node, pinned, sharing);
}

}  // namespace eo::offload
