#!/usr/bin/env bash
# Thirty-fifth session, last call (ae0b544, after the review's mends):
# gpu_kernels, bounce-vram test over the arena (the sliced plan end to
# end), prep_cost (scattered and in order). $OUT/all.tgz.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s35-final || exit 1
s=$SECONDS; timeout 60 /tmp/nixl-bounce-gpu/bin/gpu_kernels --test-threads=1 >"$work/gpu_kernels.log" 2>&1
echo "gpu_kernels rc=$? ($((SECONDS-s)) s)" | tee -a "$summary"
s=$SECONDS; timeout 100 "$v" test --param enable_peer_map=false >"$work/vram-test-arena.log" 2>&1
echo "vram-test-arena rc=$? ($((SECONDS-s)) s)" | tee -a "$summary"; pack
for o in 0 1; do
  PREP_IN_ORDER=$o PREP_THREADS=8 timeout 40 .gpu/extra/libtests prep_cost --ignored --nocapture 2>&1 \
    | grep "prep_cost \|panicked" | tee -a "$work/prep-cost.txt"
done
pack
cat "$summary"; tail -1 "$work/vram-test-arena.log"; grep "test result" "$work/gpu_kernels.log"
