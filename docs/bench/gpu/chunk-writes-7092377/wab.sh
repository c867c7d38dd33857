#!/usr/bin/env bash
# Chunk writes: writer thread against auto (IO thread when idle), the arena, one device call.
set -uo pipefail
R=$(pwd)
source .gpu/run.sh python >/dev/null 2>&1
cd "$R"
v=/tmp/nixl-bounce-gpu/bin/bounce-vram
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
for round in 1 2; do
  for w in writer_thread auto; do
    $v bench --backend BOUNCE --label "arena-$w-r$round" --param enable_peer_map=false --param chunk_writes=$w \
      --sizes 4096 --counts 1024,16384 --concurrent 128 --iters 30 >> $OUT/mps.log 2>&1
  done
  $v bench --backend BOUNCE --label "arena-auto-prepxfer-r$round" --param enable_peer_map=false --param prepare_at_post=false \
      --sizes 4096 --counts 1024,16384 --concurrent 0 --iters 30 >> $OUT/mps.log 2>&1
done
$v test --param enable_peer_map=false > $OUT/vram-test.log 2>&1; echo "vram-test-arena (auto) rc=$?" >> $OUT/summary.txt
$v test --param enable_peer_map=false --param chunk_writes=io_thread >> $OUT/vram-test.log 2>&1; echo "vram-test-arena (io_thread) rc=$?" >> $OUT/summary.txt
echo quit | nvidia-cuda-mps-control
for w in writer_thread auto; do
  $v bench --backend BOUNCE --label "nomps-arena-$w" --param enable_peer_map=false --param chunk_writes=$w \
      --sizes 4096 --counts 1024,16384 --concurrent 128 --iters 30 >> $OUT/nomps.log 2>&1
done
for w in writer_thread auto; do
  python3 bench/vllm_pattern.py --device cuda --cases tp4-128,tp4-8k --iters 20 --backends BOUNCE --bounce-param enable_peer_map=false \
    --bounce-param chunk_writes=$w >> $OUT/vllm-arena.log 2>&1
done
grep -hE "x |GRANT|grant|per request" $OUT/mps.log $OUT/nomps.log | grep -v counters | head -120
grep -E "^BOUNCE|^== " $OUT/vllm-arena.log | head -20
cat $OUT/summary.txt
