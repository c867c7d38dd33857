#!/usr/bin/env bash
# Thirty-fourth session: how the arena preparation of 16,384 x 4 KiB
# scales with the preparation pool's threads (peer_map_prepare_threads,
# default half the cores, at most 8) on the GPU host, under MPS, two
# rounds alternating. The "plugin's preparation per request" lines.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s34-threads || exit 1
summary="$work/summary.txt"
mps_start
for round in 1 2; do
  for t in 1 2 4 8 12; do
    tag="threads$t-r$round"
    timeout 60 "$v" bench --backend BOUNCE --label "$tag" --param enable_peer_map=false \
      --param peer_map_prepare_threads=$t --sizes 4096 --counts 16384 --concurrent 0 \
      --iters 30 >"$work/$tag.log" 2>&1
    echo "$tag rc=$?" >>"$summary"
    grep -h "inflight\|preparation" "$work/$tag.log" | cut -c1-160
    pack
  done
done
mps_stop
nproc; cat "$summary"
