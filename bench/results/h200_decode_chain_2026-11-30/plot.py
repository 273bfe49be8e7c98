#!/usr/bin/env python3
"""Before / after bars of this directory's decode runs (second pass, mean of runs).

Usage (from the repository root, Debian's python3 with matplotlib):
  D=bench/results/h200_decode_chain_2026-11-30; mkdir -p /tmp/rr
  for f in r4 r6; do tar -C /tmp/rr -xzf $D/$f.tgz; done
  /usr/bin/python3 $D/plot.py /tmp/rr $D/decode_before_after.png
"""
import glob
import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def second_pass(path):
    d = json.load(open(path))
    runs = d["runs"][len(d["runs"]) // 2:]
    return {r["batch"]: r["decode_ms_per_step"] for r in runs}


def mean_ms(pattern):
    by = {}
    for path in sorted(glob.glob(pattern)):
        for b, ms in second_pass(path).items():
            by.setdefault(b, []).append(ms)
    return {b: statistics.mean(v) for b, v in by.items()}


def main():
    root, out = sys.argv[1], sys.argv[2]
    panels = [
        ("Qwen3-30B-A3B, 12 layers, context 64", f"{root}/r4/q12/g_%s_64_*.json", "old", "new"),
        ("Qwen3-30B-A3B, 12 layers, context 2048", f"{root}/r4/q12/g_%s_2048_*.json", "old", "new"),
        ("DeepSeek-V2-Lite, 8 layers, context 64", f"{root}/r6/dsl8/g_%s_64_*.json", "old", "new"),
        ("DeepSeek-V2-Lite, 8 layers, context 1024", f"{root}/r6/dsl8/g_%s_1024_*.json", "old", "new"),
        ("Qwen3-30B-A3B, all 48 layers, context 64",
         f"{root}/r6/q48/qwen3-30b-a3b-L48%s.json", "-baseline", ""),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (title, pattern, old, new) in zip(axes, panels):
        before, after = mean_ms(pattern % old), mean_ms(pattern % new)
        batches = sorted(set(before) & set(after))
        x = range(len(batches))
        ax.bar([i - 0.2 for i in x], [before[b] for b in batches], 0.4, label="before (43b8b71)")
        ax.bar([i + 0.2 for i in x], [after[b] for b in batches], 0.4, label="after (this session)")
        for i, b in enumerate(batches):
            ax.text(i + 0.2, after[b], f"{100 * (after[b] / before[b] - 1):+.0f}%", ha="center",
                    va="bottom", fontsize=8)
        ax.set_xticks(list(x), [f"batch {b}" for b in batches])
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("ms per decode step")
    axes[0].legend(fontsize=8)
    fig.suptitle("Decode steps on one H200: the route kernel as a cluster, step inputs before "
                 "the waits (flexpert bench generate, second pass)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
