"""The session's decode experiments on one plot (raw runs in this directory).

    mkdir -p /tmp/r && for f in r*.tgz; do tar -C /tmp/r -xzf $f; done
    /usr/bin/python3 plot.py /tmp/r decode_gemv.png
"""
import glob
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

root, out = sys.argv[1], sys.argv[2]


def step_ms(run_dir, name, batch, prompt=64):
    """Mean ms per decode step (second pass) of a gpu_decode_ab.sh variant."""
    xs = []
    for path in sorted(glob.glob(f"{root}/{run_dir}/g_{name}_{prompt}_*.json")):
        d = json.load(open(path))
        for r in d["runs"][len(d["runs"]) // 2:]:
            if r["batch"] == batch:
                xs.append(r["decode_ms_per_step"])
    return sum(xs) / len(xs)


experiments = [  # (label, run, baseline variant, variant)
    ("L2 prefetch of the\nnext qkv (r1)", "r1", "base", "pf128ef"),
    ("q/k norm in the qkv\nGEMV, cluster (r2)", "r2", "plain", "fused"),
    ("q/k norm in the qkv\nGEMV, ticket (r3)", "r3", "plain", "fused"),
    ("ring GEMV\n(r4)", "r4/q12", "old", "ring"),
    ("gate/up + down in\none launch (r7)", "r7/q12", "two", "one"),
    ("kept: prologue GEMVs\nloop (r9)", "r9/q12", "old", "new"),
]
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(16, 5.5), gridspec_kw={"width_ratios": [1.3, 1]})
xs = range(len(experiments))
base = [step_ms(r, b, 1) for _, r, b, _ in experiments]
var = [step_ms(r, v, 1) for _, r, _, v in experiments]
ax0.bar([x - 0.2 for x in xs], base, 0.4, label="before / switched off")
ax0.bar([x + 0.2 for x in xs], var, 0.4, label="the experiment")
for x, b, v in zip(xs, base, var):
    pct = round(100 * (v / b - 1))
    ax0.text(x + 0.2, v + 0.005, f"{pct:+d}%" if pct else "0%", ha="center", fontsize=8)
ax0.set_xticks(list(xs))
ax0.set_xticklabels([e[0] for e in experiments], fontsize=7)
ax0.set_ylim(0.7, 1.0)
ax0.set_ylabel("ms per decode step")
ax0.set_title("Qwen3-30B-A3B, 12 layers, batch 1, context 64 (H200)")
ax0.legend(fontsize=8)

old = json.load(open(f"{root}/r6/gemv_old.json"))["rows"]
new = json.load(open(f"{root}/r6/gemv_new.json"))["rows"]
for shape, color in [("qwen3-30b-a3b qkv (norm)", "C0"),
                     ("deepseek-v2-lite mlp gate/up (norm)", "C1")]:
    o = [(r["rows"], r["us"]) for r in old if r["shape"] == shape]
    n = [(r["rows"], r["us"]) for r in new if r["shape"] == shape]
    ax1.plot([a for a, _ in o], [b for _, b in o], "--o", color=color,
             label=shape + ": a block per 8 columns")
    ax1.plot([a for a, _ in n], [b for _, b in n], "-o", color=color,
             label=shape + ": blocks loop (kept)")
ax1.set_xlabel("rows (decode tokens)")
ax1.set_ylabel("us per call")
ax1.set_xticks([1, 2, 4, 8])
ax1.set_title("gemv_bench: a chain of GEMVs normalising their rows (r6)")
ax1.legend(fontsize=7)
fig.tight_layout()
fig.savefig(out, dpi=110)
print("wrote", out)
