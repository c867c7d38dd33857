#!/usr/bin/env bash
# Run the whole test suite: set up (scripts/setup.sh, dev profile), then
# `cargo test` over every target with the NIXL runtime REQUIRED, so tests that
# need the runtime or the BOUNCE plugin fail instead of skipping.
# Extra arguments go to `cargo test` (e.g. scripts/test.sh --test loopback).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh "${NIXL_BOUNCE_PROFILE:-dev}"
export NIXL_BOUNCE_REQUIRE_RUNTIME=1
# --no-fail-fast: one failing suite must not hide the results of the others.
echo "[test] cargo test --no-fail-fast --all-targets $* (NIXL_BOUNCE_REQUIRE_RUNTIME=1)" >&2
cargo test --no-fail-fast --all-targets "$@"
echo "[test] cargo test --doc" >&2
cargo test --doc
# The maintainers' documentation: every intra-doc link must resolve, so a
# renamed or removed item cannot leave a comment pointing at nothing.
echo "[test] cargo doc --document-private-items (warnings are errors)" >&2
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --lib --document-private-items
# The package a user installs: the wheel built, installed into a copy of
# the NIXL site, and the Python API test run through it.
echo "[test] scripts/wheel.sh --check (the Python wheel, installed as a user would)" >&2
scripts/wheel.sh --profile "${NIXL_BOUNCE_PROFILE:-dev}" --check
echo "[test] all tests passed" >&2
