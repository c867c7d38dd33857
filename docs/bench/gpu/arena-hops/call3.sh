#!/usr/bin/env bash
# call2.sh cut to what a short device call can hold: a lone 16,384 x 4 KiB
# arena WRITE under MPS at 4 chunks (the default) and 8, alternating, 2
# rounds, with timelines; then the fault drills.
# Run from the repository root with .gpu carried: bash THIS.
WS="4 8" COUNTS=16384 ITERS=20 SUITE=faults exec bash "$(dirname "$0")/call2.sh"
