#!/usr/bin/env bash
# Two network namespaces, vLLM pattern, DRAM, BOUNCE against UCX at the defaults, two rounds
# (thirty-second session, after the bounded receive pass and the launch rule; as
# docs/bench/cpu-e2e/chunk-count/two-hosts-defaults-ucx.sh at 64a2656).
cd /work/main; source scripts/setup.sh release >/dev/null 2>&1
for r in 1 2; do
 echo "== round $r"
 bash scripts/two-hosts.sh -- python3 bench/vllm_pattern.py --device cpu --iters 15 --order blocked --owner-netns nbhost-b --layers 4 --token-scale 1 --cases tp4-8k,tp1-8k 2>&1 | grep -E "^(BOUNCE|UCX|==)|FAIL|^ok"
done
