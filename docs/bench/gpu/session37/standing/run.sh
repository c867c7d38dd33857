#!/usr/bin/env bash
# Thirty-seventh session (c578b9d: standing credits). Under MPS, arena
# WRITEs of 1024, 4096 and 16,384 x 4 KiB and 128 x 1024 in flight, with
# the receiver's standing credits (default, standing_credit_peers=4) and
# without (0), alternating in one plugin, three rounds; then the timeline
# (NIXL_BOUNCE_TRACE) of a lone 1024 x 4 KiB WRITE at the defaults, and
# two rounds on and off over NIXL-notification control
# (trimmed to fit what was left of the session's device time; 967c711's
# gated announcement is not in it). $OUT/all.tgz.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s37-standing || exit 1
export BENCH_GREP='inflight\|preparation per'
mps_start
for round in 1 2 3; do
  for s in 4 0; do
    vbench "standing$s-r$round" --param enable_peer_map=false --param standing_credit_peers=$s \
      --sizes 4096 --counts 1024,4096,16384 --concurrent 128 --iters 30
  done
done
# Where the credit should pay: NIXL-notification control (a longer round
# trip than the gather), two rounds.
for round in 1 2; do
  for s in 4 0; do
    vbench "notif-standing$s-r$round" --param enable_peer_map=false --param use_nixl_notifications=true \
      --param standing_credit_peers=$s --sizes 4096 --counts 1024,4096 --concurrent 0 --iters 30
  done
done
for n in 1024; do
  rm -rf /tmp/bounce-trace && mkdir -p /tmp/bounce-trace
  NIXL_BOUNCE_TRACE=/tmp/bounce-trace vbench "trace-$n" --param enable_peer_map=false \
    --sizes 4096 --counts $n --concurrent 0 --iters 30
  python3 bench/trace_report.py /tmp/bounce-trace --requests 5: >"$work/trace-$n.txt" 2>&1
  pack
done
mps_stop
cat "$summary"
