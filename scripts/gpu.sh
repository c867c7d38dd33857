#!/usr/bin/env bash
# The GPU workflow (see docs/gpu.md).
#
#   scripts/gpu.sh pack   (here, on the CPU machine)
#       builds release binaries (library, bench, gpu-probe, the GPU test
#       binaries), strips them, and packs them with a trimmed NIXL runtime
#       (the UCX plugin and its libraries, no storage/cloud plugins) into
#       .gpu/ (ignored by git; about 15 MB), with .gpu/run.sh.
#   bash .gpu/run.sh [quick|full]   (on the GPU machine, repository root)
#       unpacks into /tmp, runs gpu-probe, every GPU test binary, and the
#       two-process VRAM benchmark, writing logs and JSON under $OUT (or
#       ./out when OUT is unset).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cmd="${1:-pack}"
[[ "$cmd" == pack ]] || { echo "usage: scripts/gpu.sh pack" >&2; exit 2; }

source scripts/setup.sh release
root=$PWD
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

# 1. Binaries: the release library, bins, and the test binaries whose names
#    start with gpu_ (they skip without a GPU, so they are safe to build here).
echo "[gpu] building GPU test binaries" >&2
tests=$(ls tests/gpu_*.rs 2>/dev/null | xargs -r -n1 basename | sed 's/\.rs$//')
args=()
for t in $tests; do args+=(--test "$t"); done
mkdir -p "$stage/bin"
if ((${#args[@]})); then
    cargo test --release --no-run "${args[@]}" --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' \
        | while read -r name exe; do cp "$exe" "$stage/bin/$name"; done
fi
for b in bounce-vram gpu-probe bench bounce-demo; do
    [[ -x target/release/$b ]] && cp "target/release/$b" "$stage/bin/"
done
strip --strip-debug "$stage"/bin/* 2>/dev/null || true

# 2. A trimmed NIXL runtime in the wheel's own layout (the UCX plugin finds
#    its libraries through $ORIGIN-relative run paths).
site=.nixl/site
libs=$site/.nixl_cu13.mesonpy.libs
mkdir -p "$stage/site/.nixl_cu13.mesonpy.libs/plugins" "$stage/site/nixl_cu13.libs"
cp -a "$libs"/lib*.so* "$stage/site/.nixl_cu13.mesonpy.libs/"
cp -a "$libs/plugins/libplugin_UCX.so" "$stage/site/.nixl_cu13.mesonpy.libs/plugins/"
cp -a target/release/libnixl_bounce.so "$stage/site/.nixl_cu13.mesonpy.libs/plugins/libplugin_BOUNCE.so"
strip --strip-debug "$stage/site/.nixl_cu13.mesonpy.libs/plugins/libplugin_BOUNCE.so"
(cd "$site/nixl_cu13.libs" && tar cf - --exclude='*aws*' --exclude='*azure*' --exclude='*curl*' \
    --exclude='*xml*' --exclude='*s3*' --exclude='*cufile*' .) | (cd "$stage/site/nixl_cu13.libs" && tar xf -)

rm -rf .gpu && mkdir -p .gpu
tar -C "$stage" -cJf .gpu/bundle.tar.xz bin site
cp scripts/gpu-run.sh .gpu/run.sh
echo "[gpu] packed .gpu/ ($(du -sh .gpu | cut -f1)); run on the GPU machine: bash .gpu/run.sh" >&2
