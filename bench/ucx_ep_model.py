#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Per-message costs of the ucx transport, and a MODEL of the EP exchange built on them.

`measure` runs transport_exchange_bandwidth (tests/transport) over a grid of ranks and payload
sizes and gathers its JSON into one file; run it under scripts/netns_conformance.sh to place
the ranks in network namespaces (rank r in namespace r % N):

    bash scripts/netns_conformance.sh build --rate 25gbit --hosts 4 -- \\
        python3 bench/ucx_ep_model.py measure --ranks 4 --json out/ucx/sweep-4ns.json

`model` takes, per configuration, a small exchange's time and the bytes/s of the largest, a
per-message overhead from how the small exchange grows with the ranks, and then computes (does
not measure) the EP all-to-all of DeepSeek-V3 shapes for EP 32 and 64 over a 400 Gbit/s RDMA
NIC per rank. Its assumptions are printed with it:

    python3 bench/ucx_ep_model.py model out/ucx/sweep-*.json --json out/ucx/model.json \\
        [--plot out/ucx/model.png]
"""
import argparse
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW_BYTES = 7168 * 2  # DeepSeek-V3 hidden size, bf16.


def measure(a):
    results = []
    for n in [int(x) for x in a.ranks.split(",")]:
        for size in [int(x) for x in a.bytes.split(",")]:
            # About --mb MiB sent per rank in all, between 20 and 1000 ops.
            iters = max(20, min(1000, (a.mb << 20) // max(1, size * max(1, n - 1))))
            runs = []
            for _ in range(a.repeats):
                out = f"/tmp/ucx_ep_model_{os.getpid()}.json"
                cmd = [a.binary, "--backend", "ucx", "--ranks", str(n), "--bytes", str(size),
                       "--iters", str(iters), "--json", out]
                run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, timeout=a.timeout_s)
                if run.returncode != 0:
                    sys.exit(f"{' '.join(cmd)} failed:\n{run.stdout}")
                with open(out) as f:
                    runs.append(json.load(f))
                os.remove(out)
            # The best of the repeats: other work on the machine only ever adds time.
            r = min(runs, key=lambda x: x["exchange_us"])
            r["exchange_us_runs"] = [x["exchange_us"] for x in runs]
            r["read_us_runs"] = [x.get("read_us", 0) for x in runs]
            netns = os.environ.get("FLEXPERT_CONFORMANCE_NETNS", "")
            r["namespaces"] = len(netns.split(",")) if netns else 0
            results.append(r)
            print(f"{n} ranks, {size:9d} B per peer: exchange {r['exchange_us']:9.1f} us, "
                  f"read {r.get('read_us', 0):9.1f} us", flush=True)
    doc = {"loadavg": os.getloadavg(), "cpus": os.cpu_count(), "rate": a.rate,
           "ucx_tls": os.environ.get("UCX_TLS", ""), "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {a.json}")


def parts_us(sc, ep, bytes_out, copy_gbps, link_gbps):
    """The model's terms in us: software (c + alpha * (EP - 1)), copy, wire."""
    return (sc["c_us"] + sc["alpha_us"] * (ep - 1), bytes_out / (copy_gbps * 1e3),
            bytes_out / (link_gbps * 1e3))


def rows_to_others(ranks, top_k):
    """Rows a token sends to other ranks: flexpert's EpMoeExecutor sends every routed
    (token, k) row to the rank of its slot (src/moe/ep_executor.h), with experts spread
    evenly and routing uniform: top_k * (ranks - 1) / ranks."""
    return top_k * (ranks - 1) / ranks


