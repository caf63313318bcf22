#include "runtime/ddp/home_sharing.h"

#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "offload/homes.h"
#include "runtime/ddp/world.h"

namespace eo::ddp {

HomeGroup home_group(World& world, const at::Device& device, bool by_numa_node) {
  std::string mine = world.info().hostname;
  if (by_numa_node) {
    const offload::HomeNode node = offload::choose_home_node(offload::Topology::get(), device.is_cuda() ? device.index() : -1);
    mine += "/numa" + std::to_string(node.node);
  }
  const std::vector<std::string> all = world.allgather(mine);
  HomeGroup g;
  g.leader = -1;
  g.size = 0;
  std::set<std::string> on_host;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (all[r] == mine) {
      if (g.leader < 0) g.leader = r;
      ++g.size;
    }
    if (all[r].substr(0, all[r].find('/')) == world.info().hostname) on_host.insert(all[r]);
  }
  g.copies_on_host = static_cast<int>(on_host.size());
  return g;
}

offload::HomeSharing make_home_sharing(World& world, const HomeGroup& group) {
  offload::HomeSharing s;
  s.leader = world.rank() == group.leader;
  const int leader = group.leader;
  s.exchange = [&world, leader](const offload::ShareHandle& mine) {
    const auto all = world.allgather(std::to_string(mine.pid) + " " + std::to_string(mine.fd));
    offload::ShareHandle h;
    std::istringstream in(all.at(static_cast<std::size_t>(leader)));
    in >> h.pid >> h.fd;
    return h;
  };
  s.barrier = [&world] { world.barrier(); };
  return s;
}

}  // namespace eo::ddp
