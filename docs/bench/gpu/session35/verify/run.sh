#!/usr/bin/env bash
# Thirty-fifth session, one call for everything (the device is scarce):
# 1. correctness at 5dffbb1: gpu_kernels (pair and packed kernels through
#    the one tile walk `copy_each`, inline and uploaded, every size around
#    the capacities), gpu_peer_map, bounce-vram test on both paths;
# 2. prep_cost on this host's 16 cores (.gpu/extra/libtests): the arena's
#    check and packing in parts of whole chunks against slices stitched,
#    scattered blocks and blocks in order;
# 3. three plugins alternating, two rounds: old = 4342a07 (.gpu/old/
#    libplugin_BOUNCE.so), mid = fa69086 (the kernels' one tile walk;
#    .gpu/old/mid.so), new = 5dffbb1 (and chunks packed in slices): the
#    arena under MPS (1024 and 16,384 x 4 KiB, 128 in flight), then the
#    peer-mapped path, old against new (pair kernel). $OUT/all.tgz.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s35-verify || exit 1
bin=/tmp/nixl-bounce-gpu/bin
for t in gpu_kernels gpu_peer_map; do
  s=$SECONDS; timeout 150 "$bin/$t" --test-threads=1 --nocapture >"$work/$t.log" 2>&1
  echo "$t rc=$? ($((SECONDS-s)) s)" | tee -a "$summary"
  grep -h "test result\|panicked\|SKIP" "$work/$t.log"
done
for p in true false; do
  s=$SECONDS; timeout 120 "$v" test --param enable_peer_map=$p >"$work/vram-test-peer-$p.log" 2>&1
  echo "vram-test enable_peer_map=$p rc=$? ($((SECONDS-s)) s)" | tee -a "$summary"; pack
done
for o in 0 1; do
  PREP_IN_ORDER=$o PREP_THREADS=8 timeout 60 .gpu/extra/libtests prep_cost --ignored --nocapture 2>&1 \
    | grep "prep_cost " | tee -a "$work/prep-cost.txt"
done
pack
export BENCH_GREP='inflight\|launch steps\|of which their table\|preparation per'
new=$NIXL_PLUGIN_DIR old=$(old_plugin_dir) mid=$(old_plugin_dir mid.so)
mps_start
for round in 1 2; do
  for k in old mid new; do
    NIXL_PLUGIN_DIR=${!k} vbench "arena-$k-r$round" --param enable_peer_map=false \
      --sizes 4096 --counts 1024,16384 --concurrent 128 --iters 20
  done
done
mps_stop
for round in 1 2; do
  for k in old new; do
    NIXL_PLUGIN_DIR=${!k} vbench "peer-$k-r$round" --sizes 4096 --counts 1024,16384 \
      --concurrent 128 --iters 30
  done
done
cat "$summary"
