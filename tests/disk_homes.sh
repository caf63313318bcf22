#!/usr/bin/env bash
# expert_offload_homes: disk end to end on the CPU build, one rank (issue #17; 2 and 3 ranks are
# in mpi_train.sh):
#  1. disk homes train bitwise like per-rank homes; the file is written once and a second run
#     reuses it (the log says so; its inode and modification time are unchanged);
#  2. a corrupted header, a truncated file and a file of another quantisation setting or another
#     model are each found, named in the log and rebuilt, and the run trains bitwise like per-rank
#     homes;
#  3. the drive reads per step are the plan's (eo-ddp plan) and the staged bytes; where O_DIRECT
#     is refused the log says so and the reads are buffered, still bitwise;
#  4. a full drive while writing — the test seam's ENOSPC, and a real full tmpfs in a private
#     mount namespace — ends the run with exit 1 naming the file, the bytes and the fix, and
#     leaves nothing a later run trusts; a later run with room writes the file and trains;
#  5. on a read-only drive a good file is reused, a damaged one refused naming the directory;
#  6. config errors (disk without expert_offload or without expert_offload_disk_path, a path
#     that is a file or cannot be created) are listed at once, exit 2; the plan's host-RAM check
#     suggests per_numa_node and disk when RAM is short.
# usage: disk_homes.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"
faults_bin=$1/eo-ddp-faults  # eo-ddp with the fault-injection test seam (tests/eo_ddp_faults.cpp)
common=(--config configs/tiny-qwen3-moe.yaml --set max_steps=3 --set save_steps=0 --set lora_dropout=0.1
        --set expert_offload=true)
homes=$tmp/homes
file=$homes/eo-ddp-expert-homes.bin
disk=(--set expert_offload_homes=disk --set expert_offload_disk_path="$homes")
run() {  # name [extra args]
  local name=$1
  shift
  timeout 300 "$bin" "${common[@]}" --set output_dir="$tmp/$name" "$@" >"$tmp/$name.log" 2>&1 ||
    { echo "run $name failed"; tail -5 "$tmp/$name.log"; fail=1; }
}
same() {  # label run [reference run]
  check "$1: disk homes == per_rank homes, bitwise" "$py" tests/ref/compare_adapters.py "$tmp/${3:-per_rank}" "$tmp/$2" --exact
}
ident() { stat -c '%i %y' "$1"; }

# ---- 1. bitwise, written once, reused
run per_rank
run first "${disk[@]}"
same "first run" first
check "the first run writes the file" grep -q "expert homes on disk: writing $file (.*): no homes file yet" "$tmp/first.log"
# O_DIRECT where $tmp's file system takes it (ext4, xfs, tmpfs since Linux 6.6), else the fallback.
check "it is read with O_DIRECT (or buffered where refused) into a ring of 3" \
  grep -qE "in $file \((O_DIRECT|buffered reads: the file system refused O_DIRECT \(EINVAL\).*)\), read ahead into 3 pageable buffers" "$tmp/first.log"
before=$(ident "$file")
run second "${disk[@]}"
same "second run" second
check "the second run reuses the file" grep -q "expert homes on disk: reusing $file (4 blocks" "$tmp/second.log"
check "and writes nothing" bash -c "! grep -qE 'homes on disk: (writing|rebuilding)' '$tmp/second.log'"
check "the file's inode and mtime are unchanged ($before)" test "$(ident "$file")" = "$before"
# A block's byte changed on the drive (its header intact): the reuse log claims only what the header
# check saw, and the block's read names the damage; the run stops with exit 1.
cp "$file" "$tmp/homes-good.bin"
"$py" -c "
import re, sys
with open(sys.argv[1], 'r+b') as f:
    start, size = map(int, re.search(rb'\\[0,(\\d+),(\\d+),', f.read(4096)).groups())  # layer 0's block
    at = start + size // 2
    f.seek(at); b = f.read(1); f.seek(at); f.write(bytes([b[0] ^ 1]))" "$file"
timeout 300 "$bin" "${common[@]}" --set output_dir="$tmp/block_damaged" "${disk[@]}" >"$tmp/block_damaged.log" 2>&1
check "a damaged block stops the run with exit 1" test $? = 1
check "the damaged block is named" grep -q "reads back with checksum" "$tmp/block_damaged.log"
check "the reuse log does not claim the blocks' bytes were checked" \
  bash -c "! grep -q \"every block's checksum match\" '$tmp/block_damaged.log'"
