#!/usr/bin/env bash
# Thirty-sixth session, third call (967c711: only WRITEs of 8192
# descriptors or more announced). Under MPS, lone arena WRITEs of 1024,
# 8192 and 16,384 x 4 KiB and 128 x 1024 in flight, announce_writes on
# and off alternating in one plugin, three rounds. $OUT/all.tgz.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s36-gated || exit 1
export BENCH_GREP='inflight\|preparation per'
mps_start
for round in 1 2 3; do
  for a in true false; do
    vbench "gated-$a-r$round" --param enable_peer_map=false --param announce_writes=$a \
      --sizes 4096 --counts 1024,8192,16384 --concurrent 128 --iters 30
  done
done
mps_stop
cat "$summary"