def model(a):
    configs = {}
    for path in a.sweeps:
        with open(path) as f:
            doc = json.load(f)
        for r in doc["results"]:
            key = (r["ranks"], r["namespaces"], doc.get("rate", ""), r.get("ucx_tls", ""))
            configs.setdefault(key, {"source": path, "loadavg": doc["loadavg"], "points": []})
            configs[key]["points"].append(r)
    fits = []
    print("Measured (the sweeps, best of the repeats): small = the fastest exchange of "
          f"{a.small_bytes} B a peer or less; large = the largest payload; B = what one rank "
          "sends to the others a second beyond the small exchange's time")
    print(f"{'ranks':>5} {'netns':>5} {'cap':>7} {'UCX_TLS':>9} {'small us':>9} {'large B':>9} "
          f"{'large us':>9} {'B GB/s':>7} {'read GB/s':>9}")
    for (n, ns, rate, tls), c in sorted(configs.items()):
        pts = sorted(c["points"], key=lambda r: r["bytes"])
        t_small = min(r["exchange_us"] for r in pts if r["bytes"] <= a.small_bytes)
        big = pts[-1]
        bw = (n - 1) * big["bytes"] / max(1e-9, big["exchange_us"] - t_small) / 1e3
        f = {"ranks": n, "namespaces": ns, "rate": rate, "ucx_tls": tls, "small_us": t_small,
             "large_bytes": big["bytes"], "large_us": big["exchange_us"], "large_gbps": bw,
             "large_read_gbps": big.get("read_gbps", 0), "source": c["source"],
             "loadavg": c["loadavg"]}
        fits.append(f)
        print(f"{n:5d} {ns:5d} {rate or '-':>7} {tls:>9} {t_small:9.1f} {big['bytes']:9d} "
              f"{big['exchange_us']:9.0f} {bw:7.2f} {big.get('read_gbps', 0):9.2f}")
    # Per-message overhead: how a small exchange (--small-bytes a peer or less) grows with the peers
    # at the same cap, t_small = c + alpha * (ranks - 1).
    small = {}  # The fastest exchange of --small-bytes or less: latency, not bytes.
    for (n, ns, rate, tls), c in configs.items():
        ts = [r["exchange_us"] for r in c["points"] if r["bytes"] <= a.small_bytes]
        if ts:
            small[(n, ns, rate, tls)] = min(ts)
    alphas = []
    for k4, t4 in small.items():
        for k2, t2 in small.items():
            if k2[0] < k4[0] and k2[2:] == k4[2:]:
                alphas.append({"from": list(k2[:2]), "to": list(k4[:2]), "ucx_tls": k4[3],
                               "small_bytes": a.small_bytes,
                               "alpha_us": (t4 - t2) / (k4[0] - k2[0])})
    for al in alphas:
        print(f"per-message overhead, exchanges of {a.small_bytes} B or less, {al['ucx_tls']}: "
              f"{al['from']} -> {al['to']} (ranks, namespaces): {al['alpha_us']:.1f} us per "
              f"extra peer")
    # Two software costs per exchange, t_small = c + alpha * (ranks - 1): as measured over
    # TCP between namespaces (the largest alpha of those pairs), and UCX over shared memory
    # (shm,self: the backend and UCX without a network stack).
    scenarios = []
    for tls, what in (("tcp", "software as measured over TCP"),
                      ("shm,self", "software as measured over shm,self")):
        cand = [al for al in alphas if al["ucx_tls"] == tls]
        if not cand:
            continue
        al = max(cand, key=lambda x: x["alpha_us"])
        two = [t for k, t in small.items() if k[0] == al["from"][0] and k[3] == tls]
        alpha = al["alpha_us"]
        c = max(0.0, min(two) - alpha * (al["from"][0] - 1))
        scenarios.append({"name": what, "ucx_tls": tls, "alpha_us": alpha, "c_us": c})
    link = a.link_gbit / 8  # GB/s
    print(f"\nMODEL, not a measurement: one EP all-to-all (the dispatch; the combine moves the "
          f"same bytes back) at DeepSeek-V3 shapes over {a.link_gbit:g} Gbit/s RDMA")
    print("  t = c + alpha * (EP - 1) + S / copy + S / link; S = bytes a rank sends to the others")
    for sc in scenarios:
        print(f"  {sc['name']}: c {sc['c_us']:.1f} us, alpha {sc['alpha_us']:.1f} us a peer")
    print(f"  link {link:g} GB/s a rank (one NIC a rank, full bisection, no congestion, every peer "
          f"remote); staging copy {a.copy_gbps:g} GB/s (the ucx backend copies each payload "
          f"into its staging slot)")
    print(f"  rows: top-{a.top_k} of {a.experts} experts, experts even over the ranks, uniform "
          f"routing, every (token, k) row sent (no merging per rank), {ROW_BYTES} B a row "
          f"(7168 bf16)")
    head = f"{'EP':>4} {'tokens':>7} {'S MB':>8} {'KB a peer':>9} {'wire us':>8} {'copy us':>8}"
    for i, sc in enumerate(scenarios):
        head += f" {'msgs us (' + str(i + 1) + ')':>13} {'total us (' + str(i + 1) + ')':>14}"
    print(head)
    rows = []
    for ep in a.ep:
        for tokens in a.tokens:
            s = tokens * rows_to_others(ep, a.top_k) * ROW_BYTES
            _, copy, wire = parts_us({"c_us": 0, "alpha_us": 0}, ep, s, a.copy_gbps, link)
            r = {"ep": ep, "tokens_per_rank": tokens, "bytes_to_others": s,
                 "bytes_per_peer": s / (ep - 1), "wire_us": wire, "copy_us": copy,
                 "scenarios": []}
            line = (f"{ep:4d} {tokens:7d} {s / 1e6:8.1f} {s / (ep - 1) / 1e3:9.1f} {wire:8.0f} "
                    f"{copy:8.0f}")
            for sc in scenarios:
                msgs = parts_us(sc, ep, s, a.copy_gbps, link)[0]
                total = msgs + copy + wire
                r["scenarios"].append({"name": sc["name"], "messages_us": msgs,
                                       "total_us": total})
                line += f" {msgs:13.0f} {total:14.0f}"
            rows.append(r)
            print(line)
    for i, sc in enumerate(scenarios):
        print(f"  ({i + 1}) {sc['name']}")
    out = {"kind": "MODEL, not a measurement",
           "assumptions": {"link_gbit": a.link_gbit, "link_gbytes_per_s": link,
                           "copy_gbps": a.copy_gbps, "top_k": a.top_k, "experts": a.experts,
                           "row_bytes": ROW_BYTES, "small_bytes": a.small_bytes,
                           "scenarios": scenarios,
                           "pattern": "all-to-all, every (token, k) row to its expert's rank, "
                                      "uniform routing, all peers remote, no congestion"},
           "measured_fits": fits, "per_message": alphas, "model": rows}
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {a.json}")
    if a.plot:
        try:
            import matplotlib
        except ImportError:
            sys.exit("--plot needs matplotlib (pip install matplotlib)")
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = [2 ** i for i in range(4, 14)]  # 16 ... 8192 tokens a rank
        for ep in a.ep:
            bytes_out = [x * rows_to_others(ep, a.top_k) * ROW_BYTES for x in xs]
            for sc in scenarios:
                ax.plot(xs, [sum(parts_us(sc, ep, b, a.copy_gbps, link)) / 1e3 for b in bytes_out],
                        label=f"EP {ep}: {sc['name']}")
            ax.plot(xs, [b / (link * 1e3) / 1e3 for b in bytes_out], ls="--",
                    label=f"EP {ep}: the wire alone")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("one all-to-all, ms (MODEL)")
        ax.set_title(f"MODEL: DeepSeek-V3 dispatch over {a.link_gbit:g} Gbit/s RDMA")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
        print(f"wrote {a.plot}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="run the sweep (under scripts/netns_conformance.sh)")
    m.add_argument("--binary",
                   default=os.path.join(ROOT, "build/tests/transport/transport_exchange_bandwidth"))
    m.add_argument("--ranks", default="2,4")
    m.add_argument("--bytes", default="64,4096,65536,229376,1048576,3670016")
    m.add_argument("--mb", type=int, default=64, help="MiB a rank sends per point, roughly")
    m.add_argument("--repeats", type=int, default=3, help="runs per point; the fastest is kept")
    m.add_argument("--rate", default="", help="the tc cap in force, recorded only")
    m.add_argument("--timeout-s", type=int, default=120, help="per run")
    m.add_argument("--json", required=True)
    p = sub.add_parser("model", help="fit the sweeps and compute the model")
    p.add_argument("sweeps", nargs="+")
    p.add_argument("--ep", type=lambda s: [int(x) for x in s.split(",")], default=[32, 64])
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")],
                   default=[128, 4096])
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--link-gbit", type=float, default=400)
    p.add_argument("--copy-gbps", type=float, default=10,
                   help="memcpy GB/s of the staging copy (transport_bench prints this host's)")
    p.add_argument("--small-bytes", type=int, default=4096,
                   help="the exchanges of this payload or less give the per-message overhead")
    p.add_argument("--json", default="")
    p.add_argument("--plot", default="")
    a = ap.parse_args()
    measure(a) if a.cmd == "measure" else model(a)


if __name__ == "__main__":
    main()
