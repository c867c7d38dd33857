#!/usr/bin/env python3
"""Plot the JSON written by `bench --json` into a PNG.

Panel 1: throughput (GB/s) vs descriptor count, log-x, one line per
         variant (and per descriptor size when several were run), at the
         smallest in-flight value of the run.
Panel 2: per-request latency p50 (solid) and p99 (dashed) vs requests in
         flight, log-log, one colour per variant (only when the run has more
         than one in-flight value), at one descriptor count and size.
Panel 3: throughput vs requests in flight for the same count and size
         (only when the run has more than one in-flight value).

Points of BOUNCE rows whose counters show the bounce path was NOT used are
drawn with an 'x'; failed and skipped rows are left out.

Usage: plot_bench.py BENCH.json OUT.png [--count N] [--size BYTES] [--title TEXT]
Needs matplotlib (scripts/bench.sh installs it into .nixl/plot).
"""

import argparse
import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402


def size_text(n):
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10} KiB"
    return f"{n} B"


def plain_ticks(ax, values):
    """Label a log axis with the swept values themselves."""
    ticks = sorted(set(values))
    ax.set_xticks(ticks)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def pick(values, preferred):
    """`preferred` if present, else the value closest to it (in log terms)."""
    values = sorted(set(values))
    if not values:
        return None
    if preferred in values:
        return preferred
    return min(values, key=lambda v: abs((v / preferred) - 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("png")
    ap.add_argument("--count", type=int, default=4096, help="descriptor count of panels 2-3 (default 4096)")
    ap.add_argument("--size", type=int, default=4096, help="descriptor size of panels 2-3 (default 4096)")
    ap.add_argument("--title", default=None)
    a = ap.parse_args()

    with open(a.json) as f:
        doc = json.load(f)
    meta, rows = doc["meta"], doc["rows"]
    rows = [r for r in rows if r["status"] == "ok" and r.get("throughput_gbps")]
    rows = [r for r in rows if r["backend"] != "memcpy"]
    if not rows:
        sys.exit(f"{a.json}: no successful rows to plot")

    labels = list(dict.fromkeys(r["label"] for r in rows))
    palette = plt.cm.tab10 if len(labels) <= 10 else plt.cm.tab20
    colours = {lab: palette(i % palette.N) for i, lab in enumerate(labels)}
    sizes = sorted({r["descriptor_bytes"] for r in rows})
    inflights = sorted({r["inflight"] for r in rows})
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D"]

    multi = len(inflights) > 1
    fig, axes = plt.subplots(1, 3 if multi else 1, figsize=(17 if multi else 7.5, 5.2), squeeze=False)
    axes = axes[0]

    # Panel 1: throughput vs descriptor count (a bar chart by variant when
    # the run has one descriptor count only).
    ax = axes[0]
    inf0 = inflights[0]
    counts = sorted({r["descriptors"] for r in rows})
    if len(counts) == 1:
        width = 0.8 / len(inflights)
        for i, inf in enumerate(inflights):
            ys = []
            for lab in labels:
                match = [r["throughput_gbps"] for r in rows if r["label"] == lab and r["inflight"] == inf]
                ys.append(match[0] if match else 0)
            xs = [j + (i - (len(inflights) - 1) / 2) * width for j in range(len(labels))]
            bars = ax.bar(xs, ys, width, label=f"{inf} in flight", alpha=0.85)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("throughput (GB/s)")
        ax.set_title(f"WRITE throughput by variant ({counts[0]} x {size_text(sizes[0])})")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    else:
        for lab in labels:
            for si, size in enumerate(sizes):
                pts = sorted(
                    (r["descriptors"], r["throughput_gbps"], r.get("bounce_path_ok"))
                    for r in rows
                    if r["label"] == lab and r["descriptor_bytes"] == size and r["inflight"] == inf0
                )
                if not pts:
                    continue
                name = lab if len(sizes) == 1 else f"{lab}, {size_text(size)}"
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    styles[si % len(styles)],
                    marker=markers[si % len(markers)],
                    color=colours[lab],
                    label=name,
                )
                bad = [p for p in pts if p[2] is False]
                if bad:
                    ax.scatter([p[0] for p in bad], [p[1] for p in bad], marker="x", s=90, color="black", zorder=5)
        if any(r.get("bounce_path_ok") is False for r in rows):
            ax.text(0.02, 0.02, "x: BOUNCE row that went through UCX (counters)", transform=ax.transAxes, fontsize=8)
        ax.set_xscale("log", base=2)
        plain_ticks(ax, counts)
        ax.set_xlabel("descriptors per request")
        ax.set_ylabel("throughput (GB/s)")
        ax.set_title(f"WRITE throughput vs descriptor count ({inf0} in flight)")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, ncol=2 if len(labels) * len(sizes) > 6 else 1)

    if multi:
        count = pick([r["descriptors"] for r in rows], a.count)
        size = pick([r["descriptor_bytes"] for r in rows if r["descriptors"] == count], a.size)
        sel = [r for r in rows if r["descriptors"] == count and r["descriptor_bytes"] == size]
        by_label = defaultdict(list)
        for r in sel:
            by_label[r["label"]].append(r)
        ax2, ax3 = axes[1], axes[2]
        for lab in labels:
            rs = sorted(by_label.get(lab, []), key=lambda r: r["inflight"])
            if not rs:
                continue
            x = [r["inflight"] for r in rs]
            ax2.plot(x, [r["latency_ms"]["p50"] for r in rs], "-o", color=colours[lab], label=f"{lab} p50")
            ax2.plot(x, [r["latency_ms"]["p99"] for r in rs], "--", marker="v", color=colours[lab], label=f"{lab} p99")
            ax3.plot(x, [r["throughput_gbps"] for r in rs], "-o", color=colours[lab], label=lab)
        for ax_, what in ((ax2, "per-request latency (ms)"), (ax3, "throughput (GB/s)")):
            ax_.set_xscale("log", base=2)
            plain_ticks(ax_, inflights)
            ax_.set_xlabel("requests in flight")
            ax_.set_ylabel(what)
            ax_.grid(True, which="both", alpha=0.3)
            ax_.legend(fontsize=7, ncol=2 if len(labels) > 3 else 1)
        ax2.set_yscale("log")
        ax3.set_ylim(bottom=0)
        ax2.set_title(f"latency vs in-flight ({count} x {size_text(size)})")
        ax3.set_title(f"throughput vs in-flight ({count} x {size_text(size)})")

    m = meta.get("machine", {})
    commit = (meta.get("git_commit") or "?")[:10] + ("+dirty" if meta.get("git_dirty") else "")
    title = a.title or (
        f"nixl-bounce bench: {meta.get('mem', '?').upper()} {meta.get('op', '?').upper()}, one process, "
        f"{m.get('nproc', '?')} cores ({m.get('cpu_model', '?')}); {commit}; {meta.get('started_utc', '')}"
    )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(a.png, dpi=72)
    print(f"plot: {a.png}")


if __name__ == "__main__":
    main()
