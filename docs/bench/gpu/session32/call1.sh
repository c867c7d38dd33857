#!/usr/bin/env bash
# Thirty-second session, device call 1 (what the thirty-first's call4.sh
# and call5.sh were to run), at the working tree's plugin:
# 1. byte-exact: `bounce-vram test` over the arena and at the defaults
#    (copies-first packing had not run on a GPU);
# 2. under MPS, lone arena WRITEs of 1024 and 16,384 x 4 KiB and 128
#    requests of 1024 x 4 KiB in flight, the old plugin (4e79de1, before
#    copies first; .gpu/old), the new with receive_pass_us=0 (as before)
#    and the new at its defaults, alternating, 8 chunks all, two rounds:
#    preparation per request, p50, the launch steps;
# 3. traced lone 16,384 x 4 KiB at 8 chunks with the kernels timed
#    (NIXL_BOUNCE_TIME_KERNELS): receive_pass_us 25 (the new default) and
#    0 (a pass reads until no message is ready, as before), then
#    chunk_writes=io_thread.
# $OUT/all.tgz. From the repository root: bash THIS.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s32-call1 || exit 1
old=$(old_plugin_dir)
for t in "arena --param enable_peer_map=false" "defaults"; do
  set -- $t; name=$1; shift
  s=$SECONDS; timeout 90 "$v" test "$@" >"$work/vram-test-$name.log" 2>&1
  echo "vram-test-$name rc=$? ($((SECONDS-s)) s)" | tee -a "$work/tests-summary.txt"; pack
done
mps_start
for round in 1 2; do
  for k in old new-pass0 new; do
    dir=$NIXL_PLUGIN_DIR; [[ $k == old ]] && dir=$old
    pass=25; [[ $k == new-pass0 ]] && pass=0
    extra=(); [[ $k != old ]] && extra=(--param receive_pass_us=$pass)
    NIXL_PLUGIN_DIR=$dir timeout 100 "$v" bench --backend BOUNCE --label "$k-r$round" \
      --param enable_peer_map=false --param min_chunks_per_request=8 "${extra[@]}" --sizes 4096 \
      --counts 1024,16384 --concurrent 128 --iters 15 >"$work/bench-$k-r$round.log" 2>&1
    grep -h "inflight\|preparation\|launch steps" "$work/bench-$k-r$round.log" | cut -c1-170
    pack
  done
done
for t in "pass25 receive_pass_us=25" "pass0 receive_pass_us=0" "iowrites chunk_writes=io_thread"; do
  set -- $t; tag=$1; p=$2
  rm -rf /tmp/bounce-trace && mkdir -p /tmp/bounce-trace
  NIXL_BOUNCE_TIME_KERNELS=1 NIXL_BOUNCE_TRACE=/tmp/bounce-trace timeout 100 "$v" bench --backend BOUNCE \
    --label "traced-$tag" --param enable_peer_map=false --param min_chunks_per_request=8 \
    --param "$p" --sizes 4096 --counts 16384 --concurrent 0 --iters 30 \
    >"$work/bench-traced-$tag.log" 2>&1
  python3 bench/trace_report.py /tmp/bounce-trace --requests 5: >"$work/trace-$tag.txt" 2>&1
  grep -h "inflight\|kernel\|launch steps" "$work/bench-traced-$tag.log" | cut -c1-200
  pack
done
mps_stop
cat "$work/tests-summary.txt"
