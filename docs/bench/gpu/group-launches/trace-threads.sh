#!/usr/bin/env bash
# Under MPS, the timeline (NIXL_BOUNCE_TRACE) of a lone 16,384 x 4 KiB
# arena WRITE with the preparation's helper threads at their default (woken
# in createXferReq, polling up to 300 us) and with none
# (peer_map_prepare_threads=1), alternating, 2 rounds: do the woken
# threads delay the IO threads (a GRANT read ~100 us after it arrives)?
# Run from the repository root with .gpu and .py312 carried: bash THIS.
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out"
source .gpu/run.sh python   # unpacks the bundle; the environment
v=/tmp/nixl-bounce-gpu/bin/bounce-vram
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
for round in 1 2; do
  for threads in 0 1; do
    tag="threads$threads-r$round"
    rm -rf /tmp/bounce-trace && mkdir -p /tmp/bounce-trace
    NIXL_BOUNCE_TRACE=/tmp/bounce-trace timeout 120 "$v" bench --backend BOUNCE --label "arena-$tag" \
      --param enable_peer_map=false --param peer_map_prepare_threads=$threads \
      --sizes 4096 --counts 16384 --concurrent 0 --iters 30 >"$out/trace-bench-$tag.log" 2>&1
    python3 bench/trace_report.py /tmp/bounce-trace --requests 5: >"$out/trace-$tag.txt" 2>&1
  done
done
echo quit | nvidia-cuda-mps-control
for f in "$out"/trace-bench-threads*.log; do grep -E "inflight|together with others" "$f"; done >"$out/trace-threads-summary.txt"
for f in "$out"/trace-threads*.txt; do echo "== $f"; grep -E "submit|GRANT|gather_done|complete" "$f"; done >>"$out/trace-threads-summary.txt"
