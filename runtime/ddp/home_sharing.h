// The collectives behind homes that one rank makes for several (offload/home_store.h's
// HomeSharing): which ranks share one copy, and the exchange of the leader's share handle.
#pragma once

#include <ATen/core/Tensor.h>

#include "offload/home_store.h"

namespace eo::ddp {

class World;

// The ranks that share one copy of the homes: per_numa_node, same host and home NUMA node
// (by_numa_node); disk, same host (one file per host). Collective (every rank calls it).
struct HomeGroup {
  int leader = 0;          // lowest rank of the group
  int size = 1;            // ranks in the group
  int copies_on_host = 1;  // distinct groups on this rank's host
};
HomeGroup home_group(World& world, const at::Device& device, bool by_numa_node = true);

// HomeSharing over the World: every rank learns its group leader's (pid, memfd) from one
// allgather; a barrier once all have mapped. `world` must outlive the returned functions.
offload::HomeSharing make_home_sharing(World& world, const HomeGroup& group);

}  // namespace eo::ddp
