#!/usr/bin/env bash
# Build the nixl-bounce Python wheel: python/ packaged with the plugin
# (libplugin_BOUNCE.so, debug info stripped) into dist/, so that a vLLM or
# SGLang user installs BOUNCE with pip and no Rust toolchain:
#   pip install dist/nixl_bounce-*.whl && python -m nixl_bounce install
#
# Use:  scripts/wheel.sh [--profile dev|release] [--check]
#   --profile  the build the wheel carries (default release)
#   --check    then install the wheel into a copy of the project's NIXL site
#              (without the plugin setup.sh put there), run
#              `python -m nixl_bounce install` as a user would, and run the
#              official Python API test through it (tests/python/test_api.py,
#              BOUNCE, without NIXL_PLUGIN_DIR or LD_LIBRARY_PATH)
# Needs what scripts/setup.sh sets up (it is run first), and PyPI for the
# build backend (setuptools, fetched by pip into an isolated build env).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
profile=release check=0
while (($#)); do
    case "$1" in
        --profile) profile="$2"; shift 2 ;;
        --check) check=1; shift ;;
        *) echo "usage: scripts/wheel.sh [--profile dev|release] [--check]" >&2; exit 2 ;;
    esac
done
step() { printf '[wheel] %s\n' "$*" >&2; }

source scripts/setup.sh "$profile" >/dev/null
case "$profile" in dev|debug) outdir=debug ;; *) outdir=release ;; esac
so="${CARGO_TARGET_DIR:-$root/target}/$outdir/libnixl_bounce.so"
py="${NIXL_BOUNCE_PYTHON:-python3}"

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
printf '# Written by scripts/wheel.sh from Cargo.toml'"'"'s version.\n__version__ = "%s"\n' "$version" \
    > python/nixl_bounce/_version.py
strip --strip-debug -o python/nixl_bounce/libplugin_BOUNCE.so "$so"
step "plugin: $so ($profile) -> python/nixl_bounce/libplugin_BOUNCE.so, debug info stripped"
rm -rf python/build python/*.egg-info
mkdir -p dist
"$py" -m pip wheel --no-deps --quiet --disable-pip-version-check -w dist python/ >&2
rm -rf python/build python/*.egg-info
wheel=$(ls -t dist/nixl_bounce-"$version"-*.whl | head -1)
step "built $wheel ($(du -h "$wheel" | cut -f1))"

if ((check)); then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    # A user's site: the NIXL wheel as installed (hard links: no copy), minus
    # the plugin setup.sh installed there.
    cp -al "$root/.nixl/site" "$tmp/site"
    rm -f "$tmp/site/.nixl_cu13.mesonpy.libs/plugins/libplugin_BOUNCE.so"
    "$py" -m pip install --no-deps --quiet --disable-pip-version-check --target "$tmp/site" "$wheel" >&2
    run() { env -u NIXL_PLUGIN_DIR -u LD_LIBRARY_PATH PYTHONPATH="$tmp/site" "$@"; }
    run "$py" -m nixl_bounce install >&2
    run "$py" -m nixl_bounce where >&2
    cmp -s "$tmp/site/.nixl_cu13.mesonpy.libs/plugins/libplugin_BOUNCE.so" python/nixl_bounce/libplugin_BOUNCE.so \
        || { step "FAIL: the installed plugin is not the wheel's"; exit 1; }
    out=$(env -u NIXL_PLUGIN_DIR -u LD_LIBRARY_PATH PYTHONPATH="$tmp/site:$root/tests/python" \
        "$py" tests/python/test_api.py --backend BOUNCE 2>&1) || true
    last=$(printf '%s\n' "$out" | tail -1)
    if [[ "$last" != PASS* ]]; then
        printf '%s\n' "$out" | tail -20 >&2
        step "FAIL: tests/python/test_api.py through the wheel: $last"
        exit 1
    fi
    step "check: installed from the wheel, tests/python/test_api.py: $last"
fi
