# SPDX-License-Identifier: Apache-2.0
"""PyTorch reference of one MoE layer, timed like bench/moe_layer_bench.cc.

Router GEMM -> softmax -> top-k (renormalised) -> tokens sorted by expert ->
torch._grouped_mm for gate/up and down (SwiGLU) -> weighted combine. bf16
weights and activations, as the C++ bench. Each configuration runs on 4
rotating inputs, eagerly and (when capture works) as a CUDA graph; best_us is
the faster of the two. Writes JSON for moe_layer_bench --torch.

    python3 bench/moe_layer_torch.py --json out/torch.json [--tokens 1,4,16,...]
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

SHAPES = {
    "qwen3-30b-a3b": dict(hidden=2048, inter=768, experts=128, top_k=8),
    "deepseek-v3": dict(hidden=7168, inter=2048, experts=256, top_k=8),
}
INPUTS = 4
ALIGN = 16  # Row alignment of groups, used only if unaligned offsets are refused.


class Layer:
    def __init__(self, hidden, inter, experts, top_k, device):
        g = torch.Generator(device=device).manual_seed(0)
        self.E, self.K, self.H, self.I = experts, top_k, hidden, inter
        u = lambda *s, scale: (torch.rand(*s, generator=g, device=device) * 2 - 1).mul_(scale).to(torch.bfloat16)
        self.router = u(experts, hidden, scale=0.05)
        self.w_gu = u(experts, 2 * inter, hidden, scale=0.02)  # [E, 2I, H]: gate rows, then up rows
        self.w_down = u(experts, hidden, inter, scale=0.02)  # [E, H, I]
        self.aligned = False

    def grouped(self, x, w, offs):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    def forward(self, h):
        T = h.shape[0]
        logits = (h @ self.router.t()).float()
        probs = torch.softmax(logits, dim=-1)
        weights, experts = torch.topk(probs, self.K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.E, dtype=torch.int32, device=h.device)
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        x = h.index_select(0, order // self.K)
        if not self.aligned:
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            gu = self.grouped(x, self.w_gu, offs)
            act = F.silu(gu[:, : self.I]) * gu[:, self.I:]
            y = self.grouped(act, self.w_down, offs)
        else:
            padded = (counts + ALIGN - 1) // ALIGN * ALIGN
            offs = torch.cumsum(padded, 0, dtype=torch.int32)
            starts = torch.cumsum(counts, 0) - counts
            pstarts = offs - padded
            sorted_e = flat[order]
            pos = pstarts[sorted_e] + (torch.arange(flat.numel(), device=h.device) - starts[sorted_e])
            xp = torch.zeros(flat.numel() + ALIGN * self.E, self.H, dtype=h.dtype, device=h.device)
            xp[pos] = x
            gu = self.grouped(xp, self.w_gu, offs)
            act = F.silu(gu[:, : self.I]) * gu[:, self.I:]
            y = self.grouped(act, self.w_down, offs)[pos]
        out_sorted = torch.empty_like(y)
        out_sorted[order] = y
        out = (out_sorted.view(T, self.K, self.H).float() * weights.unsqueeze(-1)).sum(dim=1)
        return out


def time_eager(layer, inputs, target_ms=150.0):
    for x in inputs:
        layer.forward(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for x in inputs:
        layer.forward(x)
    end.record()
    end.synchronize()
    one = start.elapsed_time(end)
    reps = max(3, min(2000, int(target_ms / max(one, 1e-3))))
    times = []
    for _ in range(3):
        start.record()
        for _ in range(reps):
            for x in inputs:
                layer.forward(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (reps * len(inputs)))
    return sorted(times)[1] * 1e3


def time_graph(layer, inputs, target_ms=150.0):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for x in inputs:
            layer.forward(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [layer.forward(x) for x in inputs]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    one = start.elapsed_time(end)
    reps = max(3, min(2000, int(target_ms / max(one, 1e-3))))
    times = []
    for _ in range(3):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (reps * len(inputs)))
    del outs
    return sorted(times)[1] * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    ap.add_argument("--tokens", default="1,4,16,64,256,1024,4096,16384")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    device = torch.device("cuda")
    runs = []
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    for name in args.shapes.split(","):
        sh = SHAPES[name]
        layer = Layer(sh["hidden"], sh["inter"], sh["experts"], sh["top_k"], device)
        for T in [int(t) for t in args.tokens.split(",")]:
            g = torch.Generator(device=device).manual_seed(T)
            inputs = [(torch.rand(T, sh["hidden"], generator=g, device=device) * 2 - 1).to(torch.bfloat16)
                      for _ in range(INPUTS)]
            try:
                layer.forward(inputs[0])
            except Exception as e:  # noqa: BLE001
                if layer.aligned:
                    raise
                print(f"  unaligned grouped_mm refused ({str(e).splitlines()[0][:80]}); padding groups to {ALIGN}")
                layer.aligned = True
            eager = time_eager(layer, inputs)
            try:
                graph = time_graph(layer, inputs)
            except Exception as e:  # noqa: BLE001
                print(f"  graph capture failed: {str(e).splitlines()[0][:100]}")
                graph = float("nan")
            best = min(eager, graph) if graph == graph else eager
            runs.append(dict(shape=name, tokens=T, eager_us=eager, graph_us=graph, best_us=best,
                             padded_groups=layer.aligned))
            print(f"  {name:14s} {T:6d} tokens: eager {eager:10.1f} us  graph {graph:10.1f} us")
            sys.stdout.flush()
            del inputs
        del layer
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(benchmark="moe_layer_torch", torch=torch.__version__,
                           device=torch.cuda.get_device_name(0), runs=runs), f, indent=2)


if __name__ == "__main__":
    main()
