#!/usr/bin/env bash
# Thirty-third session: which of the reactor's launch knobs moves a lone
# 16,384 x 4 KiB arena WRITE under MPS (the trace of call1 put ~200 us
# between the last chunk write and completion, the receiver's IO thread
# launching each scatter alone, ~15-30 us of driver calls a launch):
# the defaults, receive_pass_us=0 (read until none is ready: more DATAs
# per grouped launch), copy_launches_last=true (launch only when nothing
# else waits), group_copy_launches=false (one launch a chunk);
# alternating, ROUNDS rounds (2), ITERS (20) each. $OUT/all.tgz.
# From the repository root, .gpu and .py312 carried: bash THIS.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s33-knobs || exit 1
mps_start
variants=("default" "receive_pass_us=0" "copy_launches_last=true" "group_copy_launches=false")
for round in $(seq "${ROUNDS:-2}"); do
  for k in "${variants[@]}"; do
    p=(); [[ $k != default ]] && p=(--param "$k")
    tag="${k%%=*}-r$round"
    timeout 60 "$v" bench --backend BOUNCE --label "$tag" --param enable_peer_map=false "${p[@]}" \
      --sizes 4096 --counts 16384 --concurrent 0 --iters "${ITERS:-20}" >"$work/bench-$tag.log" 2>&1
    echo "bench-$tag rc=$?" >>"$work/summary.txt"
    grep -h "inflight" "$work/bench-$tag.log" | cut -c1-130
    pack
  done
done
mps_stop
cat "$work/summary.txt"
