#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Chaos benchmark: random kills, stops, scales and rebalances under load against the
real `flexpert serve` binary, for a bounded time (docs/benchmarks.md, "Losing a rank").

Streaming greedy clients send the reference prompts of the tiny checkpoint and check
every completion against its reference; the longest gap between two tokens of one
stream is the stall. Events come at random intervals from a seeded generator (the seed
is printed: `--seed` replays the schedule). At the end the group must be serving, the
server must stop cleanly and leave no shared-memory segment or process behind.

    python3 bench/chaos.py --duration 120 --json out/chaos.json --plot out/chaos.png
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def http(port, method, path, body=None, timeout=120):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as res:
            return res.status, res.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, str(e).encode()


def status(port):
    code, body = http(port, "GET", "/v1/status", timeout=10)
    return json.loads(body) if code == 200 else None


class Clients:
    """Streaming greedy clients; every answer is checked against the reference."""

    def __init__(self, port, ref, n):
        self.port, self.ref = port, ref
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ok = self.failed = self.wrong = 0
        self.max_gap_s = 0.0
        self.gaps = []  # (time of the later token, gap in s) over 50 ms
        self.threads = [threading.Thread(target=self.run, args=(c,)) for c in range(n)]
        for t in self.threads:
            t.start()

    def one(self, prompt, expected):
        body = {"prompt": prompt, "max_tokens": len(expected), "temperature": 0, "stream": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        tokens, last, gap = [], None, 0.0
        try:
            with urllib.request.urlopen(req, timeout=120) as res:
                for raw in res:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return "failed", gap
                    now = time.monotonic()
                    ids = chunk["choices"][0].get("token_ids", [])
                    if ids and last is not None and now - last > gap:
                        gap = now - last
                        if gap > 0.05:
                            with self.lock:
                                self.gaps.append((now, gap))
                    if ids:
                        last = now
                    tokens += ids
        except Exception:  # noqa: BLE001 - any transport error is a failed request
            return "failed", gap
        return ("ok" if tokens == expected else "wrong"), gap

    def run(self, c):
        i = c
        while not self.stop.is_set():
            p = self.ref["prompts"][i % len(self.ref["prompts"])]
            i += 1
            outcome, gap = self.one(p["input_ids"], p["greedy"])
            with self.lock:
                setattr(self, outcome, getattr(self, outcome) + 1)
                self.max_gap_s = max(self.max_gap_s, gap)

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join()


def shm_segments(pid):
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"flexpert-{pid}-")]


