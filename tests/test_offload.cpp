// The offload engine's state machine on the CPU build: homes, slots, staging order, prefetch,
// budget residency, and that only the staged block can be read.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "common/error.h"
#include "models/nf4.h"
#include "offload/engine.h"
#include "offload/homes.h"

using namespace eo;
using model::ExpertMatrix;

namespace {

// A bank with `layers` layers, dense (empty) at the given indexes, `experts` experts each.
model::ResidentWeights::Bank make_bank(int layers, int experts, std::vector<int> dense = {}, bool double_quant = false) {
  at::manual_seed(0);
  model::ResidentWeights::Bank bank(layers);
  for (int l = 0; l < layers; ++l) {
    if (std::find(dense.begin(), dense.end(), l) != dense.end()) continue;
    bank[l].resize(experts);
    for (int e = 0; e < experts; ++e) {
      bank[l][e][0] = nf4::quantize(at::randn({24, 64}), 64, double_quant);   // gate [I, H]
      bank[l][e][1] = nf4::quantize(at::randn({24, 64}), 64, double_quant);   // up
      bank[l][e][2] = nf4::quantize(at::randn({64, 24}), 64, double_quant);   // down [H, I]
    }
  }
  return bank;
}

// Dequantised reference values of every expert, taken before the bank is handed over.
std::vector<std::vector<std::array<at::Tensor, 3>>> reference(const model::ResidentWeights::Bank& bank) {
  std::vector<std::vector<std::array<at::Tensor, 3>>> out(bank.size());
  for (std::size_t l = 0; l < bank.size(); ++l)
    for (const auto& ex : bank[l]) out[l].push_back({nf4::dequantize(ex[0], at::kFloat), nf4::dequantize(ex[1], at::kFloat),
                                                     nf4::dequantize(ex[2], at::kFloat)});
  return out;
}

void expect_layer_readable(offload::ExpertOffloader& off, int layer, const std::vector<std::vector<std::array<at::Tensor, 3>>>& ref) {
  for (std::size_t e = 0; e < ref[layer].size(); ++e)
    for (int m = 0; m < 3; ++m)
      ASSERT_TRUE(at::equal(nf4::dequantize(off.expert_weight(layer, int(e), ExpertMatrix(m)), at::kFloat), ref[layer][e][m]))
          << "layer " << layer << " expert " << e << " matrix " << m;
}

// One micro-step as the checkpointed model drives it: forward 0..N-1, recompute N-1..0.
std::vector<int> micro_step_order(const std::vector<int>& moe) {
  std::vector<int> order(moe.begin(), moe.end());
  order.insert(order.end(), moe.rbegin(), moe.rend());
  return order;
}

}  // namespace

TEST(Offload, StagedBytesEqualTheBanksInEveryMode) {
  for (bool prefetch : {false, true})
    for (bool dq : {false, true}) {
      auto bank = make_bank(4, 3, {1}, dq);
      const auto ref = reference(bank);
      offload::OffloadOptions o;
      o.prefetch = prefetch;
      offload::ExpertOffloader off(std::move(bank), o);
      EXPECT_EQ(off.moe_layers(), (std::vector<int>{0, 2, 3}));
      EXPECT_EQ(off.num_slots(), prefetch ? 2 : 1);
      for (int l : micro_step_order(off.moe_layers())) {
        off.stage(l);
        expect_layer_readable(off, l, ref);
        // Never more blocks in slots than slots.
        EXPECT_LE(static_cast<int>(off.staged_layers().size()), off.num_slots());
      }
    }
}

TEST(Offload, CopiesPerMicroStepAndTheTurn) {
  const int n = 5;
  for (bool prefetch : {false, true}) {
    offload::OffloadOptions o;
    o.prefetch = prefetch;
    offload::ExpertOffloader off(make_bank(n, 2), o);
    for (int l : micro_step_order(off.moe_layers())) off.stage(l);
    auto s = off.take_step_stats();
    EXPECT_EQ(s.stage_calls, 2 * n);  // every block staged in forward and again in its recompute
    if (!prefetch) {
      // One slot: every stage copies, except the last forward block, reused at the turn.
      EXPECT_EQ(s.copies, 2 * n - 1);
      EXPECT_EQ(s.slot_hits, 1);
    } else {
      // Two slots: block n-2 is still in the second slot at the turn, so it is reused too; every
      // stage after the first finds its block already copied (prefetched).
      EXPECT_EQ(s.copies, 2 * n - 2);
      EXPECT_EQ(s.slot_hits, 2 * n - 1);
    }
    EXPECT_EQ(s.copied_bytes, s.copies * off.block_bytes(0));
    // The next micro-step starts where backward ended: block 0 (and with prefetch block 1) is
    // still in a slot.
    for (int l : micro_step_order(off.moe_layers())) off.stage(l);
    s = off.take_step_stats();
    EXPECT_EQ(s.copies, prefetch ? 2 * n - 4 : 2 * n - 2);
    for (int l = 0; l < n; ++l) EXPECT_EQ(off.stage_count(l), 4);
  }
}

