// The offload engine's state machine on the CPU build: homes, slots, staging order, prefetch (one
// and more blocks ahead), budget residency, and that only the staged block can be read. The
// state-machine tests run twice: homes in host RAM, and homes on the drive (expert_offload_homes:
// disk) read through the ring, which must change nothing but where the bytes come from.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include <ATen/ATen.h>

#include "common/files.h"
#include "common/error.h"
#include "models/nf4.h"
#include "offload/disk_homes.h"
#include "offload/engine.h"
#include "offload/homes.h"
#include "offload/staging.h"

using namespace eo;
using model::ExpertMatrix;

namespace {

// Where a test's engines keep their homes: host RAM, or a file in a folder of this process
// (removed when the test ends).
enum class Homes { Memory, Disk };
const char* name_of(Homes h) { return h == Homes::Memory ? "homes in RAM" : "homes on disk"; }
struct DiskFolder {
  std::filesystem::path dir = std::filesystem::temp_directory_path() / ("eo-offload-disk-" + std::to_string(::getpid()));
  DiskFolder() { eo::remove_tree(dir); }
  ~DiskFolder() { eo::remove_tree(dir); }
};
offload::OffloadOptions with_homes(offload::OffloadOptions o, Homes h, const DiskFolder& folder) {
  if (h == Homes::Disk) {
    o.disk = offload::DiskHomesOptions{};
    o.disk->dir = folder.dir.string();
    o.disk->identity = {{"test", "offload"}};
  }
  return o;
}
constexpr Homes kAllHomes[] = {Homes::Memory, Homes::Disk};

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
    for (const auto& ex : bank[l]) out[l].push_back({eo::dequantize(ex[0], at::kFloat), eo::dequantize(ex[1], at::kFloat),
                                                     eo::dequantize(ex[2], at::kFloat)});
  return out;
}

void expect_layer_readable(offload::ExpertOffloader& off, int layer, const std::vector<std::vector<std::array<at::Tensor, 3>>>& ref) {
  for (std::size_t e = 0; e < ref[layer].size(); ++e)
    for (int m = 0; m < 3; ++m)
      ASSERT_TRUE(at::equal(eo::dequantize(off.expert_weight(layer, int(e), ExpertMatrix(m)), at::kFloat), ref[layer][e][m]))
          << "layer " << layer << " expert " << e << " matrix " << m;
}

// One micro-step of the micro-batch-major order with checkpointing: forward 0..N-1, recompute
// N-1..0 (the top block staged twice: the engine must take a repeated block as a hit). The engine
// is handed it as its schedule (set_schedule), as the trainer hands over the step's staging order.
std::vector<int> micro_step_order(const std::vector<int>& moe) {
  std::vector<int> order(moe.begin(), moe.end());
  order.insert(order.end(), moe.rbegin(), moe.rend());
  return order;
}

// The blocks the lookahead must hold after call `i` of `calls`: the block just staged (if streamed)
// and the next `depth` distinct streamed blocks that the call sequence itself stages after it —
// read off the literal sequence, not walked like the engine does.
std::vector<int> expected_in_slots(const std::vector<int>& calls, std::size_t i, int depth, const std::vector<int>& resident) {
  auto is_resident = [&](int l) { return std::find(resident.begin(), resident.end(), l) != resident.end(); };
  std::vector<int> out;
  if (!is_resident(calls[i])) out.push_back(calls[i]);
  std::vector<int> ahead;
  for (std::size_t j = i + 1; j < calls.size() && static_cast<int>(ahead.size()) < depth; ++j)
    if (calls[j] != calls[i] && !is_resident(calls[j]) && std::find(ahead.begin(), ahead.end(), calls[j]) == ahead.end())
      ahead.push_back(calls[j]);
  out.insert(out.end(), ahead.begin(), ahead.end());
  std::sort(out.begin(), out.end());
  return out;
}

