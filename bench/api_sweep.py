#!/usr/bin/env python3
"""The "new user" sweep: the official NIXL Python API with default settings,
BOUNCE against UCX on DRAM, over a range of transfer shapes.

What a new user would write: two agents in ONE process (as
tests/python/test_api.py), each created with
nixl_agent_config(backends=[B]) and nothing else, metadata exchanged with
get_agent_metadata / add_remote_agent, one buffer registered per agent. Per
iteration, timed as a whole:

    initialize_xfer(op, local_descs, remote_descs, peer)   # "prepare"
    transfer(handle); poll check_xfer_state until DONE      # "xfer"
    release_xfer_handle(handle)                             # "release"

Each iteration draws new scattered, distinct block offsets on both sides
inside a buffer `--spare` times larger than the transfer. Orders (--order):

- rounds (default): per shape, the backends take turns in rounds (BOUNCE,
  UCX, BOUNCE, UCX, ... --rounds of each), each round with a fresh agent
  pair that is the only one alive while it runs (its own warm-up first).
  Alternating keeps the machine's drift out of the comparison; one backend
  alive at a time is what an application that switches backends runs.
- alternate: one agent pair per backend for the whole run, iterations
  alternating. On a small machine this measures co-hosting more than the
  backends: an idle UCX agent made by the Python API
  (enable_prog_thread=True, delay 0 by default) spins its progress thread,
  about 0.8 core, which slows whatever runs beside it, while BOUNCE's idle
  agents wait on events.
- blocked: per shape one backend after the other, one fresh pair each.

The first and the
last iteration of every backend and shape (all of them with --verify-all) are
checked byte-exact over the whole destination buffer (moved blocks correct,
every other byte unchanged) and the source is checked unchanged.

For BOUNCE, the route its engine took (bounce path, peer-mapped path, or UCX
and why) comes from the plugin's counters (nixl_bounce_stats, read through
ctypes from the libplugin_BOUNCE.so that NIXL loaded).

Usage:
  source scripts/setup.sh release
  python3 bench/api_sweep.py [--op write|read] [--iters 21] [--shapes 1x4k,4096x4k] [--json out.json]

Shapes: COUNTxSIZE with k/m suffixes (KiB, MiB); default
1x4k,16x4k,64x4k,256x4k,1024x4k,4096x4k,16384x4k,1024x16k,1024x64k,4096x32k,64x1m.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import re
import sys
import time

import numpy as np

# Shared with the vLLM-pattern benchmark beside this file (its folder is first
# on the path when this script runs).
from vllm_pattern import BounceStats, spread  # noqa: E402

DEFAULT_SHAPES = "1x4k,16x4k,64x4k,256x4k,1024x4k,4096x4k,16384x4k,1024x16k,1024x64k,4096x32k,64x1m"
clock = time.perf_counter


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


def log(msg):
    print(f"[api_sweep] {msg}", file=sys.stderr, flush=True)


def parse_shape(spec):
    m = re.fullmatch(r"(\d+)x(\d+)([km]?)", spec.strip().lower())
    if not m:
        raise SystemExit(f"bad shape {spec!r}: expected COUNTxSIZE, e.g. 1024x4k")
    mult = {"": 1, "k": 1024, "m": 1 << 20}[m[3]]
    return int(m[1]), int(m[2]) * mult


def fmt_size(n):
    if n % (1 << 20) == 0:
        return f"{n >> 20}MiB"
    if n % 1024 == 0:
        return f"{n >> 10}KiB"
    return f"{n}B"


def route_of(before, after, iterations):
    if before is None or after is None:
        return "?"
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    parts = []
    for key, label in (("peer_map_submitted", "peer-map"), ("cma_submitted", "cma"),
                       ("bounce_submitted", "bounce")):
        if d.get(key, 0) > 0:
            parts.append(label if d[key] == iterations else f"{label} {d[key]}/{iterations}")
    fb = sorted(f"{k[len('fallback_'):]}" for k, v in d.items() if k.startswith("fallback_") and v > 0)
    if fb:
        parts.append("UCX(" + ",".join(fb) + ")")
    return "+".join(parts) or "UCX"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", choices=["write", "read"], default="write")
    ap.add_argument("--iters", type=int, default=21, help="timed iterations per backend and shape (default 21)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default 3)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--backends", default="BOUNCE,UCX")
    ap.add_argument("--order", choices=["rounds", "alternate", "blocked"], default="rounds",
                    help="rounds (default): per shape the backends take turns in --rounds rounds, each round a "
                         "fresh agent pair, the only one alive; alternate: one pair per backend for the whole "
                         "run, iterations alternating (the Python API's idle UCX agents spin a core each); "
                         "blocked: per shape one backend after the other")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per backend and shape with --order rounds "
                                                          "(default 3; --iters split over them)")
    ap.add_argument("--spare", type=float, default=2.0, help="buffer blocks = spare x count (default 2)")
    ap.add_argument("--verify-all", action="store_true", help="check every iteration, not only first and last")
    ap.add_argument("--timeout", type=float, default=float(os.environ.get("NIXL_BOUNCE_TEST_TIMEOUT_S", "60")))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", default=None)
    o = ap.parse_args()
    op = o.op.upper()
    backends = [b.strip() for b in o.backends.split(",") if b.strip()]
    shapes = [parse_shape(s) for s in o.shapes.split(",") if s.strip()]

    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except Exception as e:  # noqa: BLE001
        fail(f"cannot import nixl_cu13._api: {e!r} (source scripts/setup.sh)")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)  # no INFO line per agent on stdout

    pid = os.getpid()
    made = [0]

    def make_pair(b):
        """An initiator and a target agent of backend b, default settings."""
        made[0] += 1
        pair = {}
        for role in ("init", "target"):
            a = nixl_agent(f"sweep-{role}-{b}-{pid}-{made[0]}", nixl_agent_config(backends=[b]))
            if b not in a.backends:
                fail(f"backend {b} was not created (plugins offered: {a.plugin_list})")
            pair[role] = a
        return pair

    # alternate: one pair per backend for the whole run, backends taking turns
    # iteration by iteration. blocked: per shape, one backend at a time, its
    # pair the only agents alive (an idle UCX agent made by the Python API
    # spins its progress thread: about 0.8 core each, seen on the 2-core VM).
    pairs = {b: make_pair(b) for b in backends} if o.order == "alternate" else {}
    stats = None

    rng = np.random.default_rng(o.seed)
    samples, rows = [], []
    for count, size in shapes:
        blocks = max(count + 1, int(count * o.spare))
        nbytes = blocks * size
        ibuf = np.zeros(nbytes, dtype=np.uint8)  # the initiator's buffer
        tbuf = np.zeros(nbytes, dtype=np.uint8)  # the target's buffer
        # WRITE: initiator's blocks -> target's blocks; READ: target's -> initiator's.
        src_buf, dst_buf = (ibuf, tbuf) if op == "WRITE" else (tbuf, ibuf)
        times, routes = {b: [] for b in backends}, {b: [] for b in backends}
        # (backends live together, timed iterations) per turn.
        if o.order == "alternate":
            schedule = [(backends, o.iters)]
        elif o.order == "blocked":
            schedule = [([b], o.iters) for b in backends]
        else:
            per = [o.iters // o.rounds + (1 if r < o.iters % o.rounds else 0) for r in range(o.rounds)]
            schedule = [([b], n) for n in per for b in backends]
        log(f"{count} x {fmt_size(size)} {op}: buffers {nbytes / 2**20:.0f} MiB, {o.iters} timed iterations per "
            f"backend in {len(schedule) // (1 if o.order == 'alternate' else len(backends))} turn(s)")
        for group, timed in schedule:
            total = o.warmup + timed
            live = {b: (pairs[b] if o.order == "alternate" else make_pair(b)) for b in group}
            if stats is None and "BOUNCE" in group:
                stats = BounceStats()
            for b, p in live.items():
                p["ireg"] = p["init"].register_memory([(ibuf.ctypes.data, nbytes, 0, "")], "DRAM")
                p["treg"] = p["target"].register_memory([(tbuf.ctypes.data, nbytes, 0, "")], "DRAM")
                # Load each other's metadata after registering, as a new user would.
                tname = p["init"].add_remote_agent(p["target"].get_agent_metadata())
                p["tname"] = tname.decode() if isinstance(tname, bytes) else tname
                p["target"].add_remote_agent(p["init"].get_agent_metadata())
            before = {b: (stats.counters(live[b]["init"].name) if (stats and b == "BOUNCE") else None)
                      for b in group}
            for it in range(total):
                for b in group:
                    p = live[b]
                    ioffs = rng.permutation(blocks)[:count].astype(np.uint64) * np.uint64(size)
                    toffs = rng.permutation(blocks)[:count].astype(np.uint64) * np.uint64(size)
                    verify = o.verify_all or it == 0 or it == total - 1
                    if verify:
                        ibuf[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
                        tbuf[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
                        src_before, dst_before = src_buf.copy(), dst_buf.copy()
                    ldescs = p["init"].get_xfer_descs(np.stack(
                        [ioffs + np.uint64(ibuf.ctypes.data), np.full(count, size, np.uint64),
                         np.zeros(count, np.uint64)], axis=1), "DRAM")
                    rdescs = p["init"].get_xfer_descs(np.stack(
                        [toffs + np.uint64(tbuf.ctypes.data), np.full(count, size, np.uint64),
                         np.zeros(count, np.uint64)], axis=1), "DRAM")
                    t0 = clock()
                    h = p["init"].initialize_xfer(op, ldescs, rdescs, p["tname"])
                    t1 = clock()
                    state = p["init"].transfer(h)
                    deadline = t1 + o.timeout
                    while state == "PROC":
                        if clock() > deadline:
                            fail(f"{b} {count}x{size} {op} iter {it}: not DONE after {o.timeout} s")
                        state = p["init"].check_xfer_state(h)
                    t2 = clock()
                    if state != "DONE":
                        fail(f"{b} {count}x{size} {op} iter {it}: state {state}")
                    p["init"].release_xfer_handle(h)
                    t3 = clock()
                    if verify:
                        soffs, doffs = (ioffs, toffs) if op == "WRITE" else (toffs, ioffs)
                        expected = dst_before.reshape(blocks, size).copy()
                        expected[(doffs // np.uint64(size)).astype(np.int64)] = \
                            src_before.reshape(blocks, size)[(soffs // np.uint64(size)).astype(np.int64)]
                        if not np.array_equal(dst_buf, expected.reshape(-1)):
                            bad = np.flatnonzero(dst_buf != expected.reshape(-1))
                            fail(f"{b} {count}x{size} {op} iter {it}: {bad.size} byte(s) wrong, first at {bad[0]}")
                        if not np.array_equal(src_buf, src_before):
                            fail(f"{b} {count}x{size} {op} iter {it}: the source changed")
                    warm = it < o.warmup
                    samples.append(dict(backend=b, count=count, size=size, op=op, iter=it, warmup=warm,
                                        total_s=t3 - t0, prepare_s=t1 - t0, xfer_s=t2 - t1, release_s=t3 - t2,
                                        verified=verify))
                    if not warm:
                        times[b].append(t3 - t0)
            for b, p in live.items():
                route = (route_of(before[b], stats.counters(p["init"].name), total)
                         if before[b] is not None else "-")
                if route not in routes[b]:
                    routes[b].append(route)
                p["init"].remove_remote_agent(p["tname"])
                p["target"].remove_remote_agent(p["init"].name)
                p["init"].deregister_memory(p["ireg"])
                p["target"].deregister_memory(p["treg"])
            live = p = h = None  # the handle keeps its agent alive too
            gc.collect()  # blocked: this backend's agents go now
        routes = {b: "/".join(r) for b, r in routes.items()}
        row = dict(count=count, size=size, bytes=count * size, op=op, routes=routes,
                   total_s={b: spread(times[b]) for b in backends},
                   ratio_ci95=(ratio_ci(times["UCX"], times["BOUNCE"], o.seed)
                               if "UCX" in times and "BOUNCE" in times else None),
                   prepare_s={b: spread([s["prepare_s"] for s in samples if s["backend"] == b and s["count"] == count
                                         and s["size"] == size and not s["warmup"]]) for b in backends},
                   xfer_s={b: spread([s["xfer_s"] for s in samples if s["backend"] == b and s["count"] == count
                                      and s["size"] == size and not s["warmup"]]) for b in backends})
        rows.append(row)
        print_row(row, backends, header=len(rows) == 1, op=op, o=o)

    if o.json:
        os.makedirs(os.path.dirname(os.path.abspath(o.json)), exist_ok=True)
        with open(o.json, "w") as f:
            json.dump(dict(config=vars(o), host=dict(hostname=platform.node(), python=platform.python_version(),
                                                     env={k: v for k, v in os.environ.items()
                                                          if k.startswith(("NIXL_", "UCX_"))}),
                           rows=rows, samples=samples), f, indent=1)
        print(f"samples written to {o.json}")
    print(f"ok: every checked transfer byte-exact ({sum(s['verified'] for s in samples)} checked)", flush=True)


def ratio_ci(ucx, bounce, seed, n=2000):
    """A 95% bootstrap interval of UCX's median time over BOUNCE's, the
    iterations of each resampled (not the rounds: agent-pair effects make
    the true spread somewhat wider)."""
    rng = np.random.default_rng(seed)
    u, b = np.asarray(ucx), np.asarray(bounce)
    r = [np.median(rng.choice(u, u.size)) / np.median(rng.choice(b, b.size)) for _ in range(n)]
    return [float(x) for x in np.percentile(r, [2.5, 97.5])]


def print_row(row, backends, header, op, o):
    if header:
        print(f"\nNIXL Python API, default settings, DRAM, two agents in one process, scattered {op}; "
              f"time = initialize_xfer + transfer + poll to DONE + release; median [p10-p90] of {o.iters} "
              f"(+{o.warmup} warm-up), " + {
                  "alternate": "both backends' agents alive, iterations alternating",
                  "blocked": "one backend after the other, its agents the only ones alive",
                  "rounds": f"backends alternating in {o.rounds} rounds each, a fresh agent pair per round, "
                            f"the only one alive"}[o.order])
        cols = "".join(f" {b + ' ms':>25}" for b in backends)
        print(f"{'shape':>12} {'MiB':>8}{cols} {'UCX/BOUNCE':>10} {'95% CI':>11} {'GB/s B':>7} {'GB/s U':>7}  "
              "BOUNCE route")
    t = row["total_s"]
    cells = "".join(f" {t[b]['p50'] * 1e3:9.3f} [{t[b]['p10'] * 1e3:.3f}-{t[b]['p90'] * 1e3:.3f}]".rjust(26)
                    for b in backends)
    ratio = (f"{t['UCX']['p50'] / t['BOUNCE']['p50']:10.2f}" if "UCX" in t and "BOUNCE" in t else f"{'-':>10}")
    ci = row.get("ratio_ci95")
    ci = f"{ci[0]:.2f}-{ci[1]:.2f}".rjust(11) if ci else f"{'-':>11}"
    gb = lambda b: f"{row['bytes'] / t[b]['p50'] / 1e9:7.2f}" if b in t else f"{'-':>7}"  # noqa: E731
    shape = f"{row['count']}x{fmt_size(row['size'])}"
    print(f"{shape:>12} {row['bytes'] / 2**20:8.2f}{cells} {ratio} {ci} {gb('BOUNCE')} {gb('UCX')}  "
          f"{row['routes'].get('BOUNCE', '-')}", flush=True)


if __name__ == "__main__":
    main()
