#!/usr/bin/env bash
# Thirty-fourth session: the plan without branches (48c62d6, in the tree's
# plugin) against 3355d8d's plugin before it (.gpu/old/libplugin_BOUNCE.so,
# built in a worktree, stripped and copied there after `scripts/gpu.sh
# pack`), alternating under MPS, two rounds, arena path, lone 1024 and
# 16,384 x 4 KiB and 128 in flight. $OUT/all.tgz.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s34-ab || exit 1
summary="$work/summary.txt"
bench() { # tag
  timeout 100 "$v" bench --backend BOUNCE --label "$1" --param enable_peer_map=false --sizes 4096 \
    --counts 1024,16384 --concurrent 128 --iters "${ITERS:-20}" >"$work/bench-$1.log" 2>&1
  echo "bench-$1 rc=$?" >>"$summary"
  grep -h "inflight\|preparation" "$work/bench-$1.log" | cut -c1-150
  pack
}
new=$NIXL_PLUGIN_DIR old=$(old_plugin_dir)
mps_start
for round in 1 2; do
  for k in old new; do NIXL_PLUGIN_DIR=${!k} bench "plan-$k-r$round"; done
done
mps_stop
cat "$summary"
