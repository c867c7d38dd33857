#!/bin/bash
# NIXL's own Python tests (test/python, `--backend B`) and examples/python,
# each run with UCX and with BOUNCE, on the GPU machine (docs/reliability.md
# "NIXL's own tests with BOUNCE").
#
# The examples are NIXL's, not this project's: export them from a checkout
# of ai-dynamo/nixl into the ignored folder .upstream, then carry it with
# the pack and the Python module (docs/gpu.md):
#   git -C <nixl checkout> archive 12038023d examples/python test/python | tar -x -C .upstream
#   run: bash scripts/upstream-examples.sh   (carry .gpu, .py312, .upstream)
#
# Each example gets the backend in place of UCX: its "UCX" literals and its
# nixl_agent_config(...) calls (which default to UCX) are rewritten in a copy.
# The wheel's module is nixl_cu13; a two-line alias package gives the
# examples their `import nixl`. Writes $OUT/upstream-examples.txt (one line
# per example and backend), upstream-tails.txt and logs.tar.xz.
set -u
root=$(pwd)
ex=${EXAMPLES:-$root/.upstream/examples/python}
[[ -d "$ex" ]] || { echo "no $ex: export NIXL's examples/python there (see the header)"; exit 1; }
out=${OUT:-/tmp/upstream-out}
mkdir -p "$out/alias/nixl"
cat > "$out/alias/nixl/__init__.py" <<'PY'
import sys, importlib
from nixl_cu13._api import *  # noqa: F401,F403
for _m in ("_api", "_bindings", "logging", "_utils"):
    try:
        sys.modules[f"nixl.{_m}"] = importlib.import_module(f"nixl_cu13.{_m}")
    except ImportError:
        pass
PY
# shellcheck disable=SC1091
source .gpu/run.sh python >/dev/null 2>&1
export PYTHONPATH="$out/alias:$PYTHONPATH"
port=6000
pair() {  # name backend script [args...]: target and initiator, two processes
    local name=$1 b=$2 f=$3
    shift 3
    port=$((port + 1))
    timeout 60 python3 "$f" --mode target --ip 127.0.0.1 --port $port "$@" >"$out/$name-$b-target.log" 2>&1 &
    local t=$!
    sleep 3
    timeout 60 python3 "$f" --mode initiator --ip 127.0.0.1 --port $port "$@" >"$out/$name-$b-initiator.log" 2>&1
    local ri=$?
    wait $t
    echo "$name $b: target rc=$? initiator rc=$ri"
}
for b in UCX BOUNCE; do
    if [[ -d "$root/.upstream/test/python" ]]; then
        (cd "$root/.upstream/test/python" && timeout 300 python3 -m pytest -q -p no:cacheprovider . --backend "$b" \
            >"$out/pytest-$b.log" 2>&1)
        echo "test/python $b: $(grep -E "passed|failed" "$out/pytest-$b.log" | tail -n 1)"
    fi
    d=$out/src-$b
    mkdir -p "$d"
    for f in basic_two_peers.py expanded_two_peers.py partial_md_example.py query_mem_example.py; do
        sed -e "s/nixl_agent_config(True, \([A-Za-z_]*\), \([A-Za-z_]*\))/nixl_agent_config(True, \1, \2, backends=[\"$b\"])/" \
            -e "s/\"UCX\"/\"$b\"/g" "$ex/$f" >"$d/$f"
    done
    pair basic "$b" "$d/basic_two_peers.py"
    pair basic-cuda "$b" "$d/basic_two_peers.py" --use_cuda True
    pair expanded "$b" "$d/expanded_two_peers.py" --backend "$b"
    pair expanded-cuda "$b" "$d/expanded_two_peers.py" --backend "$b" --use_cuda True
    port=$((port + 10))
    # Without etcd the example still deletes NIXL_ETCD_ENDPOINTS: set it empty.
    NIXL_ETCD_ENDPOINTS= timeout 90 python3 "$d/partial_md_example.py" \
        --init-port $((port + 1)) --target-port $((port + 2)) >"$out/partial-$b.log" 2>&1
    echo "partial_md $b: rc=$?"
    timeout 60 python3 "$d/query_mem_example.py" >"$out/query-$b.log" 2>&1
    echo "query_mem $b: rc=$?"
done 2>&1 | tee "$out/upstream-examples.txt"
# Few files come back from the machine: every log's tail in one, the rest packed.
for f in "$out"/*.log; do
    echo "=== $(basename "$f")"
    grep -v "^\s*$" "$f" | tail -n 12
done >"$out/upstream-tails.txt"
mkdir -p "$out/logs"
mv "$out"/*.log "$out/logs/"
rm -rf "$out"/src-* "$out/alias"
tar -C "$out" -cJf "$out/logs.tar.xz" logs && rm -rf "$out/logs"
