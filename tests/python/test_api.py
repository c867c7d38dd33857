#!/usr/bin/env python3
"""The official NIXL Python API (nixl_cu13 from the pinned wheel) driving one
backend: two agents in one process, created with
nixl_agent_config(backends=[BACKEND]); DRAM WRITE and READ of 1 descriptor and
of 4096 scattered 4 KiB descriptors, verified byte-exact (bytes outside the
destination blocks included); a notification with the WRITE and a standalone
one.

Usage: python3 tests/python/test_api.py [--backend BOUNCE] [--count 4096]
Needs PYTHONPATH=.nixl/site (scripts/setup.sh sets it). Exit status 0 = pass;
the last line is "PASS ..." or "FAIL: <reason>".
"""

import argparse
import os
import time

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="BOUNCE")
    ap.add_argument("--count", type=int, default=4096)
    args = ap.parse_args()
    backend = args.backend
    pid = os.getpid()

    config = nixl_agent_config(backends=[backend])
    init = nixl_agent(f"py-init-{pid}", config)
    target = nixl_agent(f"py-target-{pid}", nixl_agent_config(backends=[backend]))
    for a in (init, target):
        if backend not in a.plugin_list:
            fail(f"plugin {backend} not offered by NIXL (plugins: {a.plugin_list}; "
                 f"NIXL_PLUGIN_DIR={os.environ.get('NIXL_PLUGIN_DIR')})")
        if backend not in a.backends:
            fail(f"backend {backend} was not created (nixl_agent skips a backend it cannot create)")
    print(f"agents created with backends={list(init.backends)}; plugins offered: {init.plugin_list}",
          flush=True)

    n_many = args.count
    blocks = n_many + max(n_many // 4, 2)
    size = blocks * BLOCK
    ibuf = np.zeros(size, dtype=np.uint8)
    tbuf = np.zeros(size, dtype=np.uint8)
    ireg = init.register_memory([(ibuf.ctypes.data, size, 0, "")], "DRAM", backends=[backend])
    treg = target.register_memory([(tbuf.ctypes.data, size, 0, "")], "DRAM", backends=[backend])

    tname = init.add_remote_agent(target.get_agent_metadata())
    iname = target.add_remote_agent(init.get_agent_metadata())
    # add_remote_agent returns the name as bytes in nixl-cu13 1.5.1.
    tname, iname = [x.decode() if isinstance(x, bytes) else x for x in (tname, iname)]
    if tname != target.name or iname != init.name:
        fail(f"add_remote_agent returned {tname!r}/{iname!r}")

    step = 0
    for op in ("WRITE", "READ"):
        for n in (1, n_many):
            step += 1
            what = f"{op} {n} x {BLOCK} B"
            ibuf[:] = pattern(size, 10 * step + 1)
            tbuf[:] = pattern(size, 10 * step + 2)
            i_before, t_before = ibuf.copy(), tbuf.copy()
            ioffs = scattered(n, blocks, 10 * step + 3)
            toffs = scattered(n, blocks, 10 * step + 4)
            ldescs = init.get_xfer_descs([(ibuf.ctypes.data + int(o), BLOCK, 0) for o in ioffs], "DRAM")
            rdescs = init.get_xfer_descs([(tbuf.ctypes.data + int(o), BLOCK, 0) for o in toffs], "DRAM")
            notif = f"py-{op}-{n}".encode()
            h = init.initialize_xfer(op, ldescs, rdescs, tname, notif, backends=[backend])
            t0 = time.perf_counter()
            wait_xfer(init, h, what)
            dt = time.perf_counter() - t0
            if op == "WRITE":
                wait_notif(target, iname, notif, what)
                src, dst, dst_before, soffs, doffs = i_before, tbuf, t_before, ioffs, toffs
                expect_equal(ibuf, i_before, [], f"{what}: source")
            else:
                src, dst, dst_before, soffs, doffs = t_before, ibuf, i_before, toffs, ioffs
                expect_equal(tbuf, t_before, [], f"{what}: source")
            expected = dst_before.copy()
            for s, d in zip(soffs, doffs):
                expected[d:d + BLOCK] = src[s:s + BLOCK]
            expect_equal(dst, expected, doffs, what)
            init.release_xfer_handle(h)
            print(f"ok: {what} byte-exact ({dt * 1e3:.2f} ms)", flush=True)

    # Not send_notif(..., backend): nixl-cu13 1.5.1 passes a single handle where
    # the binding wants a list (TypeError). The agent has one backend anyway.
    init.send_notif(tname, b"py-standalone")
    wait_notif(target, iname, b"py-standalone", "standalone notification")
    print("ok: standalone notification", flush=True)

    init.remove_remote_agent(tname)
    target.remove_remote_agent(iname)
    init.deregister_memory(ireg, backends=[backend])
    target.deregister_memory(treg, backends=[backend])
    print(f"PASS backend={backend}", flush=True)


if __name__ == "__main__":
    main()
