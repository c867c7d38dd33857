#!/usr/bin/env bash
# Byte-exact checks of the arena path on the GPU after the sender's packed
# copies: bounce-vram test with peer mapping off (WRITE and READ, VRAM on
# both sides, two processes), and the kernel tests (gather and scatter
# from copies). Run after ab.sh (which unpacks the bundle).
set -uo pipefail
nb=/tmp/nixl-bounce-gpu
export NIXL_PLUGIN_DIR="$nb/site/.nixl_cu13.mesonpy.libs/plugins"
export LD_LIBRARY_PATH="$nb/site/.nixl_cu13.mesonpy.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_BOUNCE_REQUIRE_RUNTIME=1 NIXL_BOUNCE_CONTROL_BIND_LOOPBACK=1
out="${OUT:-/tmp/out}"; mkdir -p "$out"
timeout 180 $nb/bin/bounce-vram test --param enable_peer_map=false >"$out/vram-test-arena.log" 2>&1
echo "vram-test-arena rc=$?"
timeout 120 $nb/bin/gpu_kernels --test-threads 1 >"$out/gpu_kernels.log" 2>&1
echo "gpu_kernels rc=$?"; grep -E "test result" "$out/gpu_kernels.log"
grep -E "ok|FAIL|passed|bounce" "$out/vram-test-arena.log" | tail -12
