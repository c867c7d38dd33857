#!/usr/bin/env bash
# vLLM's pattern (official Python API, prepare timed) with BOUNCE's
# preparation in make_prepped_xfer (prepare_at_post=false): tables uploaded
# there (new) against small ones as the launch's parameter (old, carried as
# .gpu/old/libplugin_BOUNCE.so); 128 and 8192 tokens at TP=4, two rounds
# alternating. Needs .gpu and .py312 carried.
set -uo pipefail
source .gpu/run.sh python
out="${OUT:-/tmp/out}"; mkdir -p "$out"
new="$NIXL_PLUGIN_DIR"
old="$new/../plugins_old"; rm -rf "$old"; cp -a "$new" "$old"
cp .gpu/old/libplugin_BOUNCE.so "$old/"
for round in 1 2; do
  for k in old new; do
    dir=$new; [[ $k == old ]] && dir=$old
    echo "== $k round $round" >>"$out/vllm-prepared.log"
    NIXL_PLUGIN_DIR=$dir timeout 150 python3 bench/vllm_pattern.py --device cuda --backends BOUNCE \
      --cases tp4-128,tp4-8k --iters 15 --bounce-param prepare_at_post=false >>"$out/vllm-prepared.log" 2>&1 \
      || echo "$k round $round rc=$?" >>"$out/vllm-prepared.log"
  done
done
grep -E "^== |^BOUNCE |rc=" "$out/vllm-prepared.log" | cut -c1-220
