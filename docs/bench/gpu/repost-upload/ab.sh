#!/usr/bin/env bash
# A/B on one GPU, two processes, the peer-mapped path: tables uploaded
# when the request is prepared in prepXfer and at a request's second post
# (new) against the table form chosen by size alone (old, carried as
# .gpu/old/libplugin_BOUNCE.so). Three ways to drive it, alternating old
# and new in ROUNDS rounds (default 2):
#   default   a new request each iteration, prepared at its first post
#   prepared  a new request each iteration, prepared in createXferReq
#             (--param prepare_at_post=false)
#   repost    one request per shape posted every iteration (--repost)
# 1024 and 16,384 x 4 KiB alone, and 128 x 1024 x 4 KiB in flight (the
# row that says how long the 128 posts took). Then the peer-mapped tests
# of the new build. Run from the repository root with .gpu carried.
set -uo pipefail
nb=/tmp/nixl-bounce-gpu   # .gpu/run.sh's unpack and environment
rm -rf $nb && mkdir -p $nb && tar -C $nb -xJf .gpu/bundle.tar.xz
export NIXL_PLUGIN_DIR="$nb/site/.nixl_cu13.mesonpy.libs/plugins"
export LD_LIBRARY_PATH="$nb/site/.nixl_cu13.mesonpy.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_BOUNCE_REQUIRE_RUNTIME=1 NIXL_BOUNCE_CONTROL_BIND_LOOPBACK=1
out="${OUT:-/tmp/out}"; mkdir -p "$out"
v=$nb/bin/bounce-vram
new="$NIXL_PLUGIN_DIR"
old="$new/../plugins_old"; rm -rf "$old"; cp -a "$new" "$old"
cp .gpu/old/libplugin_BOUNCE.so "$old/"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/gpu.txt"
variants=(
  "default|"
  "prepared|--param prepare_at_post=false"
  "repost|--repost"
)
for round in $(seq "${ROUNDS:-2}"); do
  for x in "${variants[@]}"; do
    name=${x%%|*}; args=${x#*|}
    for k in old new; do
      dir=$new; [[ $k == old ]] && dir=$old
      # shellcheck disable=SC2086
      NIXL_PLUGIN_DIR=$dir timeout 90 "$v" bench --backend BOUNCE --label "$name-$k-r$round" \
        --sizes 4096 --counts "${COUNTS:-1024,16384}" --concurrent 128 --iters "${ITERS:-40}" \
        $args >>"$out/ab.log" 2>&1 || echo "$name-$k-r$round rc=$?" >>"$out/ab.log"
    done
  done
done
grep -E "^(default|prepared|repost)-|posting|rc=" "$out/ab.log" | cut -c1-200 >"$out/ab-summary.txt"
if [[ -z "${NO_TESTS:-}" ]]; then
  timeout 240 $nb/bin/gpu_peer_map --nocapture --test-threads 1 >"$out/gpu_peer_map.log" 2>&1
  echo "gpu_peer_map rc=$?" >>"$out/ab-summary.txt"
  grep -E "^test |test result|posted 4 times" "$out/gpu_peer_map.log" >>"$out/ab-summary.txt"
fi
cat "$out/ab-summary.txt"
