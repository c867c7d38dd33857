# Sourced by the device-call scripts beside it (bash docs/bench/gpu/X/callN.sh,
# from the repository root, .gpu and .py312 carried): the preamble they
# all repeat.
#   gpu_call NAME      $work=/tmp/NAME (emptied), $out ($OUT or /tmp/out),
#                      the bundle unpacked with the Python API's environment
#                      (.gpu/run.sh python), $v the bounce-vram binary,
#                      $work/gpu.txt the GPU and driver
#   pack               $work as $OUT/all.tgz (after every stage: a call cut
#                      by its time limit keeps what it measured)
#   mps_start/mps_stop the MPS daemon (../shared/FACTS.md)
#   old_plugin_dir [F] a plugin directory with .gpu/old/F (default
#                      libplugin_BOUNCE.so) in place of the new plugin;
#                      prints its path
#   vbench TAG ARGS... `bounce-vram bench --backend BOUNCE --label TAG ARGS`
#                      into $work/bench-TAG.log (NIXL_PLUGIN_DIR as set),
#                      its rc into $work/summary.txt, the lines matching
#                      $BENCH_GREP printed, then pack
#   prep_costs         the lib tests' prep_cost (.gpu/extra/libtests, 8
#                      threads), scattered then in order, into
#                      $work/prep-cost.txt, then pack
gpu_call() {
    out="${OUT:-/tmp/out}"; mkdir -p "$out"
    work="/tmp/$1"; rm -rf "$work"; mkdir -p "$work"
    if [[ ! -f .gpu/run.sh ]]; then
        echo "gpu_call: no .gpu/run.sh here: run scripts/gpu.sh pack, and carry .gpu and .py312 (docs/gpu.md)" >&2
        return 1
    fi
    source .gpu/run.sh python || return 1
    v=/tmp/nixl-bounce-gpu/bin/bounce-vram
    summary="$work/summary.txt"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$work/gpu.txt" 2>&1
}
pack() { tar czf "$out/all.tgz" -C "$work" . 2>/dev/null; }
prep_costs() {
    local o
    for o in 0 1; do
        PREP_IN_ORDER=$o PREP_THREADS=8 timeout 40 .gpu/extra/libtests prep_cost --ignored --nocapture 2>&1 \
            | grep "prep_cost \|panicked" | tee -a "$work/prep-cost.txt"
    done
    pack
}
mps_start() {
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
    mkdir -p /tmp/mps /tmp/mpslog
    nvidia-cuda-mps-control -d
}
mps_stop() { echo quit | nvidia-cuda-mps-control; }
old_plugin_dir() {
    local f="${1:-libplugin_BOUNCE.so}"
    local new="$NIXL_PLUGIN_DIR" old="$NIXL_PLUGIN_DIR/../plugins_${f%.so}"
    rm -rf "$old"; cp -a "$new" "$old"; cp ".gpu/old/$f" "$old/libplugin_BOUNCE.so"
    echo "$old"
}
vbench() {
    local tag=$1; shift
    timeout "${BENCH_TIMEOUT:-100}" "$v" bench --backend BOUNCE --label "$tag" "$@" \
        >"$work/bench-$tag.log" 2>&1
    echo "bench-$tag rc=$?" >>"$summary"
    grep -h "${BENCH_GREP:-inflight\|launch steps\|preparation}" "$work/bench-$tag.log" | cut -c1-160
    pack
}
