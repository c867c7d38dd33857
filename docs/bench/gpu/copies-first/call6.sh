#!/usr/bin/env bash
# The short form of call5.sh for the session's last device time: the
# arena's `bounce-vram test` with the new plugin (byte-exact), then one
# lone 16,384 x 4 KiB arena WRITE benchmark under MPS with the old plugin
# and one with the new, 8 chunks both. $OUT/all.tgz. Run from the
# repository root with .gpu carried: bash THIS.
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out"
work=/tmp/call6; rm -rf "$work"; mkdir -p "$work"
pack() { tar czf "$out/all.tgz" -C "$work" . 2>/dev/null; }
source .gpu/run.sh python
v=/tmp/nixl-bounce-gpu/bin/bounce-vram
new="$NIXL_PLUGIN_DIR"; old="$new/../plugins_old"; rm -rf "$old"; cp -a "$new" "$old"
cp .gpu/old/libplugin_BOUNCE.so "$old/"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$work/gpu.txt" 2>&1
s=$SECONDS; timeout 70 "$v" test --param enable_peer_map=false >"$work/vram-test-arena.log" 2>&1
echo "vram-test-arena rc=$? ($((SECONDS-s)) s)" | tee "$work/tests-summary.txt"; pack
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
for k in old new; do
  dir=$new; [[ $k == old ]] && dir=$old
  NIXL_PLUGIN_DIR=$dir timeout 40 "$v" bench --backend BOUNCE --label "$k" --param enable_peer_map=false \
    --param min_chunks_per_request=8 --sizes 4096 --counts 1024,16384 --concurrent 0 --iters 15 >"$work/bench-$k.log" 2>&1
  grep -h "inflight\|preparation" "$work/bench-$k.log" | cut -c1-170
  pack
done
echo quit | nvidia-cuda-mps-control
