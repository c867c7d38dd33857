#!/usr/bin/env bash
# Thirty-first session, one device call, with the working tree's plugin
# (copies-first packing, min_chunks_per_request 8 by default) and the one
# before it (4e79de1, carried as .gpu/old/libplugin_BOUNCE.so):
# 1. lone arena WRITEs under MPS, 1024 and 16,384 x 4 KiB, and 128
#    requests of 1024 x 4 KiB in flight, old and new plugin alternating,
#    both cut into 8 chunks (so that only the packing differs), two
#    rounds: the plugin's preparation per request, p50;
# 2. `bounce-vram test` over the arena with the new plugin (byte-exact).
# Everything lands in $OUT/all.tgz, re-packed after each stage. Run from
# the repository root with .gpu carried: bash THIS.
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out"
work=/tmp/call5; rm -rf "$work"; mkdir -p "$work"
pack() { tar czf "$out/all.tgz" -C "$work" . 2>/dev/null; }
source .gpu/run.sh python   # unpacks the bundle; the environment
v=/tmp/nixl-bounce-gpu/bin/bounce-vram
new="$NIXL_PLUGIN_DIR"; old="$new/../plugins_old"; rm -rf "$old"; cp -a "$new" "$old"
cp .gpu/old/libplugin_BOUNCE.so "$old/"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$work/gpu.txt" 2>&1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
bench() { # tag, plugin dir, extra args...
  local tag=$1 dir=$2; shift 2
  NIXL_PLUGIN_DIR=$dir timeout 100 "$v" bench --backend BOUNCE --label "$tag" --param enable_peer_map=false \
    --sizes 4096 "$@" >"$work/bench-$tag.log" 2>&1
  grep -h "inflight\|preparation" "$work/bench-$tag.log" | cut -c1-170
  pack
}
for round in 1 2; do
  for k in old new; do
    dir=$new; [[ $k == old ]] && dir=$old
    bench "$k-r$round" "$dir" --param min_chunks_per_request=8 --counts 1024,16384 --concurrent 128 --iters 20
  done
done
echo quit | nvidia-cuda-mps-control
s=$SECONDS; timeout 120 "$v" test --param enable_peer_map=false >"$work/vram-test-arena.log" 2>&1
echo "vram-test-arena rc=$? ($((SECONDS-s)) s)" | tee "$work/tests-summary.txt"; pack
