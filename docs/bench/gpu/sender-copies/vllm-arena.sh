#!/usr/bin/env bash
# vLLM's pattern (official Python API, prepare timed, READs with a
# notification) over the bounce arena (--bounce-param enable_peer_map=false,
# no MPS): the plan's packed copies (new: the reader's READ encoded and its
# scatter tables filled from them) against runs (old, carried as
# .gpu/old/libplugin_BOUNCE.so); TP=4 at 128 and 8192 tokens,
# two rounds alternating. Needs .gpu and .py312 carried.
set -uo pipefail
source .gpu/run.sh python
out="${OUT:-/tmp/out}"; mkdir -p "$out"
new="$NIXL_PLUGIN_DIR"
old="$new/../plugins_old"; rm -rf "$old"; cp -a "$new" "$old"
cp .gpu/old/libplugin_BOUNCE.so "$old/"
for round in 1 2; do
  for k in old new; do
    dir=$new; [[ $k == old ]] && dir=$old
    echo "== $k round $round" >>"$out/vllm-arena.log"
    NIXL_PLUGIN_DIR=$dir timeout 150 python3 bench/vllm_pattern.py --device cuda --backends BOUNCE \
      --cases tp4-128,tp4-8k --iters 15 --bounce-param enable_peer_map=false \
      >>"$out/vllm-arena.log" 2>&1 || echo "$k round $round rc=$?" >>"$out/vllm-arena.log"
  done
done
grep -E "^== |^BOUNCE |rc=" "$out/vllm-arena.log" | cut -c1-240
