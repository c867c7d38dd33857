#!/usr/bin/env bash
# Runs on the GPU machine (copied to .gpu/run.sh by scripts/gpu.sh pack).
# Usage: bash .gpu/run.sh [quick|full|tests|benches|bounce|faults|perf|vllm|peer|x2|x2-rest|x2-vllm|trace|mixed]
#        (source .gpu/run.sh python: only the environment, with the Python API)   Logs and JSON go to $OUT (or ./out).
set -uo pipefail
mode="${1:-quick}"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out="${OUT:-$PWD/out}"
mkdir -p "$out"
nb=/tmp/nixl-bounce-gpu
# The official Python API: the wheel's nixl_cu13 module (not in the bundle;
# carried as .py312/nixl_cu13, docs/gpu.md) beside the bundle's libraries.
# Fails, saying so, when it was not carried.
python_api() {
    local py="${PY312:-$here/../.py312}"
    [[ -d "$py/nixl_cu13" ]] || { echo "no $py/nixl_cu13 (docs/gpu.md)"; return 1; }
    [[ -d "$nb/site/nixl_cu13" ]] || cp -a "$py/nixl_cu13" "$nb/site/"
    export PYTHONPATH="$nb/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
}
rm -rf "$nb" && mkdir -p "$nb" && tar -C "$nb" -xJf "$here/bundle.tar.xz"
export NIXL_PLUGIN_DIR="$nb/site/.nixl_cu13.mesonpy.libs/plugins"
export LD_LIBRARY_PATH="$nb/site/.nixl_cu13.mesonpy.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_BOUNCE_REQUIRE_RUNTIME=1 NIXL_BOUNCE_CONTROL_BIND_LOOPBACK=1
status=0
run() {  # run NAME CMD...: log to $out/NAME.log, remember failures
    local name=$1; shift
    echo "== $name: $*" | tee -a "$out/summary.txt"
    local t0=$SECONDS
    if "$@" >"$out/$name.log" 2>&1; then
        echo "   ok ($((SECONDS - t0)) s)" | tee -a "$out/summary.txt"
    else
        echo "   FAILED rc=$? ($((SECONDS - t0)) s); tail:" | tee -a "$out/summary.txt"
        tail -n 30 "$out/$name.log" | tee -a "$out/summary.txt"
        status=1
    fi
}
{ nvidia-smi -L; nvidia-smi topo -m; } >"$out/gpu.txt" 2>&1
v="$nb/bin/bounce-vram"
if [[ "$mode" == x2* ]]; then
    # Two GPUs (issue 18; docs/benchmarks.md, "Two GPUs"): NVLink multicast
    # stays off, and nothing here creates a multicast object.
    export NCCL_NVLS_ENABLE=0
fi
# x2_noprep FROM TO: 16,384 x 4 KiB from GPU FROM's buffers to GPU TO's,
# the copy alone, post to completion: the plugin's preparation back in
# createXferReq (prepare_at_post makes it at the first post).
x2_noprep() {
    run "x2-bounce-noprep-$1to$2" "$v" bench --backend BOUNCE --label "BOUNCE-noprep-gpu$1-gpu$2" \
        --device "$1" --target-device "$2" --param prepare_at_post=false --sizes 4096 --counts 16384 \
        --concurrent 0 --iters 20 --json "$out/x2-bounce-noprep-$1to$2.json"
}
if [[ "$mode" == x2 ]]; then
    # The initiator's buffers on one GPU, the target's on the other, both
    # ways: byte-exact tests (peer-mapped, then the arena), then BOUNCE,
    # BOUNCE-arena, UCX default and UCX best side by side (1024, 4096,
    # 16,384 x 4 and 16 KiB; 128 concurrent 1024 x 4 KiB, p50 and p99).
    run probe "$nb/bin/gpu-probe"
    run gpu_peer_map "$nb/bin/gpu_peer_map" --test-threads=1 --nocapture
    shapes="--sizes 4096,16384 --counts 1024,4096,16384"
    for dir in "0 1" "1 0"; do
        set -- $dir
        pair="--device $1 --target-device $2"
        run "x2-test-$1to$2" "$v" test $pair
        run "x2-test-arena-$1to$2" "$v" test $pair --param enable_peer_map=false
        run "x2-bounce-$1to$2" "$v" bench --backend BOUNCE --label "BOUNCE-gpu$1-gpu$2" $pair $shapes \
            --iters 20 --json "$out/x2-bounce-$1to$2.json"
        x2_noprep "$1" "$2"
        run "x2-arena-$1to$2" "$v" bench --backend BOUNCE --label "BOUNCE-arena-gpu$1-gpu$2" $pair \
            --param enable_peer_map=false $shapes --iters 20 --json "$out/x2-arena-$1to$2.json"
        run "x2-ucx-$1to$2" "$v" bench --backend UCX --label "UCX-gpu$1-gpu$2" $pair $shapes \
            --iters 10 --json "$out/x2-ucx-$1to$2.json"
        NIXL_UCX_SGL_ENABLE=1 run "x2-ucx-best-$1to$2" "$v" bench --backend UCX --label "UCX-best-gpu$1-gpu$2" \
            --param num_threads=8 $pair $shapes --iters 10 --json "$out/x2-ucx-best-$1to$2.json"
    done
    grep -hE "GPU . -> GPU|x |per request|passed|FAILED" "$out"/gpu_peer_map.log "$out"/x2-*.log \
        >"$out/x2-summary.txt"
    cat "$out/summary.txt"
    exit $status
