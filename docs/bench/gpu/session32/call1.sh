#!/usr/bin/env bash
# Thirty-second session, device call 1 (what the thirty-first's
# copies-first/call5.sh and call6.sh, never run and now removed, were to
# run, and call4.sh's kernel-timed trace), at the working tree's plugin:
# 1. byte-exact: `bounce-vram test` over the arena (copies-first packing,
#    the bounded receive pass and the launch rule had not run on a GPU);
# 2. under MPS, lone arena WRITEs of 1024 and 16,384 x 4 KiB and 128
#    requests of 1024 x 4 KiB in flight, alternating, 8 chunks all, two
#    rounds: old (4e79de1, before copies first; .gpu/old/libplugin_BOUNCE.so),
#    pre (379ad56: copies first, the receive pass bounded at 25 us, the
#    DATA decoded faster; .gpu/old/prenagle.so) and new (the tree: a copy
#    launched at once when none of its direction runs); preparation per
#    request, p50, the launch steps;
# 3. traced lone 16,384 x 4 KiB at 8 chunks with the kernels timed
#    (NIXL_BOUNCE_TIME_KERNELS), new.
# 4. call2.sh's vLLM-pattern run, shorter, if time is left (its own
#    $OUT/all.tgz replaces this one's only when it gets that far: it packs
#    /tmp/s32-call2, so this call's logs are copied there first).
# $OUT/all.tgz. From the repository root: bash THIS.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s32-call1 || exit 1
new=$NIXL_PLUGIN_DIR
old=$(old_plugin_dir)
pre=$(old_plugin_dir prenagle.so)
for t in "arena --param enable_peer_map=false"; do
  set -- $t; name=$1; shift
  s=$SECONDS; timeout 90 "$v" test "$@" >"$work/vram-test-$name.log" 2>&1
  echo "vram-test-$name rc=$? ($((SECONDS-s)) s)" | tee -a "$work/tests-summary.txt"; pack
done
mps_start
for round in $(seq "${ROUNDS:-2}"); do
  for k in old pre new; do
    dir=${!k}
    s=$SECONDS
    NIXL_PLUGIN_DIR=$dir timeout 100 "$v" bench --backend BOUNCE --label "$k-r$round" \
      --param enable_peer_map=false --param min_chunks_per_request=8 --sizes 4096 \
      --counts 1024,16384 --concurrent 128 --iters "${ITERS:-15}" >"$work/bench-$k-r$round.log" 2>&1
    echo "bench-$k-r$round rc=$? ($((SECONDS-s)) s)" >>"$work/tests-summary.txt"
    grep -h "inflight\|preparation\|launch steps" "$work/bench-$k-r$round.log" | cut -c1-170
    pack
  done
done
for k in new; do
  rm -rf /tmp/bounce-trace && mkdir -p /tmp/bounce-trace
  NIXL_PLUGIN_DIR=${!k} NIXL_BOUNCE_TIME_KERNELS=1 NIXL_BOUNCE_TRACE=/tmp/bounce-trace timeout 100 "$v" bench \
    --backend BOUNCE --label "traced-$k" --param enable_peer_map=false --param min_chunks_per_request=8 \
    --sizes 4096 --counts 16384 --concurrent 0 --iters 30 >"$work/bench-traced-$k.log" 2>&1
  python3 bench/trace_report.py /tmp/bounce-trace --requests 5: >"$work/trace-$k.txt" 2>&1
  grep -h "inflight\|kernel\|launch steps" "$work/bench-traced-$k.log" | cut -c1-200
  pack
done
mps_stop
cat "$work/tests-summary.txt"
# 4. if time is left: vLLM's pattern over the arena against UCX (call2.sh's
#    first stage, shorter), without MPS.
cp -a "$work" /tmp/s32-call1-keep
KEEP=/tmp/s32-call1-keep ITERS=8 CASES=tp4-8k,tp4-2kx8 MPS=no bash docs/bench/gpu/session32/call2.sh
