#!/usr/bin/env python3
"""The official NIXL Python API (nixl_cu13 from the pinned wheel) selecting
BOUNCE with a bounce-eligible transfer: two agents in one process created
with nixl_agent_config(backends=["BOUNCE"]), 4096 scattered 4 KiB DRAM WRITEs
in both directions (one with a notification) and READs (one with a
notification, which the owner receives), verified byte-exact (bytes outside
the destination blocks included). After each transfer the plugin's counters
are read through ctypes from the libplugin_BOUNCE.so that NIXL loaded into
this process (`nixl_bounce_stats(agent, agent_len, buf, cap) -> len`, JSON)
and must show that the bounce path carried it (for a READ: the reader
submitted and scattered, the owner served and wrote).

Single host: run with NIXL_BOUNCE_CONTROL_BIND_LOOPBACK=1 (tests/bounce_python.rs
sets it). With BOUNCE_TEST_PATH=cma the transfers must take the CMA path
instead (BOUNCE's default for two agents of one host; the arena check runs
with NIXL_BOUNCE_ENABLE_CMA=0). Exit status 0 = pass; the last line is "PASS ..." or "FAIL: <reason>".
"""

import ctypes
import json
import os
import time

COUNT = 4096
BACKEND = "BOUNCE"
PATH = os.environ.get("BOUNCE_TEST_PATH", "arena")

from nixl_test_util import (  # noqa: E402  (the tests' own folder)
    BLOCK,
    expect_equal,
    fail,
    nixl_agent,
    nixl_agent_config,
    np,
    pattern,
    scattered,
    wait_notif,
    wait_xfer,
)


def loaded_plugin():
    """ctypes handle on the BOUNCE plugin NIXL loaded (never a second copy)."""
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].endswith("/libplugin_BOUNCE.so"):
                paths.add(parts[5])
    if len(paths) != 1:
        fail(f"expected exactly one loaded libplugin_BOUNCE.so, found {sorted(paths)}")
    path = paths.pop()
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError as e:
        fail(f"cannot open the loaded plugin {path}: {e}")
    f = lib.nixl_bounce_stats
    f.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
    f.restype = ctypes.c_ssize_t
    return path, f


def counters(stats_fn, agent):
    name = agent.encode()
    n = stats_fn(name, len(name), None, 0)
    if n < 0:
        fail(f"nixl_bounce_stats: no BOUNCE engine for agent {agent!r}")
    buf = ctypes.create_string_buffer(n + 1024)
    n = stats_fn(name, len(name), buf, len(buf))
    if n < 0 or n > len(buf):
        fail(f"nixl_bounce_stats({agent!r}) returned {n}")
    snap = json.loads(buf.raw[:n])
    if snap.get("agent") != agent:
        fail(f"stats for {snap.get('agent')!r}, asked for {agent!r}")
    return snap["counters"], snap.get("poisoned")


def delta(after, before, key):
    return after.get(key, 0) - before.get(key, 0)


