// Evaluation: the mean next-token loss over held-out rows (val_set_size or test_datasets), as
// `eo-ddp score` computes it on the same rows: summed shifted cross entropy over every counted
// token, divided by the number of counted tokens (token-weighted, not a mean of row means).
//
// The rows are the eval Batcher's packing plan, unshuffled. Rank r evaluates rows r, r + W,
// r + 2W, ... (W ranks), eval_batch_size rows per forward, without a graph; the caller sums
// (loss_sum, tokens) over ranks, so every row counts exactly once whatever W is.
#pragma once

#include <cstdint>
#include <string>

namespace eo {

namespace data {
class Batcher;
}
namespace model {
class MoeModel;
}

struct EvalSums {
  double loss_sum = 0;
  std::int64_t tokens = 0;
};

// This rank's share. Stages MoE blocks in layer order; the caller clears and restores the
// offloader's step schedule around it.
EvalSums evaluate_rows(model::MoeModel& model, const data::Batcher& rows, int rank, int world_size, int batch_size);

// Every eval row's documents (segments) as tokenized JSONL, one per line: the file
// `eo-ddp score --data` gives the same loss for.
void write_eval_rows(const data::Batcher& rows, const std::string& path);

}  // namespace eo
