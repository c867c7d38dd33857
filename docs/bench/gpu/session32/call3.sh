#!/usr/bin/env bash
# Thirty-second session, the last device time (about 200 s): the arena's
# byte-exact test at the tree's plugin, then one lone 1024 and 16,384 x 4
# KiB arena WRITE benchmark under MPS. $OUT/all.tgz. From the repository
# root with .gpu carried: bash THIS.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s32-call3 || exit 1
s=$SECONDS; timeout 70 "$v" test --param enable_peer_map=false >"$work/vram-test-arena.log" 2>&1
echo "vram-test-arena rc=$? ($((SECONDS-s)) s)" | tee "$work/tests-summary.txt"; pack
grep -E "passed|FAILED|ok" "$work/vram-test-arena.log" | tail -12
mps_start
timeout 60 "$v" bench --backend BOUNCE --label new --param enable_peer_map=false --sizes 4096 \
  --counts 1024,16384 --concurrent 0 --iters 10 >"$work/bench-new.log" 2>&1
grep -h "inflight\|preparation\|launch steps\|together" "$work/bench-new.log" | cut -c1-170
pack
mps_stop