cp "$tmp/homes-good.bin" "$file"

# ---- 2. damaged or foreign files are rebuilt, the reason named
printf 'X' | dd of="$file" bs=1 seek=100 conv=notrunc status=none
run corrupt "${disk[@]}"
check "a corrupted header is found" grep -q "rebuilding $file (.*): its header is corrupted" "$tmp/corrupt.log"
same "after a corrupted header" corrupt
truncate -s -5000 "$file"
run truncated "${disk[@]}"
check "a truncated file is found" grep -q "rebuilding $file (.*): it is truncated: 130168 bytes on the drive, its header says 135168" "$tmp/truncated.log"
same "after truncation" truncated
run per_rank_128 --set bnb_4bit_blocksize=128
run blocksize "${disk[@]}" --set bnb_4bit_blocksize=128
check "a file of another quantisation setting is found" \
  grep -q "rebuilding $file (.*): it holds the homes of another model or quantisation (bnb_4bit_blocksize: the file's is '64', this run's '128')" "$tmp/blocksize.log"
same "blocksize 128" blocksize per_rank_128
run back "${disk[@]}"
check "and back again" grep -q "bnb_4bit_blocksize: the file's is '128', this run's '64'" "$tmp/back.log"
same "back to blocksize 64" back
# Another model: the same shapes with other (seeded synthetic) weights.
run per_rank_synthetic --set synthetic_weights=true
run synthetic "${disk[@]}" --set synthetic_weights=true
check "a file of another model is found" \
  grep -q "rebuilding $file (.*): it holds the homes of another model or quantisation (weights: the file's is 'checkpoint', this run's 'synthetic, seed 42')" "$tmp/synthetic.log"
same "another model" synthetic per_rank_synthetic

# ---- 3. reads per step = the plan = the staged bytes; buffered reads where O_DIRECT is refused
"$bin" plan "${common[@]}" "${disk[@]}" >"$tmp/plan.txt" 2>&1
check "the plan shows the disk homes" grep -qE "disk homes +132.00 KiB" "$tmp/plan.txt"
check "the plan shows the ring" grep -qE "pinned host +96.00 KiB  per rank: the disk homes' read ring, 3 buffers of 32.00 KiB" "$tmp/plan.txt"
check "the plan shows the reads per step" grep -qE "disk reads +120.00 KiB  per rank and optimizer step: 4 block copies" "$tmp/plan.txt"
# The plan's reads are the copies of a warm step (4 here: 2N - 2S); the ring reads each copy's block
# unless it is still there from an earlier copy, and reads ahead of the step boundary (up to its 3
# buffers), so over the run: copies - ring hits <= reads <= copies - ring hits + 3.
check "the run copies what the plan says (steps 2, 3: 4 blocks) and reads them, less ring hits" "$py" -c "
import json, sys
rows = [json.loads(l) for l in open('$tmp/second/metrics.jsonl')]
block = rows[0]['staged_bytes'] // rows[0]['stagings']
copies = sum(r['stagings'] for r in rows)
hits = sum(r['disk_ring_hits'] for r in rows)
reads = sum(r['disk_reads'] for r in rows)
print(copies, hits, reads)
sys.exit(not (block == 30720 and all(r['staged_bytes'] == 4 * block for r in rows[1:]) and
              copies - hits <= reads <= copies - hits + 3 and sum(r['disk_read_bytes'] for r in rows) == reads * block))"
EO_DDP_FAULT_NO_O_DIRECT=1 timeout 300 "$faults_bin" "${common[@]}" "${disk[@]}" --set output_dir="$tmp/buffered" >"$tmp/buffered.log" 2>&1
check "without O_DIRECT: trains" test $? = 0
check "without O_DIRECT: the log says reads are buffered" \
  grep -q "in $file (buffered reads: the fault-injection plan refused O_DIRECT for $file, so reads go through the page cache" "$tmp/buffered.log"
same "buffered reads" buffered

