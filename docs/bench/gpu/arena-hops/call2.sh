#!/usr/bin/env bash
# The second device call: lone 4096 and 16,384 x 4 KiB arena WRITEs under
# MPS, their timelines now with each copy's launch (gather_launched,
# scatter_launched), at the default cut (4 chunks: 16 MiB each for 64 MiB)
# and cut finer (min_chunks_per_request=8 and 16), alternating, 2 rounds;
# then the GPU suite's stages that call1.sh's time limit cut off (fault
# drills, small arena, fallback, mixed memory).
# Everything lands in $OUT/all.tgz, re-packed after each stage.
# Run from the repository root with .gpu and .py312 carried: bash THIS.
# A shorter call (call3.sh) sets WS (chunk counts), COUNTS, ITERS, and
# SUITE=faults (the fault drills only).
set -uo pipefail
ws="${WS:-4 8 16}"; counts="${COUNTS:-4096,16384}"; iters="${ITERS:-30}"; suite="${SUITE:-all}"
out="${OUT:-/tmp/out}"; mkdir -p "$out"
work=/tmp/call2; rm -rf "$work"; mkdir -p "$work"
pack() { tar czf "$out/all.tgz" -C "$work" . 2>/dev/null; }
source .gpu/run.sh python   # unpacks the bundle; the environment
v=/tmp/nixl-bounce-gpu/bin/bounce-vram
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$work/gpu.txt" 2>&1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
for round in 1 2; do
  for w in $ws; do
    tag="w$w-r$round"
    rm -rf /tmp/bounce-trace && mkdir -p /tmp/bounce-trace
    NIXL_BOUNCE_TRACE=/tmp/bounce-trace timeout 100 "$v" bench --backend BOUNCE --label "arena-$tag" \
      --param enable_peer_map=false --param min_chunks_per_request=$w \
      --sizes 4096 --counts "$counts" --concurrent 0 --iters "$iters" >"$work/bench-$tag.log" 2>&1
    python3 bench/trace_report.py /tmp/bounce-trace --requests 5: >"$work/trace-$tag.txt" 2>&1
    pack
    grep -h "inflight\|preparation" "$work/bench-$tag.log" | cut -c1-200
  done
done
echo quit | nvidia-cuda-mps-control
st() { local name=$1; shift; local s=$SECONDS; timeout 150 "$@" >"$work/$name.log" 2>&1; echo "$name rc=$? ($((SECONDS-s)) s)" >>"$work/tests-summary.txt"; pack; }
st vram-faults "$v" faults --buffer 268435456
if [[ "$suite" == all ]]; then
  st vram-test-small-arena "$v" test --param enable_peer_map=false --param arena_size_bytes=16MiB --param max_chunk_size_bytes=2MiB
  st vram-test-fallback "$v" test --target-param enable=false --expect-fallback
  for dirs in "cuda torch-cpu" "torch-cpu cuda"; do
    set -- $dirs
    st "mixed-$1-$2" python3 bench/vllm_pattern.py --device "$1" --reader-device "$2" \
      --cases tp4-128,tp4-8k --token-scale 0.25 --iters 3 --warmup 1 --backends BOUNCE --expect-route "bounce(staged)"
  done
fi
cat "$work/tests-summary.txt"