fi
if [[ "$mode" == x2-rest ]]; then
    # What issue 18 still lacked after the twenty-first session, in one call
    # well inside the time limit (x2 whole takes more than 540 s): both
    # ways, the copy alone (prepare_at_post=false) and BOUNCE at its
    # defaults side by side for 16,384 x 4 KiB, then UCX best for the rows
    # the earlier call's limit cut (GPU1 -> GPU0: 4096 x 16 KiB and 128 in
    # flight).
    for dir in "0 1" "1 0"; do
        set -- $dir
        pair="--device $1 --target-device $2"
        x2_noprep "$1" "$2"
        run "x2-bounce-16k-$1to$2" "$v" bench --backend BOUNCE --label "BOUNCE-gpu$1-gpu$2" $pair \
            --sizes 4096 --counts 16384 --concurrent 0 --iters 20 --json "$out/x2-bounce-16k-$1to$2.json"
    done
    NIXL_UCX_SGL_ENABLE=1 run x2-ucx-best-rest-1to0 "$v" bench --backend UCX --label UCX-best-gpu1-gpu0 \
        --param num_threads=8 --device 1 --target-device 0 --sizes 16384 --counts 4096 --concurrent 128 \
        --iters 10 --json "$out/x2-ucx-best-rest-1to0.json"
    grep -hE "x |per request|prepare" "$out"/x2-*.log >"$out/x2-rest-summary.txt"
    cat "$out/x2-rest-summary.txt" "$out/summary.txt"
    exit $status
fi
if [[ "$mode" == x2-vllm ]]; then
    # vLLM's pattern with prefill (the owner) on GPU 0 and decode (the
    # reader) on GPU 1: BOUNCE and UCX as vLLM creates it alternating, then
    # UCX's best settings (SGL on, 8 threads) in the same call.
    python_api || exit 1
    cases="--cases tp4-8k,tp1-8k,tp4-2kx8 --device cuda --owner-gpu 0 --gpu 1"
    run x2-vllm python3 bench/vllm_pattern.py $cases --iters "${VLLM_ITERS:-20}" --json "$out/x2-vllm.json"
    NIXL_UCX_SGL_ENABLE=1 run x2-vllm-ucx-best python3 bench/vllm_pattern.py $cases --backends UCX \
        --ucx-threads 8 --iters "${VLLM_ITERS:-10}" --json "$out/x2-vllm-ucx-best.json"
    grep -hE "^==|^(BOUNCE|UCX) |speed-up" "$out"/x2-vllm*.log | cut -c1-300
    cat "$out/summary.txt"
    exit $status
fi
if [[ "$mode" == bounce ]]; then
    # The bounce path alone (while tuning): the benchmark and its phase
    # breakdown, no UCX runs; then the byte-exact test so speed never hides
    # a wrong result.
    run bench-bounce "$v" bench --backend BOUNCE --label BOUNCE --iters 20 --json "$out/bench-bounce.json"
    run bench-arena "$v" bench --backend BOUNCE --label BOUNCE-arena --param enable_peer_map=false --iters 20 \
        --json "$out/bench-arena.json"
    run vram-test "$v" test
    grep -E "x |per request|phase|passed|FAILED" "$out/bench-bounce.log" "$out/bench-arena.log" "$out/vram-test.log"
    exit $status
fi
if [[ "$mode" == perf ]]; then
    # The bounce arena's chunk size swept (the peer-mapped path, which
    # would carry these on one host, has no chunks: it is switched off).
    for chunk in 512KiB 2MiB 8MiB 32MiB; do
        run "perf-chunk-$chunk" "$v" bench --backend BOUNCE --label "chunk-$chunk" --param enable_peer_map=false \
            --param max_chunk_size_bytes=$chunk --concurrent 0 --json "$out/perf-chunk-$chunk.json"
    done
    cat "$out"/perf-*.log | grep -E "x |per request" >"$out/perf-summary.txt"
    exit $status
