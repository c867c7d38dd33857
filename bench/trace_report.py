#!/usr/bin/env python3
"""Where a bounce transfer's time goes, step by step, from the timelines
the engines write with NIXL_BOUNCE_TRACE=<dir> (one file per engine).

Run the transfers with the variable set in both processes (bounce-vram's
target inherits it), then:

    python3 bench/trace_report.py <dir> [--requests A:B]

Start from an empty directory: every timeline in it is read. Requests are
keyed by the id their messages carry (the sender's, for a WRITE), so the
receiver's steps line up with the sender's; both clocks are the host's
monotonic clock; a READ's data owner records its serve under the
reader's id. For each group of requests of one size
and number of chunks, every step's time after the request's submission is
printed as the median and p10-p90 over the requests, in the order of the
medians, with the gap from the step before.
"""
import argparse
import collections
import os
import statistics
import sys


def load(directory):
    """[(file, [(t_ns, step, request, chunk)])] for every timeline."""
    out = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".tsv"):
            continue
        rows = []
        with open(os.path.join(directory, name)) as f:
            header = f.readline().rstrip("\n").split("\t")
            if header != ["t_ns", "step", "request", "chunk", "bytes"]:
                sys.exit(f"{name}: not a timeline (header {header})")
            for line in f:
                t, step, request, chunk, size = line.rstrip("\n").split("\t")
                rows.append((int(t), step, int(request), int(chunk) if chunk else None, int(size)))
        out.append((name, rows))
    return out


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--requests", default=":", help="slice of the submitted requests in order, e.g. 10:40 (default all)")
    args = ap.parse_args()
    files = load(args.dir)
    if not files:
        sys.exit(f"no timelines (*.tsv) in {args.dir}")
    submits = {}
    sizes = {}
    for name, rows in files:
        for t, step, request, _, size in rows:
            if step == "submit":
                submits[(name, request)] = t
                sizes[request] = size
    if not submits:
        sys.exit("no submitted request in the timelines")
    order = sorted(submits, key=submits.get)
    a, _, b = args.requests.partition(":")
    chosen = order[int(a) if a else None:int(b) if b else None]
    # Every step of a chosen request, from any file: the sender's own file
    # and the other side's (the same request id; other senders' ids could
    # collide, so a timeline pair per run is the intended use).
    steps = collections.defaultdict(dict)  # request -> (side, step, chunk) -> t
    ids = {request: (name, submits[(name, request)]) for name, request in chosen}
    for name, rows in files:
        for t, step, request, chunk, _ in rows:
            if request in ids:
                side = "sender" if name == ids[request][0] else "receiver"
                steps[request].setdefault((side, step, chunk), t)
    groups = collections.defaultdict(list)
    for request, s in steps.items():
        chunks = len({c for (_, st, c) in s if st == "write_post"})
        groups[(sizes[request], chunks)].append(request)
    for size, chunks in sorted(groups):
        requests = groups[(size, chunks)]
        offsets = collections.defaultdict(list)
        for request in requests:
            t0 = ids[request][1]
            for key, t in steps[request].items():
                offsets[key].append((t - t0) / 1e3)
        print(f"== {len(requests)} requests of {size / 2**20:g} MiB in {chunks} chunk(s): us after submission, median [p10-p90]")
        prev = 0.0
        for key, xs in sorted(offsets.items(), key=lambda kv: statistics.median(kv[1])):
            side, step, chunk = key
            med = statistics.median(xs)
            label = f"{side:8} {step}" + (f" #{chunk}" if chunk is not None else "")
            print(f"  {label:34} {med:9.1f} [{quantile(xs, 0.1):8.1f}-{quantile(xs, 0.9):8.1f}]  +{med - prev:7.1f}  (n={len(xs)})")
            prev = med


if __name__ == "__main__":
    main()
