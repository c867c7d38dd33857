#!/usr/bin/env bash
# Thirty-seventh session, first call (at a08c2f1; 967c711's threshold:
# only WRITEs of 8192 descriptors or more announced). Under MPS, lone
# arena WRITEs of 1024, 8192 and 16,384 x 4 KiB and 128 x 1024 in flight,
# announce_writes on and off alternating in one plugin, three rounds; then
# the timeline (NIXL_BOUNCE_TRACE) of a lone 16,384 and a lone 1024 x 4 KiB
# WRITE with the defaults. $OUT/all.tgz.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s37-gated || exit 1
export BENCH_GREP='inflight\|preparation per'
mps_start
for round in 1 2 3; do
  for a in true false; do
    vbench "gated-$a-r$round" --param enable_peer_map=false --param announce_writes=$a \
      --sizes 4096 --counts 1024,8192,16384 --concurrent 128 --iters 30
  done
done
for n in 16384 1024; do
  rm -rf /tmp/bounce-trace && mkdir -p /tmp/bounce-trace
  NIXL_BOUNCE_TRACE=/tmp/bounce-trace vbench "trace-$n" --param enable_peer_map=false \
    --sizes 4096 --counts $n --concurrent 0 --iters 30
  python3 bench/trace_report.py /tmp/bounce-trace --requests 5: >"$work/trace-$n.txt" 2>&1
  pack
done
mps_stop
cat "$summary"
