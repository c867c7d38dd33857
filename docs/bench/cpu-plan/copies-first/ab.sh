#!/usr/bin/env bash
# The plan's cost before (OLD: the lib test binary of 4e79de1, built in a
# worktree with CARGO_TARGET_DIR) and after copies first (NEW: this
# checkout's), thirty-first session, 2-core VM. Usage: bash THIS OLD NEW
# Prints timings (three rounds alternating, 500 plans each) and the
# instructions a plan (valgrind cachegrind: 11 plans less 1, over 10).
set -euo pipefail
OLD=$1 NEW=$2
for r in 1 2 3; do for k in old new; do
  b=$NEW; [ $k = old ] && b=$OLD
  for n in 1024 16384; do
    echo -n "$k r$r n=$n: "
    PLAN_COST_RANDOM=$n PLAN_COST_ROUNDS=500 $b plan_cost --ignored --nocapture 2>&1 | grep "plan of"
  done
done; done
ir() { PLAN_COST_RANDOM=$2 PLAN_COST_ROUNDS=$3 valgrind --tool=cachegrind --cache-sim=no \
  --cachegrind-out-file=/dev/null $1 plan_cost --ignored --nocapture 2>&1 | grep "I *refs" | awk '{gsub(",","",$4); print $4}'; }
for k in old new; do
  b=$NEW; [ $k = old ] && b=$OLD
  for n in 1024 16384; do
    a=$(ir $b $n 1); c=$(ir $b $n 11)
    echo "$k n=$n: $(( (c - a) / 10 )) instructions a plan"
  done
done
