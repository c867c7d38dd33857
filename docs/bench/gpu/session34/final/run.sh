#!/usr/bin/env bash
# Thirty-fourth session, last call (a0c6f5a): gpu_kernels with the review's
# cases (partial tiles, 511-513), bounce-vram test over the arena, then
# copy_inline_packed on and off alternating under MPS, two rounds, lone
# 1024 x 4 KiB and 128 in flight (the arena). $OUT/all.tgz.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s34-final || exit 1
summary="$work/summary.txt"
bin=/tmp/nixl-bounce-gpu/bin
s=$SECONDS; timeout 120 "$bin/gpu_kernels" --test-threads=1 --nocapture >"$work/gpu_kernels.log" 2>&1
echo "gpu_kernels rc=$? ($((SECONDS-s)) s)" | tee -a "$summary"
grep -h "single packed\|test result\|panicked\|SKIP" "$work/gpu_kernels.log"
s=$SECONDS; timeout 120 "$v" test --param enable_peer_map=false >"$work/vram-test-arena.log" 2>&1
echo "vram-test-arena rc=$? ($((SECONDS-s)) s)" | tee -a "$summary"; pack
bench() { # tag, params...
  local tag=$1; shift
  timeout 60 "$v" bench --backend BOUNCE --label "$tag" --param enable_peer_map=false "$@" --sizes 4096 \
    --counts 1024 --concurrent 128 --iters 40 >"$work/bench-$tag.log" 2>&1
  echo "bench-$tag rc=$?" >>"$summary"
  grep -h "inflight\|launch steps" "$work/bench-$tag.log" | cut -c1-160
  pack
}
mps_start
for round in ${ROUNDS:-1 2}; do
  bench "inline-r$round"
  bench "upload-r$round" --param copy_inline_packed=false
done
mps_stop
cat "$summary"
