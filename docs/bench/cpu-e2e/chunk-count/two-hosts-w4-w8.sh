#!/usr/bin/env bash
# Two network namespaces (scripts/two-hosts.sh), vLLM pattern, DRAM, BOUNCE alone,
# min_chunks_per_request 4 and 8 alternating, two rounds (thirty-first session).
cd /work/main; source scripts/setup.sh release >/dev/null 2>&1
for r in 1 2; do for w in 4 8; do
 echo "== round $r min_chunks_per_request=$w"
 bash scripts/two-hosts.sh -- python3 bench/vllm_pattern.py --device cpu --iters 15 --order blocked --backends BOUNCE --owner-netns nbhost-b --layers 4 --token-scale 1 --cases tp4-8k,tp1-8k --bounce-param min_chunks_per_request=$w 2>&1 | grep -E "^(BOUNCE|UCX|==)|FAIL|^ok|chunks"
done; done