# ---- 4. a full drive while writing
full=$tmp/full
EO_DDP_FAULT_DISK_FULL_AFTER=50000 timeout 300 "$faults_bin" "${common[@]}" --set expert_offload_homes=disk \
  --set expert_offload_disk_path="$full" --set output_dir="$tmp/full_run" >"$tmp/full_run.log" 2>&1
rc=$?
check "full drive (seam): exit 1 ($rc)" test $rc = 1
check "full drive (seam): the message names the file, the error and the bytes" \
  grep -q "cannot write the expert homes file $full/.eo-ddp-expert-homes.bin.tmp.[0-9.]* (the block of layer [0-9]*): No space left on device after 50000 of 135168 bytes" "$tmp/full_run.log"
check "full drive (seam): and what to do" grep -q "free space there or set expert_offload_disk_path to a drive with room" "$tmp/full_run.log"
check "full drive (seam): nothing left in the directory" test -z "$(ls -A "$full")"
check "full drive (seam): no adapter written" test ! -e "$tmp/full_run/adapter_model.safetensors"
run full_after --set expert_offload_homes=disk --set expert_offload_disk_path="$full"
check "then with room: the file is written" grep -q "writing $full/eo-ddp-expert-homes.bin (.*): no homes file yet" "$tmp/full_after.log"
same "after a full drive" full_after

# A real full drive: a 200 KiB tmpfs holding a damaged homes file of the right size (so the check
# before loading, which counts such a file as reused, lets the run start): the rebuild's temporary
# file does not fit beside it and the write fails with the kernel's ENOSPC.
tiny=$tmp/tiny
mkdir -p "$tiny"
unshare -m bash -c "mount -t tmpfs -o size=200k tmpfs '$tiny' || exit 99
  cp '$file' '$tiny/' && printf 'X' | dd of='$tiny/eo-ddp-expert-homes.bin' bs=1 seek=100 conv=notrunc status=none
  timeout 300 '$bin' ${common[*]} --set expert_offload_homes=disk --set expert_offload_disk_path='$tiny' --set output_dir='$tmp/tmpfs_run'
  echo \"rc=\$?\"; ls -A '$tiny'" >"$tmp/tmpfs_run.log" 2>&1
if [ $? = 99 ] || grep -q "^mount:" "$tmp/tmpfs_run.log"; then
  echo "FAILED: could not mount a tmpfs in a private mount namespace (unshare -m; needs root): $(head -2 "$tmp/tmpfs_run.log")"
  fail=1
else
  check "full tmpfs: exit 1" grep -q "^rc=1$" "$tmp/tmpfs_run.log"
  check "full tmpfs: rebuilding the damaged file was attempted" grep -q "rebuilding $tiny/eo-ddp-expert-homes.bin (.*): its header is corrupted" "$tmp/tmpfs_run.log"
  check "full tmpfs: the kernel's ENOSPC, the file and the bytes named" \
    grep -q "cannot write the expert homes file $tiny/.eo-ddp-expert-homes.bin.tmp.[0-9.]* (.*): No space left on device after [0-9]* of 135168 bytes" "$tmp/tmpfs_run.log"
  check "full tmpfs: only the old (damaged, never trusted) file is left, no temporary" \
    test "$(sed -n '/^rc=/,$p' "$tmp/tmpfs_run.log" | sed 1d)" = "eo-ddp-expert-homes.bin"
fi

# ---- 5. a read-only drive
ro=$tmp/ro
mkdir -p "$ro"
unshare -m bash -c "mount -t tmpfs tmpfs '$ro' || exit 99; cp '$file' '$ro/' && mount -o remount,ro '$ro' || exit 99
  timeout 300 '$bin' ${common[*]} --set expert_offload_homes=disk --set expert_offload_disk_path='$ro' --set output_dir='$tmp/ro_good'
  echo \"rc=\$?\"" >"$tmp/ro_good.log" 2>&1
ro_rc=$?
unshare -m bash -c "mount -t tmpfs tmpfs '$ro' || exit 99; cp '$file' '$ro/' && truncate -s -4096 '$ro/eo-ddp-expert-homes.bin' && mount -o remount,ro '$ro' || exit 99
  timeout 300 '$bin' ${common[*]} --set expert_offload_homes=disk --set expert_offload_disk_path='$ro' --set output_dir='$tmp/ro_bad'
  echo \"rc=\$?\"" >"$tmp/ro_bad.log" 2>&1
