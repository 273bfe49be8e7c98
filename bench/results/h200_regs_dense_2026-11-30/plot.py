# Plots r3/layer.json (moe_layer_bench --dense --profile): per compute-bound row, the
# layer's GEMMs as cuBLAS runs them dense, as ws128 runs them dense, and as the layer
# runs them grouped, each with the layer's other stages, against the floor and 70 % of it.
#   /usr/bin/python3 plot.py  ->  dense_yardstick.png
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

d = json.load(open("r3/layer.json"))
rows = [r for r in d["runs"] if r.get("dense_gate_up_us", 0) > 0]
fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 4.2))
for ax, r in zip(axes, rows):
    s = r["stage_us"]
    other = sum(s[k] for k in ("router", "topk", "permute", "combine"))
    gemms = [
        ("cuBLAS\ndense", r["dense_gate_up_us"] + r["dense_down_us"]),
        ("ws128\ndense", r["dense_ws128_gather_us"] + r["dense_ws128_down_us"]),
        ("ws128\ngrouped", s["gate_up"] + s["down"]),
    ]
    names = [g[0] for g in gemms]
    ax.bar(names, [g[1] for g in gemms], color="#4c72b0", label="gate/up + down")
    ax.bar(names, [other] * 3, bottom=[g[1] for g in gemms], color="#dd8452",
           label="router, top-k, permute, combine")
    ax.plot([2], [r["us"]], "k_", markersize=30, label="layer measured")
    ax.axhline(r["floor_us"], color="green", label="floor (burst GEMM rate)")
    ax.axhline(r["floor_us"] / 0.7, color="red", ls="--", label="70 % of the floor")
    ax.axhline(r["floor_sustained_us"], color="green", ls=":", label="floor (sustained rate)")
    ax.set_title(f"{r['shape']}, {r['tokens']} tokens")
    ax.set_ylabel("us")
handles, labels = axes[0].get_legend_handles_labels()
fig.legend(handles, labels, loc="lower center", ncol=6, fontsize=8)
fig.suptitle("One MoE layer on an H200: the GEMMs dense (cuBLAS, ws128) and grouped", fontsize=10)
fig.tight_layout(rect=(0, 0.07, 1, 1))
fig.savefig("dense_yardstick.png", dpi=110)