fi
if [[ "$mode" == peer ]]; then
    # The peer-mapped path while working on it: its kernel and engine tests,
    # the two-process byte-exact test, then the vLLM-pattern benchmark.
    run probe "$nb/bin/gpu-probe"
    run gpu_kernels "$nb/bin/gpu_kernels" --test-threads=1
    run gpu_peer_map "$nb/bin/gpu_peer_map" --test-threads=1
    run vram-test "$v" test
    # What the IPC mapping allows (cuMemcpyDtoD and the pair kernel, local
    # against mapped), then the peer-mapped path post to completion.
    run mapping "$v" mapping --iters 20 --json "$out/mapping.json"
    for op in write read; do
        run "bench-peer-$op" "$v" bench --op $op --backend BOUNCE --label "BOUNCE-peer-$op" \
            --sizes 4096,8192,16384 --counts 1024,4096,16384 --iters 30 --json "$out/bench-peer-$op.json"
    done
    # Small tables: the launch's parameter (the default) against uploaded.
    for inline in 2040 0; do
        run "bench-peer-small-inline$inline" "$v" bench --backend BOUNCE --label "BOUNCE-peer-inline$inline" \
            --param peer_map_inline_table_max_descriptors=$inline --sizes 4096 --counts 256,512,1024,2040 \
            --iters 30 --json "$out/bench-peer-small-inline$inline.json"
    done
    grep -hE "^mapping:|x |per request" "$out/mapping.log" "$out"/bench-peer-*.log >"$out/peer-summary.txt" || true
    [[ -n "${PEER_ONLY:-}" ]] && { cat "$out/peer-summary.txt" "$out/summary.txt"; exit $status; }
    mode=vllm
fi
if [[ "$mode" == vllm || "$mode" == python ]]; then
    # The official Python API: the wheel's nixl_cu13 module (not in the
    # bundle; carry it as .py312/nixl_cu13, docs/gpu.md) beside the bundle's
    # libraries, so its $ORIGIN-relative paths find them.
    python_api || exit 1
    if [[ "$mode" == vllm ]]; then
        # vLLM's NIXL connector pattern with torch KV caches, BOUNCE and UCX
        # (as vLLM creates it) alternating, every transfer byte-exact.
        run vllm-pattern python3 bench/vllm_pattern.py --device cuda --iters "${VLLM_ITERS:-20}" \
            --json "$out/vllm-pattern.json"
        grep -vE "^\s*$" "$out/vllm-pattern.log" | tail -n 40
        cat "$out/summary.txt"
        exit $status
    fi
    # python: stay in this shell's environment (source it) for more commands.
    return 0 2>/dev/null || exit 0
fi
if [[ "$mode" == trace ]]; then
    # Where the arena's requests spend their time, step by step, under MPS
    # (NIXL_BOUNCE_TRACE timelines of both processes, bench/trace_report.py):
    # a lone 1024 and 16,384 x 4 KiB request, then 128 in flight (the
    # requests after the bench's 30 lone ones and their warm-up).
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
    mkdir -p /tmp/mps /tmp/mpslog
    nvidia-cuda-mps-control -d
    for shape in "1024 0 5:" "16384 0 5:" "1024 128 40:"; do
        set -- $shape
        rm -rf /tmp/bounce-trace && mkdir -p /tmp/bounce-trace
        export NIXL_BOUNCE_TRACE=/tmp/bounce-trace
        run "trace-bench-$1-$2" "$v" bench --backend BOUNCE --label "arena-trace" --param enable_peer_map=false \
            --sizes 4096 --counts "$1" --concurrent "$2" --iters 30
        unset NIXL_BOUNCE_TRACE
        run "trace-$1-$2" python3 bench/trace_report.py /tmp/bounce-trace --requests "$3"
    done
    echo quit | nvidia-cuda-mps-control
    exit $status
fi
if [[ "$mode" == mixed ]]; then
    # Mixed memory against UCX (docs/benchmarks.md, "Mixed memory through the
    # host-staged instance"): issue 15's 16,384 x 4 KiB WRITE from DRAM into
    # VRAM and READ back (also with UCX's chunk writes), then a 2 MiB READ
    # with the GPU's own clock on
    # (NIXL_BOUNCE_TIME_KERNELS=1; the bench prints both sides' copies).
    python_api || exit 1
    four_k="--cases tp4-8k --token-scale 0.25 --block-size 8 --iters 5 --warmup 1"
    run mixed-write-4k python3 bench/vllm_pattern.py $four_k --device cuda --reader-device torch-cpu --op write
    run mixed-read-4k python3 bench/vllm_pattern.py $four_k --device cuda --reader-device torch-cpu
    # The same READ with its chunk writes through UCX (the CMA path off):
    # UCX copies each host-to-host write inside its post, one at a time.
    run mixed-read-4k-ucx-writes python3 bench/vllm_pattern.py $four_k --device cuda --reader-device torch-cpu \
        --backends BOUNCE --bounce-param enable_cma=false
    NIXL_BOUNCE_TIME_KERNELS=1 run mixed-2mib python3 bench/vllm_pattern.py --cases tp4-128 --token-scale 0.5 \
        --iters 7 --warmup 1 --device cuda --reader-device torch-cpu
    grep -hE "^==|^(BOUNCE|UCX) |speed-up|the copies" "$out"/mixed-*.log | cut -c1-400
    cat "$out/summary.txt"
    exit $status