// Drives `steps` micro-steps through `off`, checking after every stage that the staged block reads
// back exactly and that the slots hold what expected_in_slots() says; returns each step's stats.
std::vector<offload::OffloadStats> run_steps(offload::ExpertOffloader& off, int steps, int depth,
                                             const std::vector<std::vector<std::array<at::Tensor, 3>>>& ref,
                                             std::vector<int> one = {}) {
  if (one.empty()) one = micro_step_order(off.moe_layers());
  off.set_schedule(one);
  std::vector<int> calls;
  for (int k = 0; k < steps + 1; ++k)  // one step more, so the last stages have a future to check
    calls.insert(calls.end(), one.begin(), one.end());
  const std::size_t per_step = calls.size() / (steps + 1);
  std::vector<offload::OffloadStats> out;
  for (std::size_t i = 0; i < per_step * steps; ++i) {
    off.stage(calls[i]);
    expect_layer_readable(off, calls[i], ref);
    auto staged = off.staged_layers();
    std::sort(staged.begin(), staged.end());
    auto want = expected_in_slots(calls, i, depth, off.resident_layers());
    // The slots may hold more (an old block not yet evicted), never less.
    for (int l : want)
      EXPECT_NE(std::find(staged.begin(), staged.end(), l), staged.end())
          << "call " << i << " (stage " << calls[i] << "): block " << l << " should be in a slot";
    for (int l : off.resident_layers())
      EXPECT_EQ(std::find(staged.begin(), staged.end(), l), staged.end()) << "resident block " << l << " was copied";
    if ((i + 1) % per_step == 0) out.push_back(off.take_step_stats());
  }
  // Disk homes: every block a copy took was read ahead along the schedule, none on demand.
  if (off.homes_on_disk())
    for (const auto& st : out) EXPECT_EQ(st.disk_unplanned, 0) << "a copy's block was not read ahead";
  return out;
}

}  // namespace

