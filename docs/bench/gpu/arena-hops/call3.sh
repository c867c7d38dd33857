#!/usr/bin/env bash
# call2.sh cut to what a short device call can hold: a lone 16,384 x 4 KiB
# arena WRITE under MPS at 4 chunks (the default) and 8
# (min_chunks_per_request=8), alternating, 2 rounds, with timelines; then
# the fault drills. $OUT/all.tgz is re-packed after each stage.
# Run from the repository root with .gpu carried: bash THIS.
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out"
work=/tmp/call3; rm -rf "$work"; mkdir -p "$work"
pack() { tar czf "$out/all.tgz" -C "$work" . 2>/dev/null; }
source .gpu/run.sh python   # unpacks the bundle; the environment
v=/tmp/nixl-bounce-gpu/bin/bounce-vram
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$work/gpu.txt" 2>&1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
for round in 1 2; do
  for w in 4 8; do
    tag="w$w-r$round"
    rm -rf /tmp/bounce-trace && mkdir -p /tmp/bounce-trace
    NIXL_BOUNCE_TRACE=/tmp/bounce-trace timeout 60 "$v" bench --backend BOUNCE --label "arena-$tag" \
      --param enable_peer_map=false --param min_chunks_per_request=$w \
      --sizes 4096 --counts 16384 --concurrent 0 --iters 20 >"$work/bench-$tag.log" 2>&1
    python3 bench/trace_report.py /tmp/bounce-trace --requests 5: >"$work/trace-$tag.txt" 2>&1
    pack
    grep -h "inflight\|preparation" "$work/bench-$tag.log" | cut -c1-200
  done
done
echo quit | nvidia-cuda-mps-control
s=$SECONDS; timeout 200 "$v" faults --buffer 268435456 >"$work/vram-faults.log" 2>&1
echo "vram-faults rc=$? ($((SECONDS-s)) s)" | tee -a "$work/tests-summary.txt"; pack
