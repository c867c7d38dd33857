#!/usr/bin/env bash
# Thirty-fourth session: packed copies' addresses as the launch's own
# parameter (copy_inline_packed, on by default) against the uploaded pair
# table (copy_inline_packed=false). 1. gpu_kernels (the new single-list
# test at every size around the kernels' capacities, and the rest);
# 2. bounce-vram test over the arena, byte-exact; 3. the arena's lone
# 1024 and 16,384 x 4 KiB and 128 in flight, both alternating under MPS,
# two rounds, then one round without MPS. $OUT/all.tgz.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s34-inline || exit 1
summary="$work/summary.txt"
bin=/tmp/nixl-bounce-gpu/bin
s=$SECONDS; timeout 120 "$bin/gpu_kernels" --test-threads=1 --nocapture >"$work/gpu_kernels.log" 2>&1
echo "gpu_kernels rc=$? ($((SECONDS-s)) s)" | tee -a "$summary"
grep -h "single packed\|test result\|panicked" "$work/gpu_kernels.log"
s=$SECONDS; timeout 120 "$v" test --param enable_peer_map=false >"$work/vram-test-arena.log" 2>&1
echo "vram-test-arena rc=$? ($((SECONDS-s)) s)" | tee -a "$summary"; pack
bench() { # tag, params...
  local tag=$1; shift
  timeout 100 "$v" bench --backend BOUNCE --label "$tag" --param enable_peer_map=false "$@" --sizes 4096 \
    --counts 1024,16384 --concurrent 128 --iters "${ITERS:-20}" >"$work/bench-$tag.log" 2>&1
  echo "bench-$tag rc=$?" >>"$summary"
  grep -h "inflight\|launch steps\|table the parameter" "$work/bench-$tag.log" | cut -c1-160
  pack
}
mps_start
for round in 1 2; do
  bench "inline-r$round"
  bench "upload-r$round" --param copy_inline_packed=false
done
mps_stop
bench inline-nomps
bench upload-nomps --param copy_inline_packed=false
cat "$summary"
