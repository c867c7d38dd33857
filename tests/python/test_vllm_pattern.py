#!/usr/bin/env python3
"""vLLM's NIXL KV-transfer pattern through the official NIXL Python API, on
DRAM, small shapes, one backend: the correctness side of
bench/vllm_pattern.py (which this imports and runs).

Two processes (a spawned prefill "owner" and this decode "reader"), agents
named uuid4() and created as vLLM creates them, a KV cache of 4 layers (8
registered regions, K and V per layer) in 8 KiB blocks (TP=4 geometry) and
32 KiB blocks (TP=1), metadata loaded by the reader only, the whole cache
prepared as one region-major descriptor list on each side, READs made with
make_prepped_xfer by descriptor ids, notifications "<req>:<tp>" polled by the
owner with get_new_notifs. Cases: one 2048-token request (1024 descriptors),
four 2048-token requests in flight, a 128-token request (64 descriptors) and
a 512-token TP=1 request (256 x 32 KiB). Asserts every transfer byte-exact
(every destination block of every region against its source block's
pattern, destinations zeroed before each transfer) and every notification
received by the owner, from the reader's agent.

Usage: python3 tests/python/test_vllm_pattern.py [--backend BOUNCE] [--iters 3]
       [--cases LIST] [--layers N] [--expect-route SUBSTRING]
Needs PYTHONPATH=.nixl/site (scripts/setup.sh sets it). Exit status 0 = pass;
the last line is "PASS backend=<B> ..." or "FAIL: <reason>".
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))

import vllm_pattern as vp  # noqa: E402  (bench/vllm_pattern.py)

CASES = "tp4-2k,tp4-2kx4,tp4-128,tp1-512"


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="BOUNCE")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--expect-route", default=None,
                    help="every case's route must contain this, e.g. plan-in-parts")
    args = ap.parse_args()
    b = args.backend
    opts = vp.parse_args(["--device", "cpu", "--backends", b, "--cases", args.cases, "--layers", str(args.layers),
                          "--token-scale", "1", "--iters", str(args.iters), "--warmup", str(args.warmup)])
    try:
        res = vp.run(opts)
    except vp.BenchError as e:
        fail(str(e))

    per_iter = args.iters + args.warmup
    for g in res["cases"]:
        ss = [s for s in res["samples"] if s["case"] == g["name"] and s["backend"] == b]
        want = g["inflight"] * per_iter
        if len(ss) != want:
            fail(f"{g['name']}: {len(ss)} requests recorded, expected {want}")
        for s in ss:
            if not s["verified"]:
                fail(f"{g['name']} iter {s['iter']} request {s['req']}: not verified")
            if s.get("notif_at_s") is None or not s["notif_sender_ok"]:
                fail(f"{g['name']} iter {s['iter']} request {s['req']}: notification missing or from the wrong agent")
            tel = s["telemetry"]
            if "descCount" in tel and tel["descCount"] != g["descs_per_req"]:
                print(f"note: {g['name']}: telemetry descCount {tel['descCount']}, request had "
                      f"{g['descs_per_req']} descriptors", flush=True)
        row = next(r for r in res["summary"] if r["case"] == g["name"])
        if args.expect_route and not all(args.expect_route in r for r in row["routes"]):
            fail(f"{g['name']}: route {row['routes']}, expected every one to contain {args.expect_route!r}")
        print(f"ok: {g['name']}: {want} READs of {g['descs_per_req']} x {g['block_len']} B "
              f"({g['inflight']} in flight) byte-exact, notifications at the owner; transfer p50 "
              f"{row['transfer_s']['p50'] * 1e3:.2f} ms, notification p50 {row['notif_s']['p50'] * 1e3:.2f} ms; "
              f"route {','.join(row['routes'])}", flush=True)
    print(f"PASS backend={b} vLLM pattern: {len(res['samples'])} READs byte-exact, every notification received",
          flush=True)


if __name__ == "__main__":
    main()
