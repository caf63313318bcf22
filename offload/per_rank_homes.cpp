// expert_offload_homes: per_rank. Each block's arena in an exact-size host buffer of this rank.
#include <algorithm>

#include "common/text.h"
#include "offload/home_store.h"

namespace eo::offload {
namespace {

class PerRankHomes final : public HomeStore {
 public:
  PerRankHomes(const std::vector<ArenaExtent>& blocks, const ArenaSource& source, const HomeNode& node, bool pinned)
      : node_(node) {
    // Layer by layer, dropping the checkpoint's tensors as each home fills.
    for (const ArenaExtent& b : blocks) {
      if (static_cast<std::size_t>(b.layer) >= homes_.size()) homes_.resize(static_cast<std::size_t>(b.layer) + 1);
      auto home = std::make_unique<HostBuffer>(static_cast<std::size_t>(b.bytes), node, pinned);
      source.fill(b.layer, home->data());
      source.drop(b.layer);
      homes_[static_cast<std::size_t>(b.layer)] = std::move(home);
      bytes_ += b.bytes;
    }
  }
  HomeKind kind() const override { return HomeKind::PerRank; }
  const std::uint8_t* acquire(int layer) override { return homes_[static_cast<std::size_t>(layer)]->data(); }
  void release(int, std::function<void()>) override {}
  bool pinned() const override {
    for (const auto& h : homes_)
      if (h) return h->pinned();
    return false;
  }
  std::int64_t host_ram_bytes() const override { return bytes_; }
  std::vector<int> page_nodes() const override {
    std::vector<int> out;
    for (const auto& h : homes_)
      if (h)
        for (int n : h->resident_nodes())
          if (std::find(out.begin(), out.end(), n) == out.end()) out.push_back(n);
    return out;
  }
  std::vector<std::pair<const void*, std::size_t>> checked_ranges() const override {
    std::vector<std::pair<const void*, std::size_t>> out;
    for (const auto& h : homes_)
      if (h) out.emplace_back(h->data(), h->size());
    return out;
  }
  std::string describe(std::int64_t total_bytes) const override {
    return human_bytes(double(total_bytes)) + " in " + (pinned() ? "pinned" : "pageable") + " host homes (" + node_.reason + ")";
  }

 private:
  HomeNode node_;
  std::vector<std::unique_ptr<HostBuffer>> homes_;  // by layer; null for dense layers
  std::int64_t bytes_ = 0;
};

}  // namespace

std::unique_ptr<HomeStore> make_per_rank_homes(const std::vector<ArenaExtent>& blocks, const ArenaSource& source,
                                               const HomeNode& node, bool pinned) {
  return std::make_unique<PerRankHomes>(blocks, source, node, pinned);
}

}  // namespace eo::offload
