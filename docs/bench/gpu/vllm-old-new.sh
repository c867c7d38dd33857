#!/usr/bin/env bash
# vLLM's pattern (official Python API, prepare timed) with the old plugin
# (carried as .gpu/old/libplugin_BOUNCE.so) and the new one alternating,
# TP=4 at 128 and 8192 tokens, two rounds. Usage (from the repository root,
# .gpu and .py312 carried): bash THIS TAG [vllm_pattern.py options...];
# the log is $OUT/TAG.log. Shared by the A/B scripts beside it.
set -uo pipefail
tag=$1; shift
source .gpu/run.sh python
out="${OUT:-/tmp/out}"; mkdir -p "$out"
new="$NIXL_PLUGIN_DIR"
old="$new/../plugins_old"; rm -rf "$old"; cp -a "$new" "$old"
cp .gpu/old/libplugin_BOUNCE.so "$old/"
for round in 1 2; do
  for k in old new; do
    dir=$new; [[ $k == old ]] && dir=$old
    echo "== $k round $round" >>"$out/$tag.log"
    NIXL_PLUGIN_DIR=$dir timeout 150 python3 bench/vllm_pattern.py --device cuda --backends BOUNCE \
      --cases tp4-128,tp4-8k --iters 15 "$@" >>"$out/$tag.log" 2>&1 \
      || echo "$k round $round rc=$?" >>"$out/$tag.log"
  done
done
grep -E "^== |^BOUNCE |rc=" "$out/$tag.log" | cut -c1-240
