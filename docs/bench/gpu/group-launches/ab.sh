#!/usr/bin/env bash
# A/B on one GPU: the arena path (peer mapping off), the IO thread's copy
# launches grouped (one launch for the gathers, one for the scatters it
# launches in one pass; the default) against one launch per chunk
# (--param group_copy_launches=false), the same build, alternating.
#  1. under MPS, bounce-vram bench: 1024 and 16,384 x 4 KiB WRITE alone and
#     128 x 1024 x 4 KiB in flight, ROUNDS rounds (default 3);
#  2. no MPS, vLLM's pattern over the arena (official Python API, prepare
#     timed, READ + notification), TP=4 at 128 and 8192 tokens and 8 x 2048
#     tokens in flight (VLLM_CASES), 2 rounds (needs .py312 carried);
#  3. the arena's byte-exact tests and fault drills with the default.
# Run from the repository root with .gpu (and .py312) carried: bash THIS.
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out"
source .gpu/run.sh python   # unpacks the bundle; the Python API's environment
v=/tmp/nixl-bounce-gpu/bin/bounce-vram
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
for round in $(seq "${ROUNDS:-3}"); do
  for k in off on; do
    timeout 120 "$v" bench --backend BOUNCE --label "arena-$k-r$round" \
      --param enable_peer_map=false --param group_copy_launches=$([[ $k == on ]] && echo true || echo false) \
      --sizes 4096 --counts "${COUNTS:-1024,16384}" --concurrent "${CONCURRENT:-128}" \
      --iters "${ITERS:-40}" >>"$out/ab.log" 2>&1 || echo "arena-$k-r$round rc=$?" >>"$out/ab.log"
  done
done
echo quit | nvidia-cuda-mps-control
grep -E "inflight|rc=|launch steps|per request|control per|together with others" "$out/ab.log" | cut -c1-250 >"$out/ab-summary.txt"
if [[ "${VLLM:-1}" == 1 ]]; then
  for round in 1 2; do
    for k in off on; do
      echo "== $k round $round" >>"$out/vllm-arena.log"
      timeout 150 python3 bench/vllm_pattern.py --device cuda --backends BOUNCE \
        --cases "${VLLM_CASES:-tp4-128,tp4-8k,tp4-2kx8}" --iters "${VLLM_ITERS:-12}" --bounce-param enable_peer_map=false \
        --bounce-param group_copy_launches=$([[ $k == on ]] && echo true || echo false) \
        >>"$out/vllm-arena.log" 2>&1 || echo "$k round $round rc=$?" >>"$out/vllm-arena.log"
    done
  done
  grep -E "^== |^BOUNCE |rc=" "$out/vllm-arena.log" | cut -c1-240 >"$out/vllm-arena-summary.txt"
fi
if [[ "${TESTS:-1}" == 1 ]]; then
  nb=/tmp/nixl-bounce-gpu
  for t in "gpu_kernels $nb/bin/gpu_kernels --test-threads=1" \
           "vram-test-arena $v test --param enable_peer_map=false" \
           "vram-faults $v faults --buffer 268435456"; do
    set -- $t; name=$1; shift
    if "$@" >"$out/$name.log" 2>&1; then echo "$name ok" >>"$out/tests-summary.txt"
    else echo "$name FAILED rc=$?" >>"$out/tests-summary.txt"; tail -30 "$out/$name.log" >>"$out/tests-summary.txt"; fi
  done
fi
