#!/usr/bin/env bash
# Thirty-sixth session, second call (b7663c1: the arena's WRITE announced
# before its plan, its chunks taken as they are packed). 1. bounce-vram
# test over the arena (WRITEs announced, byte-exact); 2. under MPS, lone
# arena WRITEs of 1024 and 16,384 x 4 KiB and 128 x 1024 in flight,
# announce_writes on and off alternating in one plugin, three rounds.
# $OUT/all.tgz.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s36-announce || exit 1
s=$SECONDS; timeout 100 "$v" test --param enable_peer_map=false >"$work/vram-test-arena.log" 2>&1
echo "vram-test-arena rc=$? ($((SECONDS-s)) s) $(tail -1 "$work/vram-test-arena.log")" | tee -a "$summary"; pack
export BENCH_GREP='inflight\|preparation per'
mps_start
for round in 1 2 3; do
  for a in true false; do
    vbench "announce-$a-r$round" --param enable_peer_map=false --param announce_writes=$a \
      --sizes 4096 --counts 1024,16384 --concurrent 128 --iters 30
  done
done
mps_stop
cat "$summary"
