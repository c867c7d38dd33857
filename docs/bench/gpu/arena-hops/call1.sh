#!/usr/bin/env bash
# One device call: the arena's timelines at HEAD (`.gpu/run.sh trace`, now
# with the client's queueing and the plugin's preparation per request),
# the preparation pool's spinning threads on and off (trace-threads.sh),
# then the whole GPU suite. Everything lands in $OUT/all.tgz (the device
# tool brings back few files), re-packed after each stage.
# Run from the repository root with .gpu and .py312 carried: bash THIS.
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out"
work=/tmp/call1; rm -rf "$work"; mkdir -p "$work"
pack() { tar czf "$out/all.tgz" -C "$work" . 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$work/gpu.txt" 2>&1
OUT=$work/trace timeout 150 bash .gpu/run.sh trace >"$work/trace.out" 2>&1; pack
OUT=$work/threads timeout 150 bash docs/bench/gpu/group-launches/trace-threads.sh >"$work/threads.out" 2>&1; pack
echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
OUT=$work/tests timeout "${TESTS_S:-330}" bash .gpu/run.sh tests >"$work/tests.out" 2>&1; pack
cat "$work"/tests/summary.txt 2>/dev/null | tail -30
for f in "$work"/trace/trace-bench-*.log "$work"/threads/trace-threads-summary.txt; do echo "== $f"; grep -vE "counters" "$f" | head -20; done
