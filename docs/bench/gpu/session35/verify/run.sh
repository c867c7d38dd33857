#!/usr/bin/env bash
# Thirty-fifth session: the copy kernels' one tile walk (`copy_each` over
# `PairEnds` / `PackedEnds`, kernels/gather_scatter.cu) and the packed
# kernel's parameters reordered. Correctness first (gpu_kernels: pair and
# packed kernels, inline and uploaded, every size around the capacities;
# gpu_peer_map; bounce-vram test on both paths), then the old plugin
# (.gpu/old: 4342a07) against the new, alternating, two rounds: the
# peer-mapped path (pair tables) and the arena under MPS (packed inline
# kernels for the lone 1024, uploaded pairs for 16,384). $OUT/all.tgz.
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
export BENCH_GREP='inflight\|launch steps\|of which their table'
new=$NIXL_PLUGIN_DIR old=$(old_plugin_dir)
for round in 1 2; do
  for k in old new; do
    NIXL_PLUGIN_DIR=${!k} vbench "peer-$k-r$round" --sizes 4096 --counts 1024,16384 \
      --concurrent 128 --iters 30
  done
done
mps_start
for round in 1 2; do
  for k in old new; do
    NIXL_PLUGIN_DIR=${!k} vbench "arena-$k-r$round" --param enable_peer_map=false \
      --sizes 4096 --counts 1024,16384 --concurrent 128 --iters 20
  done
done
mps_stop
cat "$summary"
