#!/usr/bin/env bash
# Thirty-fifth session, second call: the arena's chunks packed in slices
# (5dffbb1, the bundle) against whole-chunk parts (fa69086, .gpu/old/
# mid.so, which has the kernels' one tile walk too). 1. bounce-vram test
# over the arena (the sliced plan end to end, byte-exact); 2. prep_cost on
# this host's cores (.gpu/extra/libtests: whole-chunk parts against
# Checked::in_parts itself, scattered and in order); 3. lone arena WRITEs
# under MPS, 8192 and 16,384 x 4 KiB, the two plugins alternating, three
# rounds; 4. vLLM's pattern over the arena through the Python API (BOUNCE
# alone, TP=4 at 8192 tokens and 8 in flight at 2048), the two plugins
# alternating, two rounds. $OUT/all.tgz.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s35-slices || exit 1
s=$SECONDS; timeout 120 "$v" test --param enable_peer_map=false >"$work/vram-test-arena.log" 2>&1
echo "vram-test-arena rc=$? ($((SECONDS-s)) s)" | tee -a "$summary"; pack
for o in 0 1; do
  PREP_IN_ORDER=$o PREP_THREADS=8 timeout 60 .gpu/extra/libtests prep_cost --ignored --nocapture 2>&1 \
    | grep "prep_cost \|panicked" | tee -a "$work/prep-cost.txt"
done
pack
export BENCH_GREP='inflight\|preparation per'
new=$NIXL_PLUGIN_DIR mid=$(old_plugin_dir mid.so)
mps_start
for round in 1 2 3; do
  for k in mid new; do
    NIXL_PLUGIN_DIR=${!k} vbench "arena-$k-r$round" --param enable_peer_map=false \
      --sizes 4096 --counts 8192,16384 --iters 30
  done
done
mps_stop
for round in 1 2; do
  for k in mid new; do
    NIXL_PLUGIN_DIR=${!k} timeout 120 python3 bench/vllm_pattern.py --device cuda --backends BOUNCE \
      --cases tp4-8k,tp4-2kx8 --iters 10 --bounce-param enable_peer_map=false \
      --json "$work/vllm-$k-r$round.json" >"$work/vllm-$k-r$round.log" 2>&1
    echo "vllm-$k-r$round rc=$?" | tee -a "$summary"
    grep -hE "^==|^BOUNCE |plugin" "$work/vllm-$k-r$round.log" | cut -c1-200
    pack
  done
done
cat "$summary"
