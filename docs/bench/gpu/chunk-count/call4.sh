#!/usr/bin/env bash
# Thirty-first session, one device call: is 8 chunks a better default than 4
# for the arena (min_chunks_per_request)? Lone arena WRITEs under MPS of
# 8192 and 16,384 x 4 KiB (32 and 64 MiB: 4 chunks of 8/16 MiB against 8
# of 4/8 MiB), the two settings alternating, two rounds; then traced runs at 8 chunks, both ways of
# posting the writes, with the kernels timed (NIXL_BOUNCE_TIME_KERNELS: device time apart from the
# reactor's look). Everything lands in $OUT/all.tgz, re-packed after each
# stage. Run from the repository root with .gpu carried: bash THIS.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call call4 || exit 1
mps_start
bench() { # tag, extra params...
  local tag=$1; shift
  timeout 100 "$v" bench --backend BOUNCE --label "$tag" --param enable_peer_map=false "$@" \
    --sizes 4096 --counts 8192,16384 --concurrent 0 --iters 30 >"$work/bench-$tag.log" 2>&1
  grep -h "inflight\|preparation" "$work/bench-$tag.log" | cut -c1-170
  pack
}
for round in 1 2; do
  for w in 4 8; do bench "w$w-r$round" --param min_chunks_per_request=$w; done
done
for cw in auto io_thread; do
  rm -rf /tmp/bounce-trace && mkdir -p /tmp/bounce-trace
  NIXL_BOUNCE_TIME_KERNELS=1 NIXL_BOUNCE_TRACE=/tmp/bounce-trace timeout 100 "$v" bench --backend BOUNCE --label "traced-w8-$cw" \
    --param enable_peer_map=false --param min_chunks_per_request=8 --param chunk_writes=$cw \
    --sizes 4096 --counts 16384 --concurrent 0 --iters 30 >"$work/bench-traced-w8-$cw.log" 2>&1
  python3 bench/trace_report.py /tmp/bounce-trace --requests 5: >"$work/trace-w8-$cw.txt" 2>&1
  grep -h "inflight\|kernel" "$work/bench-traced-w8-$cw.log" | cut -c1-200
  pack
done
mps_stop
