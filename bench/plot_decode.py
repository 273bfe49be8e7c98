#!/usr/bin/env python3
"""Decode ms per step against context from `flexpert bench generate --json` files.

Usage: plot_decode.py OUT.png TITLE LABEL=GLOB [LABEL=GLOB ...]
Each GLOB matches JSON files of one build (one per prompt length, several runs each);
the second pass of each file counts, runs of one prompt length are averaged. One panel
per batch size, a line per build. Run with Debian's /usr/bin/python3 (matplotlib).
"""
import collections
import glob
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def second_pass(path):
    d = json.load(open(path))
    runs = d["runs"]
    half = runs[len(runs) // 2:]
    return d["prompt_len"], {r["batch"]: r["decode_ms_per_step"] for r in half}


def main():
    out, title, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
    series = {}  # label -> batch -> context -> [ms]
    for spec in specs:
        label, pattern = spec.split("=", 1)
        per = collections.defaultdict(lambda: collections.defaultdict(list))
        for path in sorted(glob.glob(pattern)):
            ctx, ms = second_pass(path)
            for b, v in ms.items():
                per[b][ctx].append(v)
        series[label] = per
    batches = sorted({b for per in series.values() for b in per})
    fig, axes = plt.subplots(1, len(batches), figsize=(3.2 * len(batches), 3.4), squeeze=False)
    axes = axes[0]  # One batch too.
    for ax, b in zip(axes, batches):
        for label, per in series.items():
            ctxs = sorted(per[b])
            ax.plot(ctxs, [sum(per[b][c]) / len(per[b][c]) for c in ctxs], marker="o", label=label)
        ax.set_title("batch %d" % b)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ms per decode step")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    main()
