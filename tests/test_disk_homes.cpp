// Disk homes (expert_offload_homes: disk), below the engine: the file (layout, header, atomic
// write), every way a file can fail to match and the reason given, a full drive while writing,
// and the read ring (reads ahead along the plan, never holds more than its buffers, the bytes
// equal the file's, buffered reads where O_DIRECT is refused, corruption caught at every read).
// The file's bytes are read back here with plain stdio, not with the code under test.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <map>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/checksum.h"
#include "common/error.h"
#include "common/fault_seam.h"
#include "offload/disk_homes.h"
#include "offload/staging.h"
#include "tests/temp_dir_test.h"

namespace fs = std::filesystem;
using namespace eo;
using offload::DiskBlock;
using offload::DiskHomesHeader;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

class DiskHomesTest : public eo::testing::TempDirTest {
 protected:
  DiskHomesTest() : TempDirTest("eo_disk_homes_") {}
  void TearDown() override {
    faults::install({});
    TempDirTest::TearDown();
  }

  // Blocks of odd sizes (not multiples of 4096) at layers 0, 2, 3, 5, 6 with random bytes.
  void make_blocks() {
    std::mt19937 rng(7);
    const std::vector<std::pair<int, std::int64_t>> shape{{0, 10000}, {2, 4096}, {3, 70001}, {5, 12345}, {6, 3}};
    for (const auto& [layer, bytes] : shape) {
      std::vector<std::uint8_t> data(static_cast<std::size_t>(bytes));
      for (auto& b : data) b = static_cast<std::uint8_t>(rng());
      DiskBlock d;
      d.layer = layer;
      d.bytes = bytes;
      d.checksum = offload::arena_checksum(data.data(), bytes);
      header_.blocks.push_back(d);
      data_[layer] = std::move(data);
    }
    header_.identity = {{"base_model", "/models/tiny"}, {"bnb_4bit_blocksize", "64"}};
    offload::place_disk_blocks(header_);
  }
  void write(const DiskHomesHeader& h) {
    offload::write_disk_homes(path(), h, [&](const DiskBlock& b, std::uint8_t* dst) {
      std::memcpy(dst, data_.at(b.layer).data(), static_cast<std::size_t>(b.bytes));
    });
  }
  std::string path() const { return offload::disk_homes_path(dir_.string()); }
  std::string file_bytes() const {
    std::ifstream in(path(), std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  void overwrite(std::int64_t at, const std::string& bytes) {
    std::fstream f(path(), std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(at);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  std::vector<std::string> folder() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
  // Waits (bounded) until the ring holds exactly `layers`.
  bool ring_holds(const offload::DiskReader& r, std::vector<int> layers) {
    std::sort(layers.begin(), layers.end());
    for (int i = 0; i < 500; ++i) {
      if (r.held_layers() == layers) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  DiskHomesHeader header_;
  std::map<int, std::vector<std::uint8_t>> data_;
};

}  // namespace

TEST_F(DiskHomesTest, WrittenFileHoldsEveryArenaAlignedAndChecksOut) {
  make_blocks();
  write(header_);
  const std::string f = file_bytes();
  ASSERT_EQ(static_cast<std::int64_t>(f.size()), header_.file_bytes);
  EXPECT_EQ(f.substr(0, 8), "EODDPHOM");
  std::int64_t previous_end = 0;
  for (const auto& b : header_.blocks) {
    EXPECT_EQ(b.offset % 4096, 0) << "layer " << b.layer;
    EXPECT_GE(b.offset, previous_end) << "blocks overlap";
    previous_end = b.offset + (b.bytes + 4095) / 4096 * 4096;
    EXPECT_EQ(f.compare(static_cast<std::size_t>(b.offset), static_cast<std::size_t>(b.bytes),
                        reinterpret_cast<const char*>(data_[b.layer].data()), static_cast<std::size_t>(b.bytes)), 0)
        << "layer " << b.layer << "'s bytes in the file";
    // The padding up to the next 4096 bytes is zeros (O_DIRECT reads whole pages).
    for (std::int64_t i = b.offset + b.bytes; i < previous_end; ++i) ASSERT_EQ(f[static_cast<std::size_t>(i)], 0);
  }
  EXPECT_EQ(previous_end, header_.file_bytes);
  const auto check = offload::check_disk_homes(path(), header_);
  EXPECT_TRUE(check.matches) << check.reason;
  EXPECT_EQ(folder(), std::vector<std::string>{"eo-ddp-expert-homes.bin"}) << "a temporary was left behind";
}

// The format as disk_homes.h documents it, written here by hand (prefix: magic, u32 version, u32
// 0, u64 region, u64 JSON length, u64 JSON checksum, u64 prefix checksum; the JSON; the blocks at
// their offsets): the check accepts it, and the writer's file is the same bytes.
TEST_F(DiskHomesTest, TheDocumentedFormatIsWhatTheWriterWrites) {
  make_blocks();
  write(header_);
  const std::string written = file_bytes();
  nlohmann::json blocks = nlohmann::json::array();
  for (const auto& b : header_.blocks) blocks.push_back({b.layer, b.offset, b.bytes, offload::checksum_hex(b.checksum)});
  const std::string text =
      nlohmann::json{{"identity", header_.identity}, {"blocks", blocks}, {"file_bytes", header_.file_bytes}}.dump();
  const std::int64_t region = header_.blocks.front().offset;
  std::string f(static_cast<std::size_t>(header_.file_bytes), '\0');
  auto u64 = [&](std::size_t at, std::uint64_t v) { std::memcpy(&f[at], &v, 8); };
  std::memcpy(&f[0], "EODDPHOM", 8);
  const std::uint32_t version = 1;
  std::memcpy(&f[8], &version, 4);
  u64(16, static_cast<std::uint64_t>(region));
  u64(24, text.size());
  u64(32, eo::hash_bytes(text.data(), text.size(), 1));
  u64(40, eo::hash_bytes(f.data(), 40, 1));
  std::memcpy(&f[48], text.data(), text.size());
  for (const auto& b : header_.blocks)
    std::memcpy(&f[static_cast<std::size_t>(b.offset)], data_[b.layer].data(), static_cast<std::size_t>(b.bytes));
  EXPECT_EQ(region % 4096, 0);
  EXPECT_EQ(f, written) << "the writer's file differs from the documented format";
  fs::remove(path());
  std::ofstream(path(), std::ios::binary).write(f.data(), static_cast<std::streamsize>(f.size()));
  const auto c = offload::check_disk_homes(path(), header_);
  EXPECT_TRUE(c.matches) << c.reason;
}

TEST_F(DiskHomesTest, EveryMismatchIsFoundAndNamed) {
  make_blocks();
  auto reason = [&](const DiskHomesHeader& h) {
    const auto c = offload::check_disk_homes(path(), h);
    EXPECT_FALSE(c.matches);
    return c.reason;
  };
  EXPECT_EQ(reason(header_), "no homes file yet");
  write(header_);
  const std::string good = file_bytes();

  // Another model / quantisation setting: the key that differs is named with both values.
  DiskHomesHeader other = header_;
  other.identity["bnb_4bit_blocksize"] = "128";
  EXPECT_TRUE(contains(reason(other), "another model or quantisation (bnb_4bit_blocksize: the file's is '64', this run's '128')"))
      << reason(other);
  other = header_;
  other.identity["bnb_4bit_use_double_quant"] = "true";
  EXPECT_TRUE(contains(reason(other), "bnb_4bit_use_double_quant: the file's is '(none)'")) << reason(other);
  // The same identity but another arena layout (a stored bitsandbytes layout, say).
  other = header_;
  other.blocks[2].bytes += 1;
  offload::place_disk_blocks(other);
  EXPECT_TRUE(contains(reason(other), "its arena layout differs: block 2 is layer 3, 70001 bytes")) << reason(other);
  other = header_;
  other.blocks.pop_back();
  offload::place_disk_blocks(other);
  EXPECT_TRUE(contains(reason(other), "5 blocks, this run has 4")) << reason(other);
  // Same layout, other bytes.
  other = header_;
  other.blocks[1].checksum ^= 1;
  EXPECT_TRUE(contains(reason(other), "its bytes differ from this run's experts (layer 2: checksum")) << reason(other);

  // A corrupted header: one byte of the JSON, one byte of the fixed prefix.
  overwrite(60, "#");
  EXPECT_TRUE(contains(reason(header_), "its header is corrupted (the header's JSON does not match its checksum)")) << reason(header_);
  overwrite(0, good.substr(0, 4096));
  overwrite(17, "\x7f");
  EXPECT_TRUE(contains(reason(header_), "its header is corrupted (the header prefix")) << reason(header_);
  overwrite(0, "NOTHOMES");
  EXPECT_TRUE(contains(reason(header_), "it is not an eo-ddp homes file")) << reason(header_);
  overwrite(0, good.substr(0, 4096));
  EXPECT_TRUE(offload::check_disk_homes(path(), header_).matches);

  // Truncated: the last block cut short, and cut inside the header.
  fs::resize_file(path(), good.size() - 100);
  EXPECT_TRUE(contains(reason(header_), "it is truncated: " + std::to_string(good.size() - 100) + " bytes on the drive, its header says " +
                                            std::to_string(good.size())))
      << reason(header_);
  fs::resize_file(path(), 100);
  EXPECT_TRUE(contains(reason(header_), "truncated inside its header")) << reason(header_);
  fs::resize_file(path(), 30);
  EXPECT_TRUE(contains(reason(header_), "not an eo-ddp homes file")) << reason(header_);
  fs::resize_file(path(), 0);
  EXPECT_TRUE(contains(reason(header_), "not an eo-ddp homes file (no EODDPHOM header; 0 bytes)")) << reason(header_);
}

// A full drive while writing (the test seam's ENOSPC after N bytes, as a real drive fails: part of
// the write done, then the error): the error names the file and the bytes, and nothing is left —
// neither a file under the final name nor a temporary. A good file already there survives.
TEST_F(DiskHomesTest, AFullDriveLeavesNothingALaterRunWouldTrust) {
  make_blocks();
  faults::Plan plan;
  plan.disk_homes_full_after = 50000;
  faults::install(plan);
  std::string error;
  try {
    write(header_);
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_TRUE(contains(error, "cannot write the expert homes file " + dir_.string() + "/.eo-ddp-expert-homes.bin.tmp.")) << error;
  EXPECT_TRUE(contains(error, "No space left on device after 50000 of " + std::to_string(header_.file_bytes) + " bytes")) << error;
  EXPECT_TRUE(contains(error, "expert_offload_disk_path")) << "the message says what to do: " << error;
  EXPECT_EQ(folder(), std::vector<std::string>{}) << "a failed write left files behind";
  EXPECT_EQ(offload::check_disk_homes(path(), header_).reason, "no homes file yet");

  // With a good file in place, a failed rewrite (another setting) leaves it as it was.
  faults::install({});
  write(header_);
  const std::string good = file_bytes();
  DiskHomesHeader other = header_;
  other.identity["bnb_4bit_blocksize"] = "128";
  faults::install(plan);
  EXPECT_THROW(write(other), Error);
  faults::install({});
  EXPECT_EQ(file_bytes(), good);
  EXPECT_EQ(folder(), std::vector<std::string>{"eo-ddp-expert-homes.bin"});
  // The header goes in last: a failure while writing the header itself leaves nothing either.
  plan.disk_homes_full_after = header_.file_bytes - 10;
  faults::install(plan);
  fs::remove(path());
  EXPECT_THROW(write(header_), Error);
  EXPECT_EQ(folder(), std::vector<std::string>{});
}

// The ring: given the blocks the engine will copy next, it reads them ahead into its buffers, at
// most `ring` at once, and hands out bytes equal to the file's; a block not planned is read on
// demand and counted.
TEST_F(DiskHomesTest, RingReadsAheadAlongThePlanAndHoldsAtMostItsBuffers) {
  make_blocks();
  write(header_);
  offload::DiskReader r(path(), header_.blocks, /*ring=*/2, /*pinned=*/false, offload::HomeNode{});
  EXPECT_EQ(r.ring_size(), 2);
  EXPECT_EQ(r.buffer_bytes(), 73728) << "the largest block (70001 bytes) rounded up to 4096";
  EXPECT_EQ(r.ram_bytes(), 2 * 73728);
  EXPECT_TRUE(ring_holds(r, {})) << "nothing is read before a plan";
  auto expect_bytes = [&](int layer, const std::uint8_t* p) {
    const auto& d = data_.at(layer);
    EXPECT_EQ(std::memcmp(p, d.data(), d.size()), 0) << "layer " << layer << "'s bytes differ from the file's";
  };
  r.plan({3, 0, 5, 0, 6});
  EXPECT_TRUE(ring_holds(r, {3, 0})) << "the first two planned blocks are read ahead";
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(r.held_layers(), (std::vector<int>{0, 3})) << "never more than the ring's two buffers";
  auto s = r.take_stats();
  EXPECT_EQ(s.reads, 2);
  EXPECT_EQ(s.read_bytes, 70001 + 10000);
  expect_bytes(3, r.acquire(3));
  r.release(3);  // 3 is done: the ring moves on to 5
  EXPECT_TRUE(ring_holds(r, {0, 5}));
  expect_bytes(0, r.acquire(0));
  r.release(0);
  // The plan is now {5, 0, 6}: 0 is wanted again and stays; nothing else fits.
  EXPECT_TRUE(ring_holds(r, {0, 5}));
  expect_bytes(5, r.acquire(5));
  r.release(5);
  EXPECT_TRUE(ring_holds(r, {0, 6}));
  expect_bytes(0, r.acquire(0));
  r.release(0);
  expect_bytes(6, r.acquire(6));
  r.release(6);
  s = r.take_stats();
  EXPECT_EQ(s.reads, 2) << "5 and 6; 0 was still in the ring for its second use";
  EXPECT_EQ(s.acquires, 5);
  EXPECT_EQ(s.ring_hits, 1);
  EXPECT_EQ(s.unplanned, 0);
  // Not planned: read on demand, counted.
  expect_bytes(2, r.acquire(2));
  r.release(2);
  s = r.take_stats();
  EXPECT_EQ(s.reads, 1);
  EXPECT_EQ(s.unplanned, 1);
  EXPECT_LE(r.held_layers().size(), 2u);
  EXPECT_THROW(r.acquire(1), Error) << "layer 1 has no block";
  EXPECT_THROW(r.release(5), Error) << "5 is not held";
}

// Where the file system refuses O_DIRECT (tmpfs before Linux 6.6; here the test seam refuses it),
// the ring reads through the page cache and says so.
TEST_F(DiskHomesTest, BufferedReadsWhereODirectIsRefused) {
  make_blocks();
  write(header_);
  {
    // O_DIRECT where the test folder's file system takes it (ext4, xfs, tmpfs since Linux 6.6);
    // else the same fallback, for real.
    offload::DiskReader r(path(), header_.blocks, 2, false, offload::HomeNode{});
    if (r.direct()) EXPECT_EQ(r.how(), "O_DIRECT");
    else EXPECT_TRUE(contains(r.how(), "buffered reads: the file system refused O_DIRECT (EINVAL) for " + path())) << r.how();
    std::cout << dir_ << ": " << r.how() << std::endl;
  }
  faults::Plan plan;
  plan.refuse_o_direct = true;
  faults::install(plan);
  offload::DiskReader r(path(), header_.blocks, 2, false, offload::HomeNode{});
  EXPECT_FALSE(r.direct());
  EXPECT_TRUE(contains(r.how(), "buffered reads: the fault-injection plan refused O_DIRECT for " + path())) << r.how();
  for (const auto& b : header_.blocks) {
    const std::uint8_t* p = r.acquire(b.layer);
    EXPECT_EQ(std::memcmp(p, data_[b.layer].data(), static_cast<std::size_t>(b.bytes)), 0) << "layer " << b.layer;
    r.release(b.layer);
  }
  const std::int64_t chunk = 8192;
  std::int64_t n = 0;
  bool direct = true;
  EXPECT_GT(offload::sequential_read_gbps(path(), chunk, &n, &direct), 0);
  EXPECT_EQ(n, header_.file_bytes);
  EXPECT_FALSE(direct);
}

// A block changed on the drive after the file was written (its header still fine): the first read
// of it finds its checksum wrong and the error says what to do.
TEST_F(DiskHomesTest, ABlockCorruptedOnTheDriveIsCaughtOnItsFirstRead) {
  make_blocks();
  write(header_);
  const DiskBlock& b = header_.blocks[2];
  overwrite(b.offset + 5000, "\x01\x02\x03");
  EXPECT_TRUE(offload::check_disk_homes(path(), header_).matches) << "the header alone cannot tell";
  offload::DiskReader r(path(), header_.blocks, 2, false, offload::HomeNode{});
  std::string error;
  try {
    r.acquire(b.layer);
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_TRUE(contains(error, "the block of layer 3 reads back with checksum")) << error;
  EXPECT_TRUE(contains(error, "Delete it; the next run rebuilds it")) << error;
}

// Issue #32 item 3: a block changed on the drive after it was read once (and verified) is caught
// at its next read from the drive, not trained on: every read is checked.
TEST_F(DiskHomesTest, ABlockChangedAfterItsFirstReadIsCaughtAtTheNextRead) {
  make_blocks();
  write(header_);
  ASSERT_GE(header_.blocks.size(), 3u);
  const DiskBlock& b = header_.blocks[0];
  offload::DiskReader r(path(), header_.blocks, 2, false, offload::HomeNode{});
  r.acquire(b.layer);
  r.release(b.layer);
  overwrite(b.offset + 64, std::string(64, '\x5a'));
  for (int round = 0; round < 2; ++round)  // the ring (2 buffers) moves on: block 0 leaves it
    for (std::size_t i = 1; i < header_.blocks.size(); ++i) {
      r.acquire(header_.blocks[i].layer);
      r.release(header_.blocks[i].layer);
    }
  const auto held = r.held_layers();
  ASSERT_EQ(std::count(held.begin(), held.end(), b.layer), 0) << "block 0 is still in the ring: no read would happen";
  std::string error;
  try {
    r.acquire(b.layer);
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_TRUE(contains(error, "the block of layer " + std::to_string(b.layer) + " reads back with checksum")) << error;
}

// The read-ahead's list is the staging policy's dry run: it equals the copies the policy then
// really makes, stage by stage, across step boundaries.
TEST(StagingPolicy, UpcomingCopiesAreTheCopiesItThenMakes) {
  for (int slots : {1, 2, 3})
    for (bool prefetch : {false, true}) {
      offload::StagingPolicy p(7, slots, prefetch);
      p.set_resident(5);
      const std::vector<int> order{0, 1, 2, 3, 4, 5, 6, 5, 4, 3, 2, 1, 0};
      p.set_schedule(order);
      const auto predicted = p.upcoming_copies(0, 1000, 3 * order.size());
      std::vector<int> made;
      for (int step = 0; step < 3; ++step)
        for (std::size_t pos = 0; pos < order.size(); ++pos)
          for (const auto& c : p.stage(order[pos], pos)) made.push_back(c.layer);
      EXPECT_EQ(predicted, made) << slots << " slot(s), prefetch " << prefetch;
      EXPECT_EQ(std::count(made.begin(), made.end(), 5), 0) << "a resident block is never copied";
    }
}

// Copies per warm step, the memory plan's figure for disk reads: S slots over N blocks staged
// forward then back (the top block's two uses are one run) copy 2N - 2S blocks a step (2N - 2 with
// one slot: only the top block stays across a turn), as the engine's tests count them.
TEST(StagingPolicy, SteadyCopiesPerStepFollowTheTurns) {
  const int n = 6;
  std::vector<int> order;
  for (int l = 0; l < n; ++l) order.push_back(l);
  for (int l = n - 2; l >= 0; --l) order.push_back(l);
  EXPECT_EQ(offload::steady_copies_per_step(order, n, 1, false), 2 * n - 2);
  for (int s : {2, 3, 4}) EXPECT_EQ(offload::steady_copies_per_step(order, n, s, true), 2 * n - 2 * s) << s << " slots";
  EXPECT_EQ(offload::steady_copies_per_step(order, n, 6, true), 0) << "every block stays in its slot";
  // Two resident blocks leave M = 4 streamed: 2M - 2S with S = 3.
  EXPECT_EQ(offload::steady_copies_per_step(order, n, 3, true, {0, 1}), 2);
}
