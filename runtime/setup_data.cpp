#include "runtime/setup_data.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "common/error.h"
#include "common/log.h"
#include "runtime/data/batcher.h"
#include "runtime/data/jsonl.h"
#include "runtime/data/tokens.h"
#include "runtime/ddp/world.h"
#include "runtime/optimizer.h"
#include "runtime/setup.h"

namespace eo {
namespace {

// One list of datasets (datasets or test_datasets) as one document source; token ids are checked
// against the vocabulary here, before training starts, with the file and line that is wrong. The
// axolotl formats are read from their prepared cache and, as axolotl does, a completion text is
// cut into sequence_len pieces while a longer row of the other formats is dropped (and counted).
std::shared_ptr<const data::DocumentSource> load_documents(const TrainConfig& cfg, const std::vector<DatasetSpec>& list,
                                                           std::int64_t vocab) {
  std::vector<std::shared_ptr<const data::DocumentSource>> parts;
  const std::size_t L = static_cast<std::size_t>(cfg.sequence_len);
  for (const auto& d : list) {
    if (d.type == "tokens") {
      parts.push_back(std::make_shared<data::TokenFileDocuments>(d.path, data::parse_token_dtype(d.dtype, d.path),
                                                                 d.eos_token_id, cfg.sequence_len, vocab));
      continue;
    }
    EO_CHECK(!d.formatted() || !d.prepared.empty(), "dataset ", d.path, " (type ", d.type, ") was not tokenised");
    std::vector<data::Example> examples;
    std::size_t rows = 0, dropped = 0;
    for (auto& line : data::read_tokenized_jsonl(d.formatted() ? d.prepared : d.path, vocab)) {
      ++rows;
      const std::size_t n = line.input_ids.size();
      if (d.formatted() && d.type != "completion" && n > L) {
        ++dropped;
        continue;
      }
      for (std::size_t at = 0; at < n; at += (d.type == "completion" ? L : n)) {
        const std::size_t e = d.type == "completion" ? std::min(n, at + L) : n;
        data::Example ex;
        ex.input_ids.assign(line.input_ids.begin() + at, line.input_ids.begin() + e);
        ex.labels.assign(line.labels.begin() + at, line.labels.begin() + e);
        examples.push_back(std::move(ex));
      }
    }
    if (dropped > 0)
      log::info("dataset " + d.path + ": " + std::to_string(dropped) + " of " + std::to_string(rows) +
                " rows are longer than sequence_len " + std::to_string(L) + " tokens and are dropped (as axolotl does)");
    if (examples.empty())
      throw UsageError("dataset " + d.path + ": every row is longer than sequence_len " + std::to_string(L) +
                       " tokens; raise sequence_len");
    // In a mix, a dataset that trains nothing would hide behind the others (the Batcher checks
    // the mix as a whole): each must have a target token (a label past its sequence's first).
    if (list.size() > 1 &&
        std::none_of(examples.begin(), examples.end(), [&](const data::Example& ex) {
          for (std::size_t t = 1; t < ex.labels.size() && t < L; ++t)
            if (ex.labels[t] != data::kIgnoreIndex) return true;
          return false;
        }))
      throw UsageError("dataset " + d.path + " (type " + d.type + ", one of " + std::to_string(list.size()) +
                       " in datasets) has no trainable token: every label is " + std::to_string(data::kIgnoreIndex) +
                       (d.formatted() ? " (roles_to_train / train_on_inputs / train_on_eos mark no token of it for training)"
                                      : "") + ". Fix its labels or remove it from the mix.");
    parts.push_back(std::make_shared<data::InMemoryDocuments>(std::move(examples), d.path));
  }
  if (parts.size() == 1) return parts[0];
  return std::make_shared<data::ConcatDocuments>(std::move(parts));
}

// val_set_size: a seeded shuffle of the training documents (epoch_permutation(n, seed, -1)); the
// last ones are held out. Both parts keep the documents' original order.
std::pair<std::shared_ptr<const data::DocumentSource>, std::shared_ptr<const data::DocumentSource>> split_documents(
    const std::shared_ptr<const data::DocumentSource>& docs, double val_set_size, std::int64_t seed) {
  const std::size_t n = docs->num_documents();
  const auto held = static_cast<std::size_t>(val_set_size < 1 ? std::ceil(val_set_size * double(n)) : val_set_size);
  if (held == 0 || held >= n)
    throw UsageError("val_set_size " + std::to_string(val_set_size) + " holds out " + std::to_string(held) + " of " +
                     std::to_string(n) + " documents; it must leave at least one for training and one for evaluation");
  const std::vector<std::size_t> perm = data::epoch_permutation(n, seed, -1);
  std::vector<std::size_t> train(perm.begin(), perm.end() - static_cast<std::ptrdiff_t>(held));
  std::vector<std::size_t> eval(perm.end() - static_cast<std::ptrdiff_t>(held), perm.end());
  std::sort(train.begin(), train.end());
  std::sort(eval.begin(), eval.end());
  return {std::make_shared<data::SubsetDocuments>(docs, std::move(train), docs->name()),
          std::make_shared<data::SubsetDocuments>(docs, std::move(eval), docs->name() + " (val_set_size)")};
}

}  // namespace

void load_run_data(const TrainConfig& cfg, Run& run, const ddp::WorldInfo& wi) {
  const std::int64_t vocab = run.spec.model.vocab;
  auto docs = load_documents(cfg, cfg.datasets, vocab);
  std::shared_ptr<const data::DocumentSource> eval_docs;
  if (cfg.val_set_size) std::tie(docs, eval_docs) = split_documents(docs, *cfg.val_set_size, cfg.seed);
  if (!cfg.test_datasets.empty()) eval_docs = load_documents(cfg, cfg.test_datasets, vocab);
  if (eval_docs) {
    data::BatcherOptions eo;
    eo.sequence_len = cfg.sequence_len;
    eo.sample_packing = cfg.eval_sample_packing.value_or(cfg.sample_packing);
    eo.shuffle = false;
    run.eval_rows = std::make_unique<data::Batcher>(eval_docs, eo);
    log::info("evaluation: " + std::to_string(eval_docs->num_documents()) + " documents -> " +
              std::to_string(run.eval_rows->num_sequences()) + " sequences of " + std::to_string(cfg.sequence_len) +
              " tokens (" + eval_docs->name() + ")");
  }
  data::BatcherOptions bo;
  bo.sequence_len = cfg.sequence_len;
  bo.sample_packing = cfg.sample_packing;
  bo.micro_batch_size = cfg.micro_batch_size;
  bo.seed = cfg.seed;
  bo.rank = wi.rank;
  bo.world_size = wi.world_size;
  run.batcher = std::make_unique<data::Batcher>(docs, bo);
  data::Batcher& batcher = *run.batcher;
  const std::int64_t per_epoch = batcher.num_batches_per_epoch();
  const std::int64_t accum = run.spec.accum;
  if (per_epoch < accum)  // one optimizer step would see some sequences twice
    throw UsageError("dataset " + docs->name() + " has " + std::to_string(batcher.num_sequences()) + " sequences of " +
                     std::to_string(cfg.sequence_len) + " tokens; one optimizer step needs " +
                     std::to_string(cfg.micro_batch_size * accum * wi.world_size) + " (micro_batch_size " +
                     std::to_string(cfg.micro_batch_size) + " x gradient_accumulation_steps " + std::to_string(accum) + " x " +
                     std::to_string(wi.world_size) + " ranks). Add data or lower micro_batch_size, gradient_accumulation_steps "
                     "or the number of ranks.");
  const std::int64_t total_steps = run.total_steps =
      cfg.max_steps ? *cfg.max_steps
                    : std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(cfg.num_epochs * double(per_epoch) / double(accum))));
  run.warmup = resolve_warmup_steps(cfg, total_steps);
  log::info("data: " + std::to_string(docs->num_documents()) + " documents -> " + std::to_string(batcher.num_sequences()) +
            " sequences of " + std::to_string(cfg.sequence_len) + " tokens; " + std::to_string(per_epoch) +
            " micro-batches per epoch; " + std::to_string(total_steps) + " optimizer steps");

}

}  // namespace eo
