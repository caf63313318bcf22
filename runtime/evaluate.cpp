#include "runtime/evaluate.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <nlohmann/json.hpp>

#include "common/files.h"
#include "models/moe_model.h"
#include "runtime/data/batcher.h"

namespace eo {

EvalSums evaluate_rows(model::MoeModel& model, const data::Batcher& rows, int rank, int world_size, int batch_size) {
  c10::NoGradGuard no_grad;
  const at::Device device = model.options().device;
  EvalSums out;
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  std::vector<data::MicroBatch> group;
  auto run = [&] {
    if (group.empty()) return;
    std::vector<at::Tensor> ids, labels, positions, segments;
    for (const auto& g : group) {
      ids.push_back(g.input_ids);
      labels.push_back(g.labels);
      positions.push_back(g.position_ids);
      segments.push_back(g.segment_ids);
    }
    model::Batch b;
    const at::Tensor host_ids = at::cat(ids);
    b.input_ids = host_ids.to(device);
    b.positions = at::cat(positions).to(device);
    b.segment_ids = at::cat(segments).to(device, at::kLong);  // padding and packed rows: always masked
    const model::BlockContext ctx = model.context(b, /*training=*/false);
    at::Tensor h = model.embed(host_ids);  // host ids: the table may be host-held
    for (int i = 0; i < model.num_layers(); ++i) {
      const auto& block = model.block(i);
      if (block.is_moe()) model.weight_provider().stage(i);
      h = block.forward(h, ctx);
    }
    loss_sum += model.loss_sum(h, at::cat(labels).to(device)).to(at::kDouble);
    for (const auto& g : group) out.tokens += g.num_target_tokens;
    group.clear();
  };
  for (std::int64_t r = rank; r < rows.num_sequences(); r += world_size) {
    group.push_back(rows.sequence(static_cast<std::size_t>(r)));
    if (static_cast<int>(group.size()) == batch_size) run();
  }
  run();
  out.loss_sum = loss_sum.item<double>();
  return out;
}

void write_eval_rows(const data::Batcher& rows, const std::string& path) {
  std::string text;
  for (std::int64_t r = 0; r < rows.num_sequences(); ++r) {
    const data::MicroBatch row = rows.sequence(static_cast<std::size_t>(r));
    const auto ids = row.input_ids.contiguous();
    const auto labels = row.labels.contiguous();
    const auto seg = row.segment_ids.contiguous();
    const std::int64_t L = ids.size(1);
    const auto* pi = ids.data_ptr<std::int64_t>();
    const auto* pl = labels.data_ptr<std::int64_t>();
    const auto* ps = seg.data_ptr<std::int32_t>();
    for (std::int64_t t = 0; t < L;) {
      if (ps[t] == 0) {  // padding
        ++t;
        continue;
      }
      std::int64_t e = t;
      while (e < L && ps[e] == ps[t]) ++e;
      nlohmann::json j = {{"input_ids", std::vector<std::int64_t>(pi + t, pi + e)},
                          {"labels", std::vector<std::int64_t>(pl + t, pl + e)}};
      text += j.dump() + "\n";
      t = e;
    }
  }
  write_file_atomic(path, text);
}

}  // namespace eo