def children(pid):
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                with open(f"/proc/{e}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(e))
            except (OSError, IndexError, ValueError):
                pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default=os.path.join(ROOT, "build/flexpert"))
    ap.add_argument("--model", default=os.path.join(ROOT, "testdata/qwen3moe-tiny"))
    ap.add_argument("--duration", type=float, default=120, help="seconds of chaos")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--max-ranks", type=int, default=4)
    ap.add_argument("--min-ranks", type=int, default=3,
                    help="serve --min-ranks and the smallest scale target (a kill in a group "
                         "of more recovers in place, one at this size needs a replacement)")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--gap", type=float, nargs=2, default=[1.5, 4.0],
                    help="seconds between events: uniform in [A, B]")
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"seed {seed} (replay with --seed {seed})", flush=True)
    rng = random.Random(seed)
    with open(os.path.join(a.model, "reference.json")) as f:
        ref = json.load(f)

    server = subprocess.Popen(
        [a.binary, "serve", "--model", a.model, "--port", "0", "--ranks", str(a.ranks),
         "--max-ranks", str(a.max_ranks), "--min-ranks", str(a.min_ranks),
         "--threads-per-worker", "1", "--heartbeat-timeout-ms",
         "1000", "--transport-timeout-ms", "5000", "--eplb-window-s", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    port = 0
    for line in server.stdout:
        if line.startswith("serving on http://127.0.0.1:"):
            port = int(line.split(":")[2].split()[0])
            break
    if not port:
        sys.exit("the server did not start")
    threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()

    clients = Clients(port, ref, a.clients)
    events, recoveries, seen = [], [], set()
    stopped = {}  # pid -> time to SIGCONT
    t0 = time.monotonic()

    def watch():
        while not clients.stop.is_set():
            s = status(port)
            rec = s["reconfiguration"].get("last_recovery", {}) if s else {}
            if rec.get("epoch") is not None and rec["epoch"] not in seen:
                seen.add(rec["epoch"])
                recoveries.append(rec)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    next_event = t0 + rng.uniform(*a.gap)
    while time.monotonic() - t0 < a.duration:
        now = time.monotonic()
        for pid, until in list(stopped.items()):
            if now >= until:
                os.kill(pid, signal.SIGCONT) if os.path.exists(f"/proc/{pid}") else None
                del stopped[pid]
        if now < next_event:
            time.sleep(0.02)
            continue
        next_event = now + rng.uniform(*a.gap)
        s = status(port)
        if not s:
            continue
        serving = [r for r in s["ranks"] if r["state"] == "serving" and r["pid"] > 0]
        kind = rng.choice(["kill", "kill", "stop", "scale", "rebalance"])
        ev = {"t": round(now - t0, 2), "kind": kind}
        if kind in ("kill", "stop") and serving:
            victim = rng.choice(serving)
            ev["rank"] = victim["rank"]
            if kind == "kill":
                os.kill(victim["pid"], signal.SIGKILL)
            else:
                os.kill(victim["pid"], signal.SIGSTOP)
                stopped[victim["pid"]] = now + rng.uniform(0.3, 3.0)  # Sometimes past 1 s.
        elif kind == "scale":
            ev["to"] = rng.randint(a.min_ranks, a.max_ranks)
            threading.Thread(target=lambda to=ev["to"], e=ev: e.update(
                answer=http(port, "POST", "/v1/scale", {"ranks": to})[0])).start()
        elif kind == "rebalance":
            threading.Thread(target=lambda e=ev: e.update(
                answer=http(port, "POST", "/v1/eplb/rebalance", {})[0])).start()
        events.append(ev)
        print(f"{ev['t']:7.2f} s  {kind:9s} {ev.get('rank', ev.get('to', ''))}", flush=True)
    for pid in stopped:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGCONT)
    # Settle: serving again at the end (a heal may still run).
    deadline = time.monotonic() + 60
    final = status(port)
    while time.monotonic() < deadline and not (
            final and final["phase"] == "serving" and not final["reconfiguration"]["in_progress"]):
        time.sleep(0.2)
        final = status(port)
    time.sleep(1.0)
    clients.finish()
    watcher.join()
    code, metrics = http(port, "GET", "/metrics", timeout=10)
    held = 0
    for line in metrics.decode().splitlines():
        if line.startswith("flexpert_requests_held_total"):
            held = int(float(line.split()[1]))
    workers = children(server.pid)
    server.send_signal(signal.SIGTERM)
    rc = server.wait(timeout=60)
    leftover = shm_segments(server.pid)
    times = sorted(r.get("recover_s", 0) for r in recoveries if r.get("status") == "ok")

    def pct(p):
        return times[min(len(times) - 1, int(p * len(times)))] if times else 0.0

    result = {
        "seed": seed, "duration_s": a.duration, "events": events,
        "requests": {"ok": clients.ok, "failed": clients.failed, "wrong": clients.wrong,
                     "held": held},
        "scales": {"ok": sum(1 for e in events if e["kind"] == "scale" and e.get("answer") == 200),
                   "refused": sum(1 for e in events
                                  if e["kind"] == "scale" and e.get("answer") != 200)},
        "recoveries": {"count": len(times),
                       "failed": sum(1 for r in recoveries if r.get("status") != "ok"),
                       "replacement": sum(1 for r in recoveries if r.get("replacements")),
                       "p50_s": pct(0.5), "max_s": times[-1] if times else 0.0},
        "longest_stall_ms": clients.max_gap_s * 1e3,
        "final": {"phase": final["phase"] if final else None,
                  "members": final["members"] if final else None, "workers": len(workers),
                  "server_exit": rc, "shm_left": len(leftover)},
    }
    counts = {k: sum(1 for e in events if e["kind"] == k)
              for k in ("kill", "stop", "scale", "rebalance")}
    print(f"\nseed {seed}, {a.duration:.0f} s, events: " +
          ", ".join(f"{n} {k}" for k, n in counts.items()))
    print(f"{'requests ok':>22} {clients.ok:8d}")
    print(f"{'failed':>22} {clients.failed:8d}")
    print(f"{'wrong tokens':>22} {clients.wrong:8d}")
    print(f"{'held at the front end':>22} {held:8d}")
    print(f"{'recoveries':>22} {len(times):8d}  ({result['recoveries']['replacement']} with "
          f"replacements, {result['recoveries']['failed']} failed)")
    print(f"{'recovery p50 / max':>22} {pct(0.5) * 1e3:6.0f} / {result['recoveries']['max_s'] * 1e3:.0f} ms")
    print(f"{'longest stall':>22} {clients.max_gap_s * 1e3:6.0f} ms")
    print(f"{'scales ok / refused':>22} {result['scales']['ok']:4d} / {result['scales']['refused']}"
          " (409 while another change runs)")
    print(f"{'end':>22} phase {result['final']['phase']}, members {result['final']['members']}, "
          f"server exit {rc}, shm left {len(leftover)}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {a.json}")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(10, 3.5))
        if clients.gaps:
            ax.scatter([t - t0 for t, _ in clients.gaps], [g * 1e3 for _, g in clients.gaps],
                       s=8, label="token gaps > 50 ms")
        colors = {"kill": "red", "stop": "orange", "scale": "green", "rebalance": "purple"}
        for k, c in colors.items():
            for i, e in enumerate(x for x in events if x["kind"] == k):
                ax.axvline(e["t"], color=c, alpha=0.4, label=k if i == 0 else None)
        ax.set_xlabel("seconds")
        ax.set_ylabel("gap between tokens (ms)")
        ax.set_title(f"chaos, seed {seed}: {clients.failed} failed of "
                     f"{clients.ok + clients.failed + clients.wrong}")
        ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
        print(f"wrote {a.plot}")
    bad = clients.failed + clients.wrong + len(leftover) + (rc != 0) + \
        (result["final"]["phase"] != "serving")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
