// Every rank of a job must train the same run. Before anything is loaded, the ranks compare the
// resolved config key by key (every key, defaults filled in) and the base model's identity; a
// difference stops every rank with a UsageError (exit 2) naming the keys, the ranks and their
// values. Without this, ranks with different LoRA shapes corrupted the collectives' buffers, and
// ranks with a different seed or micro-batch silently trained on overlapping shards.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "runtime/config.h"

namespace eo {
namespace ddp {
class World;
}

// The resolved config as dotted key -> value (datasets.0.type, ...), plus "base model contents"
// and "datasets.N contents" (the paths are left out: a copy in another folder on another node is
// the same model or data, and one path may hold different data on different nodes).
std::map<std::string, std::string> run_identity(const TrainConfig& cfg);

// The keys whose values differ between ranks (rank r's identity is per_rank[r]), each as
// "key: rank 0 has V0, rank 2 has V2"; empty when all agree.
std::vector<std::string> rank_disagreements(const std::vector<std::map<std::string, std::string>>& per_rank);

// Gathers every rank's run_identity and throws UsageError listing rank_disagreements. World of one: no-op.
void check_ranks_agree(const TrainConfig& cfg, const ddp::World& world);

}  // namespace eo