TEST(Offload, OnlyTheStagedBlockCanBeRead) {
  offload::OffloadOptions o;
  o.prefetch = true;
  offload::ExpertOffloader off(make_bank(3, 2), o);
  off.stage(0);  // block 1 is being prefetched into the other slot, but is not staged
  EXPECT_NO_THROW(off.expert_weight(0, 1, ExpertMatrix::Down));
  EXPECT_THROW(off.expert_weight(1, 0, ExpertMatrix::Gate), eo::Error);
  EXPECT_THROW(off.expert_weight(2, 0, ExpertMatrix::Gate), eo::Error);
  EXPECT_THROW(off.stage(7), eo::Error);
}

TEST(Offload, BudgetResidentBlocksAreNeverCopied) {
  auto bank = make_bank(4, 2);
  const auto ref = reference(bank);
  offload::OffloadOptions probe;
  const std::int64_t block = offload::ExpertOffloader(make_bank(4, 2), probe).block_bytes(0);
  offload::OffloadOptions o;
  o.prefetch = true;
  o.vram_budget_bytes = 2 * block + block / 2;  // room for two blocks
  offload::ExpertOffloader off(std::move(bank), o);
  EXPECT_EQ(off.resident_layers(), (std::vector<int>{0, 1}));
  EXPECT_EQ(off.resident_bytes(), 2 * block);
  for (int l : micro_step_order(off.moe_layers())) {
    off.stage(l);
    expect_layer_readable(off, l, ref);
  }
  auto s = off.take_step_stats();
  EXPECT_EQ(s.resident_hits, 4);
  EXPECT_EQ(s.copies, 2);  // blocks 2 and 3 once each: the two streamed blocks fit the two slots
}

TEST(Offload, HomesAreExactSizeAndPlacedOnTheChosenNode) {
  auto& topo = offload::Topology::get();
  const auto node = offload::choose_home_node(topo, -1);
  EXPECT_FALSE(node.reason.empty());
  offload::HostBuffer buf(1 << 20, node, /*pinned=*/false);
  EXPECT_EQ(buf.size(), std::size_t(1) << 20);
  if (node.node >= 0) {
    const auto where = buf.resident_nodes();
    ASSERT_FALSE(where.empty()) << "hwloc_get_area_memlocation found no node";
    EXPECT_EQ(where, std::vector<int>{node.node});
  }
  offload::ExpertOffloader off(make_bank(2, 2), offload::OffloadOptions{});
  std::int64_t expect = 0;
  for (int l : off.moe_layers()) expect += off.block_bytes(l);
  EXPECT_EQ(off.home_bytes(), expect);
}

TEST(Offload, NodeChoiceOnASyntheticTwoNodeMachine) {
  // Two packages, one NUMA node each, two cores each: PUs 0-1 on node 0, 2-3 on node 1.
  auto topo = offload::Topology::synthetic("pack:2 numa:1 core:2 pu:1");
  EXPECT_EQ(topo->num_numa_nodes(), 2);
  EXPECT_EQ(offload::node_of_cpus(*topo, {0, 1}).node, 0);
  EXPECT_EQ(offload::node_of_cpus(*topo, {2}).node, 1);
  EXPECT_EQ(offload::node_of_cpus(*topo, {3}).node, 1);
  // A binding across both nodes takes the first and says so.
  const auto both = offload::node_of_cpus(*topo, {1, 2});
  EXPECT_EQ(both.node, 0);
  EXPECT_NE(both.reason.find("first of 2 nodes"), std::string::npos) << both.reason;
}
