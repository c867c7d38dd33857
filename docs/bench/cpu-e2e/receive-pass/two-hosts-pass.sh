#!/usr/bin/env bash
# Two network namespaces (scripts/two-hosts.sh), vLLM pattern, DRAM, BOUNCE alone,
# receive_pass_us 25 (the default) and 0 (read until no message is ready, as before)
# alternating, two rounds (thirty-second session).
cd /work/main; source scripts/setup.sh release >/dev/null 2>&1
for r in 1 2; do for p in 25 0; do
 echo "== round $r receive_pass_us=$p"
 bash scripts/two-hosts.sh -- python3 bench/vllm_pattern.py --device cpu --iters 15 --order blocked --backends BOUNCE --owner-netns nbhost-b --layers 4 --token-scale 1 --cases tp4-8k,tp1-8k --bounce-param receive_pass_us=$p 2>&1 | grep -E "^(BOUNCE|UCX|==)|FAIL|^ok|chunks"
done; done
