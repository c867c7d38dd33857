#!/usr/bin/env bash
# Peer-mapped path, two processes on one H200: 1024 x 4 KiB alone and 128
# such requests in flight, at the defaults and with the table uploaded
# and/or prepared in createXferReq, two rounds alternating. The concurrent
# row says how long the 128 posts alone took, to tell a posting-bound run
# from a copy-bound one. Run: source .gpu/run.sh python; bash THIS
v=/tmp/nixl-bounce-gpu/bin/bounce-vram
out="${OUT:-/tmp/out}"
variants=(
  "default|"
  "upload|--param peer_map_inline_table_max_descriptors=0"
  "prepared|--param prepare_at_post=false"
  "prepared-upload|--param prepare_at_post=false --param peer_map_inline_table_max_descriptors=0"
)
for round in 1 2; do
  for x in "${variants[@]}"; do
    name=${x%%|*}; args=${x#*|}
    # shellcheck disable=SC2086
    timeout 60 "$v" bench --backend BOUNCE --label "$name" --sizes 4096 --counts 1024 \
      --concurrent 128 --iters 40 $args >"$out/conc-$name-$round.log" 2>&1
    grep -E "inflight|posting" "$out/conc-$name-$round.log" | sed "s/^/r$round /"
  done
done | tee "$out/conc-summary.txt"
