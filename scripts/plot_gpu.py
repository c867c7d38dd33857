#!/usr/bin/env python3
"""Plots bounce-vram benchmark JSON (docs/bench/gpu/*.json): effective
throughput of single WRITE requests against descriptor count, one line per
backend/setting, log-log. Usage: plot_gpu.py OUT.png TITLE JSON..."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    out, title, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path in paths:
        rows = json.load(open(path))["rows"]
        by_size = {}
        for r in rows:
            if r["inflight"] == 1:
                by_size.setdefault(r["size"], []).append(r)
        for size, rs in sorted(by_size.items()):
            rs.sort(key=lambda r: r["descriptors"])
            label = f'{rs[0]["label"]} ({size // 1024} KiB)'
            style = "-" if rs[0]["backend"] == "BOUNCE" else "--"
            ax.plot([r["descriptors"] for r in rs], [r["gbps"] for r in rs], style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("descriptors per request")
    ax.set_ylabel("GB/s (bytes / p50 latency)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
