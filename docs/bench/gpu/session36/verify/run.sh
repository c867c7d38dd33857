#!/usr/bin/env bash
# Thirty-sixth session, first call (53fe960: the sliced chunks after the
# review's mends, never yet on a GPU). 1. every GPU test binary, bounce-vram
# test on both paths and with notification control, the fault drills;
# 2. prep_cost on this host's cores (scattered and in order); 3. issue 15's
# arena shapes under MPS (1024, 16,384 x 4 KiB lone; 128 x 1024 in flight),
# two rounds. $OUT/all.tgz.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s36-verify || exit 1
step() {  # step NAME LIMIT CMD...: log to $work/NAME.log, rc and seconds into the summary
    local name=$1 limit=$2 s=$SECONDS; shift 2
    timeout "$limit" "$@" >"$work/$name.log" 2>&1
    echo "$name rc=$? ($((SECONDS-s)) s) $(grep -h 'test result\|passed, ' "$work/$name.log" | tail -1)" | tee -a "$summary"
    pack
}
for t in /tmp/nixl-bounce-gpu/bin/gpu_*; do step "$(basename "$t")" 90 "$t" --test-threads=1; done
step vram-test 100 "$v" test
step vram-test-arena 100 "$v" test --param enable_peer_map=false
step vram-test-notif 100 "$v" test --param enable_peer_map=false --param use_nixl_notifications=true
step vram-faults 150 "$v" faults --buffer 268435456
prep_costs
export BENCH_GREP='inflight\|preparation per\|^ *4096 '
mps_start
for round in 1 2; do
  vbench "arena-r$round" --param enable_peer_map=false --sizes 4096 --counts 1024,16384 --concurrent 128 --iters 30
done
mps_stop
cat "$summary"
