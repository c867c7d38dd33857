#!/usr/bin/env bash
# A/B on one GPU under MPS: the arena path (peer mapping off) with the
# plan's packed copies kept to the sender's pair table and DATA (new)
# against runs checked, filled and encoded per run (old, b0ab612, carried as
# .gpu/old/libplugin_BOUNCE.so). 1024 and 16,384 x 4 KiB WRITE alone and
# 128 x 1024 x 4 KiB in flight, three rounds alternating old and new
# (ROUNDS, COUNTS, CONCURRENT, ITERS and TAG change that).
# Run from the repository root with .gpu carried: bash THIS.
set -uo pipefail
nb=/tmp/nixl-bounce-gpu   # .gpu/run.sh's unpack and environment
rm -rf $nb && mkdir -p $nb && tar -C $nb -xJf .gpu/bundle.tar.xz
export NIXL_PLUGIN_DIR="$nb/site/.nixl_cu13.mesonpy.libs/plugins"
export LD_LIBRARY_PATH="$nb/site/.nixl_cu13.mesonpy.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_BOUNCE_REQUIRE_RUNTIME=1 NIXL_BOUNCE_CONTROL_BIND_LOOPBACK=1
out="${OUT:-/tmp/out}"; mkdir -p "$out"
v=/tmp/nixl-bounce-gpu/bin/bounce-vram
new="$NIXL_PLUGIN_DIR"
old="$new/../plugins_old"; rm -rf "$old"; cp -a "$new" "$old"
cp .gpu/old/libplugin_BOUNCE.so "$old/"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
tag=${TAG:-ab}
for round in $(seq "${ROUNDS:-3}"); do
  for k in old new; do
    dir=$new; [[ $k == old ]] && dir=$old
    NIXL_PLUGIN_DIR=$dir timeout 120 "$v" bench --backend BOUNCE --label "arena-$k-r$round" \
      --param enable_peer_map=false --sizes 4096 --counts "${COUNTS:-1024,16384}" \
      --concurrent "${CONCURRENT:-128}" --iters "${ITERS:-40}" >>"$out/$tag.log" 2>&1 \
      || echo "arena-$k-r$round rc=$?" >>"$out/$tag.log"
  done
done
echo quit | nvidia-cuda-mps-control
grep -E "inflight|rc=|launch steps|per request|control per" "$out/$tag.log" | cut -c1-250 >"$out/$tag-summary.txt"
