#!/usr/bin/env bash
# Main job: loopback DRAM demo. Moves N scattered descriptors (default 4096 x
# 4 KiB) between two agents in one process, through backend BOUNCE and through
# backend UCX, and prints a table (backend, descriptors, bytes, p50 ms, GB/s,
# verified). Arguments go to bounce-demo; see `scripts/demo.sh --help`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh release
exec cargo run --quiet --release --bin bounce-demo -- "$@"