TEST(Offload, StagedBytesEqualTheBanksInEveryMode) {
  for (Homes homes : kAllHomes) {
    SCOPED_TRACE(name_of(homes));
    DiskFolder folder;
    for (bool prefetch : {false, true})
      for (bool dq : {false, true}) {
        auto bank = make_bank(4, 3, {1}, dq);
        const auto ref = reference(bank);
        offload::OffloadOptions o;
        o.prefetch = prefetch;
        offload::ExpertOffloader off(std::move(bank), with_homes(o, homes, folder));
        off.set_schedule(micro_step_order(off.moe_layers()));
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
}

TEST(Offload, CopiesPerMicroStepAndTheTurn) {
  for (Homes homes : kAllHomes) {
    SCOPED_TRACE(name_of(homes));
    DiskFolder folder;
    const int n = 5;
    for (bool prefetch : {false, true}) {
      offload::OffloadOptions o;
      o.prefetch = prefetch;
      offload::ExpertOffloader off(make_bank(n, 2), with_homes(o, homes, folder));
      off.set_schedule(micro_step_order(off.moe_layers()));
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
}

// Deeper prefetch, S = 1 + depth slots (S <= N). The lookahead copies every block once on its way
// into the slots, and a block is copied again only if it was evicted since it was last staged:
//  - forward, first step: all N blocks are copied (N copies). After stage(N-1) the slots hold the
//    last S blocks N-S..N-1, which are exactly the current one and the next S-1 = depth the
//    recompute needs (N-1 again at the turn, then N-2, ...), so nothing is evicted there;
//  - recompute N-1..0: N-S..N-1 are hit, the other N-S blocks are copied (N-S copies). Step 1:
//    2N - S copies. At the end the slots hold 0..S-1;
//  - the next step's forward starts with block 0 again (the turn) and finds 0..S-1 in the slots:
//    N-S copies; its recompute: N-S again. Every later step: 2N - 2S copies.
// S = 1 (synchronous) gives 2N-1 / 2N-2 and S = 2 gives 2N-2 / 2N-4, the counts of the test above.
// Only the very first stage() misses: every other one finds its block already in a slot.
TEST(Offload, DeeperPrefetchCopiesEachBlockOncePerPassOutsideTheTurns) {
  for (Homes homes : kAllHomes) {
    SCOPED_TRACE(name_of(homes));
    DiskFolder folder;
    const int n = 6;
    for (int depth : {2, 3}) {
      auto bank = make_bank(n, 2);
      const auto ref = reference(bank);
      offload::OffloadOptions o;
      o.prefetch = true;
      o.prefetch_depth = depth;
      offload::ExpertOffloader off(std::move(bank), with_homes(o, homes, folder));
      const int slots = 1 + depth;
      ASSERT_EQ(off.num_slots(), slots);
      const auto steps = run_steps(off, 3, depth, ref);
      SCOPED_TRACE("depth " + std::to_string(depth));
      EXPECT_EQ(steps[0].copies, 2 * n - slots);  // depth 2: 9, depth 3: 8
      EXPECT_EQ(steps[0].slot_hits, 2 * n - 1);
      for (int k : {1, 2}) {
        EXPECT_EQ(steps[k].copies, 2 * n - 2 * slots);  // depth 2: 6, depth 3: 4
        EXPECT_EQ(steps[k].slot_hits, 2 * n);
        EXPECT_EQ(steps[k].stage_calls, 2 * n);
        EXPECT_EQ(steps[k].copied_bytes, steps[k].copies * off.block_bytes(0));
      }
    }
  }
}

// Depth 1 (two slots) through the same checks: the slots hold the staged block and the next one.
TEST(Offload, DepthOneHoldsTheNextBlock) {
  for (Homes homes : kAllHomes) {
    SCOPED_TRACE(name_of(homes));
    DiskFolder folder;
    const int n = 5;
    auto bank = make_bank(n, 2);
    const auto ref = reference(bank);
    offload::OffloadOptions o;
    o.prefetch = true;
    offload::ExpertOffloader off(std::move(bank), with_homes(o, homes, folder));
    ASSERT_EQ(off.num_slots(), 2);
    const auto steps = run_steps(off, 2, 1, ref);
    EXPECT_EQ(steps[0].copies, 2 * n - 2);
    EXPECT_EQ(steps[1].copies, 2 * n - 4);
  }
}

// More depth than blocks: the slots are capped at the streamed blocks, each is copied once, and
// from then on every block stays in its slot.
TEST(Offload, DepthBeyondTheBlocksKeepsThemAll) {
  for (Homes homes : kAllHomes) {
    SCOPED_TRACE(name_of(homes));
    DiskFolder folder;
    auto bank = make_bank(3, 2);
    const auto ref = reference(bank);
    offload::OffloadOptions o;
    o.prefetch = true;
    o.prefetch_depth = 8;
    offload::ExpertOffloader off(std::move(bank), with_homes(o, homes, folder));
    EXPECT_EQ(off.num_slots(), 3);
    const auto steps = run_steps(off, 2, 8, ref);
    EXPECT_EQ(steps[0].copies, 3);
    EXPECT_EQ(steps[1].copies, 0);
  }
}

// Budget-resident blocks are skipped by the lookahead: with blocks 0 and 1 resident, staging block 0
// prefetches 2 and 3 (not 1), and at the recompute's end (block 2, then resident 1 and 0) the
// lookahead turns and looks at 3, 4 for the next forward. M = 4 streamed blocks, S = 3 slots: the
// formula above with N -> M gives 2M - S = 5 copies on the first step, 2M - 2S = 2 after.
TEST(Offload, DeeperPrefetchSkipsBudgetResidentBlocks) {
  for (Homes homes : kAllHomes) {
    SCOPED_TRACE(name_of(homes));
    DiskFolder folder;
    auto bank = make_bank(6, 2);
    const auto ref = reference(bank);
    const std::int64_t block = offload::ExpertOffloader(make_bank(6, 2), offload::OffloadOptions{}).block_bytes(0);
    offload::OffloadOptions o;
    o.prefetch = true;
    o.prefetch_depth = 2;
    o.vram_budget_bytes = 2 * block + block / 2;  // room for two blocks
    offload::ExpertOffloader off(std::move(bank), with_homes(o, homes, folder));
    ASSERT_EQ(off.resident_layers(), (std::vector<int>{0, 1}));
    ASSERT_EQ(off.num_slots(), 3);
    // run_steps checks after every stage that the slots hold the next two streamed blocks (after
    // stage(0): 2 and 3) and never a resident one.
    const auto steps = run_steps(off, 3, 2, ref);
    EXPECT_EQ(steps[0].copies, 5);
    EXPECT_EQ(steps[0].resident_hits, 4);
    for (int k : {1, 2}) {
      EXPECT_EQ(steps[k].copies, 2);
      EXPECT_EQ(steps[k].resident_hits, 4);
    }
  }
}

// Any schedule is followed exactly, not only forward/backward sweeps: after every stage the slots
// hold the next `depth` blocks the schedule stages (run_steps checks it against the literal list),
// and a stage() out of the schedule is refused instead of guessed at.
TEST(Offload, AnyScheduleIsFollowedExactly) {
  for (Homes homes : kAllHomes) {
    SCOPED_TRACE(name_of(homes));
    DiskFolder folder;
    auto bank = make_bank(6, 2);
    const auto ref = reference(bank);
    offload::OffloadOptions o;
    o.prefetch = true;
    o.prefetch_depth = 2;
    offload::ExpertOffloader off(std::move(bank), with_homes(o, homes, folder));
    const auto steps = run_steps(off, 3, 2, ref, {0, 2, 4, 1, 3, 5, 5, 3, 1});
    for (const auto& st : steps) EXPECT_EQ(st.stage_calls, 9);
    off.set_schedule({0, 1, 2});
    off.stage(0);
    EXPECT_THROW(off.stage(2), eo::Error);
  }
}

// Without a schedule (scoring), every block not in a slot is copied when staged; nothing ahead.
TEST(Offload, UnscheduledStagingCopiesOnDemand) {
  for (Homes homes : kAllHomes) {
    SCOPED_TRACE(name_of(homes));
    DiskFolder folder;
    auto bank = make_bank(4, 2);
    const auto ref = reference(bank);
    offload::OffloadOptions o;
    o.prefetch = true;
    offload::ExpertOffloader off(std::move(bank), with_homes(o, homes, folder));
    const std::vector<int> calls{0, 1, 2, 3, 3, 0};
    for (std::size_t k = 0; k < calls.size(); ++k) {
      off.stage(calls[k]);
      expect_layer_readable(off, calls[k], ref);
      EXPECT_EQ(off.staged_layers().size(), std::min<std::size_t>(k + 1, 2)) << "nothing is prefetched";
    }
    const auto st = off.take_step_stats();
    EXPECT_EQ(st.copies, 5);  // 0, 1, 2, 3, then 0 again (evicted); 3 is a hit
  }
}

TEST(Offload, OnlyTheStagedBlockCanBeRead) {
  for (Homes homes : kAllHomes) {
    SCOPED_TRACE(name_of(homes));
    DiskFolder folder;
    offload::OffloadOptions o;
    o.prefetch = true;
    offload::ExpertOffloader off(make_bank(3, 2), with_homes(o, homes, folder));
    off.set_schedule({0, 1, 2, 1});
    off.stage(0);  // block 1 is being prefetched into the other slot, but is not staged
    EXPECT_NO_THROW(off.expert_weight(0, 1, ExpertMatrix::Down));
    EXPECT_THROW(off.expert_weight(1, 0, ExpertMatrix::Gate), eo::Error);
    EXPECT_THROW(off.expert_weight(2, 0, ExpertMatrix::Gate), eo::Error);
    EXPECT_THROW(off.stage(7), eo::Error);
  }
}

TEST(Offload, BudgetResidentBlocksAreNeverCopied) {
  for (Homes homes : kAllHomes) {
    SCOPED_TRACE(name_of(homes));
    DiskFolder folder;
    auto bank = make_bank(4, 2);
    const auto ref = reference(bank);
    offload::OffloadOptions probe;
    const std::int64_t block = offload::ExpertOffloader(make_bank(4, 2), probe).block_bytes(0);
    offload::OffloadOptions o;
    o.prefetch = true;
    o.vram_budget_bytes = 2 * block + block / 2;  // room for two blocks
    offload::ExpertOffloader off(std::move(bank), with_homes(o, homes, folder));
    EXPECT_EQ(off.resident_layers(), (std::vector<int>{0, 1}));
    EXPECT_EQ(off.resident_bytes(), 2 * block);
    off.set_schedule(micro_step_order(off.moe_layers()));
    for (int l : micro_step_order(off.moe_layers())) {
      off.stage(l);
      expect_layer_readable(off, l, ref);
    }
    auto s = off.take_step_stats();
    EXPECT_EQ(s.resident_hits, 4);
    EXPECT_EQ(s.copies, 2);  // blocks 2 and 3 once each: the two streamed blocks fit the two slots
  }
}

// Disk homes keep only the read ring in host RAM, and the ring reads each copy's block ahead of
// it: over three steps the blocks read are the blocks copied, less those still in the ring from
// an earlier copy (plus at most a ring's worth read ahead for the next step), none on demand. A second engine over the same experts reuses the
// file; one over other experts rebuilds it, and each reads back its own bytes.
TEST(Offload, DiskHomesHoldOnlyTheRingInRamAndReadEveryCopyAhead) {
  DiskFolder folder;
  const int n = 6;
  auto bank = make_bank(n, 2);
  const auto ref = reference(bank);
  offload::OffloadOptions o;
  o.prefetch = true;
  offload::ExpertOffloader off(std::move(bank), with_homes(o, Homes::Disk, folder));
  ASSERT_TRUE(off.homes_on_disk());
  EXPECT_EQ(off.disk_ring_size(), offload::disk_ring_buffers(2));
  const std::int64_t padded = (off.block_bytes(0) + 4095) / 4096 * 4096;
  EXPECT_EQ(off.host_ram_bytes(), off.disk_ring_size() * padded);
  EXPECT_EQ(off.home_bytes(), n * off.block_bytes(0));
  EXPECT_LT(off.host_ram_bytes(), off.home_bytes());
  const auto steps = run_steps(off, 3, 1, ref);
  std::int64_t reads = 0, copies = 0, hits = 0;
  for (const auto& st : steps) {
    reads += st.disk_reads;
    copies += st.copies;
    hits += st.disk_ring_hits;
    EXPECT_EQ(st.disk_unplanned, 0);
  }
  EXPECT_EQ(copies, (2 * n - 2) + 2 * (2 * n - 4));
  // Every copy read its block from the drive, or found it still in the ring from an earlier copy;
  // beyond that the ring may have read up to its size ahead into the next step.
  EXPECT_GE(reads, copies - hits);
  EXPECT_LE(reads, copies - hits + off.disk_ring_size());
  EXPECT_LT(hits, copies);
  const auto file = std::filesystem::path(off.disk_file());
  const auto written = std::filesystem::last_write_time(file);

  offload::ExpertOffloader again(make_bank(n, 2), with_homes(o, Homes::Disk, folder));
  EXPECT_EQ(std::filesystem::last_write_time(file), written) << "the same experts: the file is reused, not rewritten";
  run_steps(again, 1, 1, ref);

  at::manual_seed(99);
  model::ResidentWeights::Bank other(n);
  for (auto& l : other) {
    l.resize(2);
    for (auto& e : l) e = {nf4::quantize(at::randn({24, 64}), 64, false), nf4::quantize(at::randn({24, 64}), 64, false),
                           nf4::quantize(at::randn({64, 24}), 64, false)};
  }
  const auto other_ref = reference(other);
  offload::ExpertOffloader rebuilt(std::move(other), with_homes(o, Homes::Disk, folder));
  run_steps(rebuilt, 1, 1, other_ref);
}

// Disk homes with several ranks on a host: only the leader writes. A follower (HomeSharing with
// leader = false; the collectives stubbed, as the trainer's would return once the leader is done)
// never creates or changes the file: without one it stops with a message naming the leader's
// file; with the leader's file it opens it as it is.
TEST(Offload, DiskHomesFollowersNeverWriteTheFile) {
  DiskFolder folder;
  offload::OffloadOptions o = with_homes(offload::OffloadOptions{}, Homes::Disk, folder);
  offload::HomeSharing follower;
  follower.leader = false;
  int exchanges = 0, barriers = 0;
  follower.exchange = [&](const offload::ShareHandle& mine) {
    EXPECT_EQ(mine.fd, -1) << "disk homes share no memory file";
    ++exchanges;
    return offload::ShareHandle{};
  };
  follower.barrier = [&] { ++barriers; };
  o.sharing = follower;
  const std::string file = offload::disk_homes_path(folder.dir.string());
  try {
    offload::ExpertOffloader off(make_bank(3, 2), o);
    ADD_FAILURE() << "a follower started without its leader's file";
  } catch (const eo::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the homes file " + file + " that this host's leader rank wrote does not match this "
                                         "rank's experts: no homes file yet"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(file)) << "a follower wrote the homes file";
  EXPECT_EQ(exchanges, 1);

  // The leader writes; then a follower opens the same file, unchanged.
  offload::OffloadOptions lo = with_homes(offload::OffloadOptions{}, Homes::Disk, folder);
  { offload::ExpertOffloader leader(make_bank(3, 2), lo); }
  const auto written = std::filesystem::last_write_time(file);
  auto bank = make_bank(3, 2);
  const auto ref = reference(bank);
  offload::ExpertOffloader off(std::move(bank), o);
  EXPECT_EQ(std::filesystem::last_write_time(file), written);
  EXPECT_EQ(exchanges, 2);
  EXPECT_EQ(barriers, 1);
  run_steps(off, 1, 1, ref);
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