fi
if [[ "$mode" == faults ]]; then
    # Fault drills only (see `bounce-vram faults`).
    run vram-faults "$v" faults --buffer 268435456
    exit $status
fi
tests() {
    run probe "$nb/bin/gpu-probe"
    for t in "$nb"/bin/gpu_*; do
        [[ -x "$t" ]] && run "$(basename "$t")" "$t" --test-threads=1
    done
    # Two-process VRAM WRITEs and READs through the plugin, byte-exact (1,
    # 1024, 16384 x 4 KiB, mixed sizes, 8 concurrent threads): the
    # peer-mapped path (the default on one host), then the bounce path.
    run vram-test "$v" test
    run vram-test-arena "$v" test --param enable_peer_map=false
    run vram-test-notif "$v" test --param enable_peer_map=false --param use_nixl_notifications=true
    # The arena's copies through pair tables (copy_pair_tables, off by default).
    run vram-test-arena-pairs "$v" test --param enable_peer_map=false --param copy_pair_tables=true
    # A request larger than the arena streams through it.
    run vram-test-small-arena "$v" test --param enable_peer_map=false --param arena_size_bytes=16MiB \
        --param max_chunk_size_bytes=2MiB
    # VRAM bounce disabled on the target: transfers fall back to UCX at once.
    run vram-test-fallback "$v" test --target-param enable=false --expect-fallback
    # Cancel during gather / write / scatter, the target killed mid-transfer
    # (bounce path), the target killed under a peer-mapped copy: terminal in
    # bound, arenas drained and conserved, next WRITE byte-exact.
    run vram-faults "$v" faults --buffer 268435456
    # Mixed memory: vLLM's READ between one process's VRAM and the other's
    # DRAM, both ways, through the GPU's host-staged instance (defaults),
    # byte-exact, every request on the bounce path.
    if python_api; then
        local dirs
        for dirs in "cuda torch-cpu" "torch-cpu cuda"; do
            set -- $dirs
            run "mixed-$1-$2" python3 bench/vllm_pattern.py --device "$1" --reader-device "$2" \
                --cases tp4-128,tp4-8k --token-scale 0.25 --iters 3 --warmup 1 --backends BOUNCE \
                --expect-route "bounce(staged)"
        done
    else
        echo "mixed-memory tests skipped: no .py312/nixl_cu13 (docs/gpu.md)" | tee -a "$out/summary.txt"
    fi
}
benches() {
    local iters=20; [[ "$mode" == full ]] && iters=50
    # WRITE, then READ (the initiator reads the target's buffer): BOUNCE as
    # it runs by default (peer-mapped on one host), BOUNCE's arena path,
    # UCX default and UCX best, one after the other.
    local op
    for op in write read; do
        local sfx=""; [[ $op == read ]] && sfx="-read"
        run "bench-bounce$sfx" "$v" bench --op $op --backend BOUNCE --label "BOUNCE$sfx" --iters $iters \
            --json "$out/bench-bounce$sfx.json"
        run "bench-arena$sfx" "$v" bench --op $op --backend BOUNCE --label "BOUNCE-arena$sfx" \
            --param enable_peer_map=false --iters $iters --json "$out/bench-arena$sfx.json"
        run "bench-ucx-default$sfx" "$v" bench --op $op --backend UCX --label "UCX-default$sfx" --iters $iters \
            --json "$out/bench-ucx-default$sfx.json"
        NIXL_UCX_SGL_ENABLE=1 run "bench-ucx-best$sfx" "$v" bench --op $op --backend UCX --label "UCX-best$sfx" \
            --param num_threads=8 --iters $iters --json "$out/bench-ucx-best$sfx.json"
    done
}
# tests: every GPU test and drill; benches: the side-by-side benchmarks;
# quick / full: both (full with more iterations).
case "$mode" in
    tests) tests ;;
    benches) benches ;;
    *) tests; benches ;;
esac
exit $status
