#!/usr/bin/env bash
# BOUNCE vs UCX benchmark: set-up (release build, plugin installed), run the
# `bench` binary, keep its table, JSON and a plot under docs/bench/.
#
# Usage: scripts/bench.sh [--quick|--full] [--name NAME] [bench options...]
#   --quick / --full   bench presets (default: --quick); see `bench --help`
#   --name NAME        output files docs/bench/NAME.{json,png,txt}
#                      (default: the preset's name)
#   anything else      passed to bench, e.g. --counts 4096 --inflight 1,8
#                      --bounce-variant c4m:max_chunk_size_bytes=4MiB --model
#
# Plotting needs matplotlib: installed on first use into .nixl/plot
# (pip --target, project-local, never system-wide).
# Exit status: the bench's (1 when a row failed verification or a BOUNCE row
# did not take the bounce path), or the first set-up/plot failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD

preset=--quick
name=
args=()
while (($#)); do
    case "$1" in
        --quick|--full) preset=$1 ;;
        --name) name=${2:?--name needs a value}; shift ;;
        --name=*) name=${1#--name=} ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) args+=("$1") ;;
    esac
    shift
done
name=${name:-${preset#--}}
out=docs/bench
mkdir -p "$out"

source scripts/setup.sh release

py=${NIXL_BOUNCE_PYTHON:-python3}
plotdir=$root/.nixl/plot
if ! PYTHONPATH=$plotdir "$py" -c 'import matplotlib' >/dev/null 2>&1; then
    echo "[bench] installing matplotlib into .nixl/plot (project-local)" >&2
    rm -rf "$plotdir.tmp"
    "$py" -m pip install --quiet --disable-pip-version-check --no-input \
        --target "$plotdir.tmp" 'matplotlib>=3.7,<4' >&2
    rm -rf "$plotdir" && mv "$plotdir.tmp" "$plotdir"
fi

echo "[bench] ${CARGO_TARGET_DIR:-target}/release/bench $preset ${args[*]} --json $out/$name.json" >&2
rc=0
"${CARGO_TARGET_DIR:-target}/release/bench" "$preset" "${args[@]}" --json "$out/$name.json" | tee "$out/$name.txt" || rc=$?
if [[ -s "$out/$name.json" ]]; then
    PYTHONPATH=$plotdir "$py" scripts/plot_bench.py "$out/$name.json" "$out/$name.png"
fi
exit "$rc"