def main():
    pid = os.getpid()
    if os.environ.get("NIXL_BOUNCE_CONTROL_BIND_LOOPBACK") not in ("1", "true"):
        fail("set NIXL_BOUNCE_CONTROL_BIND_LOOPBACK=1 (single-host test)")
    a = nixl_agent(f"pyb-a-{pid}", nixl_agent_config(backends=[BACKEND]))
    b = nixl_agent(f"pyb-b-{pid}", nixl_agent_config(backends=[BACKEND]))
    for x in (a, b):
        if BACKEND not in x.backends:
            fail(f"backend {BACKEND} was not created (plugins offered: {x.plugin_list})")
    path, stats_fn = loaded_plugin()
    print(f"agents created with backends={list(a.backends)}; plugin {path}", flush=True)

    blocks = COUNT + COUNT // 4
    size = blocks * BLOCK
    bufs = {a.name: np.zeros(size, dtype=np.uint8), b.name: np.zeros(size, dtype=np.uint8)}
    regs = {x.name: x.register_memory([(bufs[x.name].ctypes.data, size, 0, "")], "DRAM", backends=[BACKEND])
            for x in (a, b)}
    names = {}
    for x, y in ((a, b), (b, a)):
        n = x.add_remote_agent(y.get_agent_metadata())
        names[(x.name, y.name)] = n.decode() if isinstance(n, bytes) else n
        if names[(x.name, y.name)] != y.name:
            fail(f"add_remote_agent returned {n!r}, expected {y.name!r}")

    steps = [(a, b, "WRITE", b"pyb-a-to-b"), (b, a, "WRITE", None), (a, b, "WRITE", None),
             (a, b, "READ", b"pyb-a-read-b"), (b, a, "READ", None)]
    for step, (x, y, op, notif) in enumerate(steps, start=1):
        what = f"{op} {COUNT} x {BLOCK} B {x.name} -> {y.name}"
        xbuf, ybuf = bufs[x.name], bufs[y.name]
        xbuf[:] = pattern(size, 100 * step + 1)
        ybuf[:] = pattern(size, 100 * step + 2)
        x_before, y_before = xbuf.copy(), ybuf.copy()
        xoffs = scattered(COUNT, blocks, 100 * step + 3)
        yoffs = scattered(COUNT, blocks, 100 * step + 4)
        ldescs = x.get_xfer_descs([(xbuf.ctypes.data + int(o), BLOCK, 0) for o in xoffs], "DRAM")
        rdescs = x.get_xfer_descs([(ybuf.ctypes.data + int(o), BLOCK, 0) for o in yoffs], "DRAM")
        sx0, _ = counters(stats_fn, x.name)
        sy0, _ = counters(stats_fn, y.name)
        h = x.initialize_xfer(op, ldescs, rdescs, y.name, notif or b"", backends=[BACKEND])
        t0 = time.perf_counter()
        wait_xfer(x, h, what)
        dt = time.perf_counter() - t0
        if notif:
            wait_notif(y, x.name, notif, what)
        if op == "WRITE":
            expect_equal(xbuf, x_before, [], f"{what}: source")
            expected = y_before.copy()
            for s, d in zip(xoffs, yoffs):
                expected[d:d + BLOCK] = x_before[s:s + BLOCK]
            expect_equal(ybuf, expected, yoffs, what)
        else:
            expect_equal(ybuf, y_before, [], f"{what}: source")
            expected = x_before.copy()
            for s, d in zip(yoffs, xoffs):
                expected[d:d + BLOCK] = y_before[s:s + BLOCK]
            expect_equal(xbuf, expected, xoffs, what)
        x.release_xfer_handle(h)
        sx1, px = counters(stats_fn, x.name)
        sy1, py = counters(stats_fn, y.name)
        changed = {k: delta(sx1, sx0, k) for k in sx1 if delta(sx1, sx0, k)}
        changed_y = {k: delta(sy1, sy0, k) for k in sy1 if delta(sy1, sy0, k)}
        print(f"ok: {what} byte-exact ({dt * 1e3:.2f} ms); initiator {changed}; target {changed_y}", flush=True)
        if px or py:
            fail(f"{what}: arena poisoned: {px or py}")
        if PATH == "cma":
            for key, want in (("cma_submitted", 1), ("cma_succeeded", 1), ("cma_failed", 0),
                              ("bounce_submitted", 0)):
                if delta(sx1, sx0, key) != want:
                    fail(f"{what}: initiator {key} rose by {delta(sx1, sx0, key)}, expected {want}: {changed}")
            fallbacks = {k: v for k, v in changed.items() if k.startswith("fallback_")}
            if fallbacks:
                fail(f"{what}: fell back: {fallbacks}")
        elif op == "WRITE":
            for key, want in (("bounce_submitted", 1), ("bounce_succeeded", 1), ("bounce_failed", 0)):
                if delta(sx1, sx0, key) != want:
                    fail(f"{what}: initiator {key} rose by {delta(sx1, sx0, key)}, expected {want}: {changed}")
            if delta(sx1, sx0, "chunks_written") < 1:
                fail(f"{what}: no chunk written: {changed}")
            if delta(sy1, sy0, "chunks_scattered") != delta(sx1, sx0, "chunks_written"):
                fail(f"{what}: target scattered {delta(sy1, sy0, 'chunks_scattered')} chunks, "
                     f"initiator wrote {delta(sx1, sx0, 'chunks_written')}")
            fallbacks = {k: v for k, v in changed.items() if k.startswith("fallback_")}
            if fallbacks:
                fail(f"{what}: fell back: {fallbacks}")
        else:
            for key, want in (("bounce_submitted", 1), ("bounce_succeeded", 1), ("bounce_failed", 0)):
                if delta(sx1, sx0, key) != want:
                    fail(f"{what}: reader {key} rose by {delta(sx1, sx0, key)}, expected {want}: {changed}")
            if delta(sy1, sy0, "reads_served") != 1:
                fail(f"{what}: owner reads_served rose by {delta(sy1, sy0, 'reads_served')}: {changed_y}")
            if delta(sx1, sx0, "chunks_scattered") != delta(sy1, sy0, "chunks_written") or \
                    delta(sy1, sy0, "chunks_written") < 1:
                fail(f"{what}: reader scattered {delta(sx1, sx0, 'chunks_scattered')} chunks, "
                     f"owner wrote {delta(sy1, sy0, 'chunks_written')}")
            fallbacks = {k: v for k, v in changed.items() if k.startswith("fallback_")}
            if fallbacks:
                fail(f"{what}: fell back: {fallbacks}")

    for x, y in ((a, b), (b, a)):
        x.remove_remote_agent(names[(x.name, y.name)])
    for x in (a, b):
        x.deregister_memory(regs[x.name], backends=[BACKEND])
    print(f"PASS backend={BACKEND} {PATH} path used through the official Python API", flush=True)


if __name__ == "__main__":
    main()