ro_bad_rc=$?
if [ $ro_rc = 99 ] || [ $ro_bad_rc = 99 ]; then
  echo "FAILED: could not mount a read-only tmpfs in a private mount namespace (unshare -m; needs root)"
  fail=1
else
  check "read-only drive, good file: trains" grep -q "^rc=0$" "$tmp/ro_good.log"
  check "read-only drive, good file: reused" grep -q "expert homes on disk: reusing $ro/eo-ddp-expert-homes.bin" "$tmp/ro_good.log"
  same "read-only drive" ro_good
  check "read-only drive, truncated file: exit 1" grep -q "^rc=1$" "$tmp/ro_bad.log"
  check "read-only drive, truncated file: refused naming the directory and the reason" \
    grep -q "expert_offload_disk_path $ro is not a writable directory (Read-only file system) and holds no usable homes file ($ro/eo-ddp-expert-homes.bin: it is truncated" "$tmp/ro_bad.log"
fi

# ---- 6. config errors, all at once; the plan's host-RAM suggestions
"$bin" --config configs/tiny-qwen3-moe.yaml --set expert_offload_homes=disk --check >"$tmp/cfg1.log" 2>&1
rc=$?
check "disk without expert_offload or a path: exit 2 ($rc)" test $rc = 2
check "both problems listed at once" grep -q "has 2 problems" "$tmp/cfg1.log"
check "disk needs expert_offload" grep -q "expert_offload_homes: disk keeps the offloaded experts on a drive: it needs expert_offload: true" "$tmp/cfg1.log"
check "disk needs expert_offload_disk_path" grep -q "expert_offload_disk_path: is required with expert_offload_homes: disk" "$tmp/cfg1.log"
"$bin" "${common[@]}" --set expert_offload_homes=disk --set expert_offload_disk_path="$tmp/per_rank.log" --check >"$tmp/cfg2.log" 2>&1
check "a path that is a file: exit 2" test $? = 2
check "a path that is a file: named" grep -q "expert_offload_disk_path: '$tmp/per_rank.log' exists and is not a directory" "$tmp/cfg2.log"
"$bin" "${common[@]}" --set expert_offload_homes=disk --set expert_offload_disk_path="$tmp/per_rank.log/homes" --check >"$tmp/cfg3.log" 2>&1
check "a path that cannot be created: exit 2" test $? = 2
check "a path that cannot be created: named" \
  grep -q "'$tmp/per_rank.log/homes' does not exist and cannot be created: '$tmp/per_rank.log' is not a writable directory" "$tmp/cfg3.log"
"$bin" "${common[@]}" --set expert_offload_disk_path="$homes" --check >"$tmp/cfg4.log" 2>&1
check "a path without disk homes is a warning" grep -q "expert_offload_disk_path is ignored: expert_offload_homes is per_rank, not disk" "$tmp/cfg4.log"
# 4 ranks x 120 KiB of per-rank homes do not fit 400 KiB; disk homes' rings (4 x 96 KiB) do.
"$bin" plan "${common[@]}" --ranks-per-node 4 --host-ram 400KiB >"$tmp/plan_short.txt" 2>&1
check "plan: per-rank homes short of host RAM: exit 1" test $? = 1
check "plan: says so and suggests per_numa_node and disk" \
  grep -q "host RAM does NOT fit: 480.00 KiB pinned per node of 400.00 KiB (--host-ram); try expert_offload_homes: per_numa_node (120.00 KiB per NUMA node) or expert_offload_homes: disk (384.00 KiB per node + 132.00 KiB on a local drive, reading 120.00 KiB per rank and step)" "$tmp/plan_short.txt"
"$bin" plan "${common[@]}" "${disk[@]}" --ranks-per-node 4 --host-ram 400KiB >"$tmp/plan_disk.txt" 2>&1
check "plan: disk homes fit: exit 0" test $? = 0
check "plan: disk homes fit" grep -q "host RAM fits: 384.00 KiB pinned per node of 400.00 KiB" "$tmp/plan_disk.txt"

[ $fail = 0 ] && echo "disk_homes: all checks passed" || { echo "disk_homes: FAILED"; for f in "$tmp"/*.log; do echo "== $f"; tail -3 "$f"; done; }
exit $fail
