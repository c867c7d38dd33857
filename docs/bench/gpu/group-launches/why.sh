#!/usr/bin/env bash
# Which copies the IO threads launch together, and why others go alone:
# a lone 16,384 x 4 KiB arena WRITE (4 chunks, gathered eagerly) under
# MPS with the copy engine's debug log on, the log lines counted. Then a
# lone 1024 x 4 KiB WRITE, group_copy_launches off and on alternating, 4
# rounds (nothing is grouped there: any difference is the spread).
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out"
source .gpu/run.sh python
v=/tmp/nixl-bounce-gpu/bin/bounce-vram
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
NIXL_BOUNCE_LOG="warn,nixl_bounce::copy=debug,nixl_bounce::runtime=trace" timeout 120 "$v" bench \
  --backend BOUNCE --label why --param enable_peer_map=false --sizes 4096 --counts 16384 \
  --concurrent 0 --iters 8 >"$out/why.log" 2>&1
grep -oE "not launched together: [a-z ]+|launching the pass's copies.*copies=[0-9]+" "$out/why.log" \
  | sed -E 's/.*copies=/copies=/' | sort | uniq -c >"$out/why-summary.txt"
grep -E "inflight|together with others" "$out/why.log" >>"$out/why-summary.txt"
for round in 1 2 3 4; do
  for k in off on; do
    timeout 60 "$v" bench --backend BOUNCE --label "lone-$k-r$round" --param enable_peer_map=false \
      --param group_copy_launches=$([[ $k == on ]] && echo true || echo false) --sizes 4096 \
      --counts 1024 --concurrent 0 --iters 40 2>&1 | grep -E "inflight" >>"$out/why-summary.txt"
  done
done
echo quit | nvidia-cuda-mps-control
