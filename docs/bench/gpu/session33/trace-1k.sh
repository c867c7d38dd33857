#!/usr/bin/env bash
# Thirty-third session: a lone 1024 x 4 KiB arena WRITE under MPS, traced
# (NIXL_BOUNCE_TRACE) with the kernels timed, for issue 15's 150 us
# target's breakdown. $OUT/all.tgz. From the repository root, .gpu and
# .py312 carried: bash THIS.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s33-t1k || exit 1
mps_start
rm -rf /tmp/bt && mkdir -p /tmp/bt
NIXL_BOUNCE_TIME_KERNELS=1 NIXL_BOUNCE_TRACE=/tmp/bt timeout 60 "$v" bench --backend BOUNCE --label traced-1k \
  --param enable_peer_map=false --sizes 4096 --counts 1024 --concurrent 0 --iters 30 >"$work/bench-traced-1k.log" 2>&1
python3 bench/trace_report.py /tmp/bt --requests 5: >"$work/trace-1k.txt" 2>&1
mps_stop
pack
grep -h "inflight\|kernel\|launch steps\|preparation" "$work/bench-traced-1k.log" | cut -c1-200
head -50 "$work/trace-1k.txt"
