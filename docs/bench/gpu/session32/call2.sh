#!/usr/bin/env bash
# Thirty-second session, device call 2: vLLM's NIXL-connector pattern
# through the official Python API (bench/vllm_pattern.py: per-layer K/V
# regions, whole-cache prepared lists, a READ per request with a
# notification, prepare timed), BOUNCE's arena path (enable_peer_map=false:
# what a reader on another host gets) against UCX as vLLM creates it,
# alternating, two processes on one GPU without MPS, at the defaults
# (8 chunks at least a request). Then the same with MPS (MPS=no: not).
# CASES, ITERS override. KEEP=DIR: DIR goes into the archive too. $OUT/all.tgz.
# From the repository root with .gpu and .py312 carried: bash THIS.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s32-call2 || exit 1
[[ -n "${KEEP:-}" ]] && cp -a "$KEEP" "$work/call1"
cases="${CASES:-tp4-128,tp4-8k,tp1-8k,tp4-2kx8}"
run_case() { # tag
  timeout 250 python3 bench/vllm_pattern.py --device cuda --cases "$cases" --iters "${ITERS:-10}" \
    --bounce-param enable_peer_map=false --json "$work/vllm-arena-$1.json" >"$work/vllm-arena-$1.log" 2>&1
  echo "vllm-arena-$1 rc=$?" | tee -a "$work/summary.txt"
  grep -hE "^==|^(BOUNCE|UCX) |speed-up" "$work/vllm-arena-$1.log" | cut -c1-250
  pack
}
run_case nomps
[[ "${MPS:-yes}" == no ]] && exit 0
mps_start
run_case mps
mps_stop
