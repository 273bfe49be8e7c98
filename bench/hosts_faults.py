#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Faults across hosts: how long the front end takes to see each kind, and a scale's commit.

The layout of tests/system/hosts_test.cc (docs/deployment.md): three network namespaces on a
bridge, the front end in one (`serve --no-spawn --transport ucx`), ranks 0, 1 on host a and
2, 3 on host b (`flexpert worker --join`, UCX_TLS=tcp), greedy streaming clients checked
against the tiny checkpoint's reference. Each round injects one fault on host b under load:

  kill   SIGKILL of a worker (a peer's UCX endpoint error, or the heartbeat)
  kill-idle  the same with no request in flight (the clients stopped 0.5 s before)
  stop   SIGSTOP of a worker (silence: the heartbeat), SIGCONT once it is out
  cut    every packet in or out of host b dropped by nftables (silence), lifted after
  leave  SIGTERM of a worker (a graceful leave: a live scale-down it asks for)

*detected*: from the fault (the signal sent; for a cut, the nft command returned) to the first
/v1/status (polled every --poll-ms) whose members lack the victims; *serving*: to the first
serving with the survivors and no reconfiguration in progress; *cause*: what the front end
recorded for the victim; *longest gap*: between two tokens of a stream, over the event (the
clients keep only gaps over 50 ms). The group is then scaled back
to 4 with joiners (`--rank auto`) on host b; the scale's answer gives prepare and commit.
Figures only, nothing asserted beyond the clients' answers. Needs root (ip netns, veth,
bridge, nft) and a build with the ucx backend; every namespace and process it made is
removed on exit, and the whole run is bounded by --timeout-s.

    sudo python3 bench/hosts_faults.py --runs 3 --json out/hosts_faults.json
"""
import argparse
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chaos import Clients, http, status  # noqa: E402 - the same checked clients

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLONE_NEWNET = 0x40000000
KEY = "flexpert-bench-hosts-key"


def sh(cmd):
    return subprocess.run(cmd, shell=True, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode


class Hosts:
    """Namespaces fqf<pid> (front end, bridge 10.79.0.1), fqa<pid> (10.79.0.2), fqb<pid>
    (10.79.0.3); each host's veth is fxv0 (one UCX_NET_DEVICES for all)."""

    def __init__(self):
        pid = os.getpid()
        self.fe = f"fqf{pid}"
        self.hosts = [f"fqa{pid}", f"fqb{pid}"]
        self.procs = []  # Every process started, killed on close().
        self.cuts = set()
        self.clients = None  # Stopped on close(), so that no thread outlives the run.

    def setup(self):
        cmds = [f"ip netns add {self.fe}", f"ip -n {self.fe} link add fxbr type bridge",
                f"ip -n {self.fe} addr add 10.79.0.1/24 dev fxbr",
                f"ip -n {self.fe} link set fxbr up", f"ip -n {self.fe} link set lo up"]
        for i, ns in enumerate(self.hosts):
            cmds += [f"ip netns add {ns}",
                     f"ip link add fxv0 netns {ns} type veth peer name fxp{i} netns {self.fe}",
                     f"ip -n {self.fe} link set fxp{i} master fxbr",
                     f"ip -n {self.fe} link set fxp{i} up",
                     f"ip -n {ns} addr add {self.address(i)}/24 dev fxv0",
                     f"ip -n {ns} link set fxv0 up", f"ip -n {ns} link set lo up"]
        for c in cmds:
            if sh(c) != 0:
                sys.exit(f"setting up the namespaces failed at: {c}")
        # UCX takes only links that are up with a carrier.
        for _ in range(50):
            if all(sh(f"ip -n {ns} link show fxv0 | grep -q 'state UP'") == 0
                   for ns in self.hosts):
                break
            time.sleep(0.1)

    @staticmethod
    def address(i):
        return f"10.79.0.{i + 2}"

    def enter_front_end(self):
        """This thread (and the threads it starts later) into the front end's namespace."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{self.fe}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                sys.exit(f"setns: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)

    def start(self, ns, argv, stdout, stderr):
        env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="fxv0", FLEXPERT_CLUSTER_KEY=KEY)
        # `ip netns exec` execs in place (the pid is the worker's) and mounts the
        # namespace's /sys, where UCX looks for the device's carrier.
        p = subprocess.Popen(["ip", "netns", "exec", ns] + argv, env=env, stdout=stdout,
                             stderr=stderr, text=True)
        self.procs.append(p)
        return p

    def cut(self, i):
        ok = sh(f"ip netns exec {self.hosts[i]} nft 'add table inet fq; "
                "add chain inet fq in { type filter hook input priority 0; policy drop; }; "
                "add chain inet fq out { type filter hook output priority 0; policy drop; }'") == 0
        if ok:
            self.cuts.add(i)
        return ok

    def lift(self, i):
        self.cuts.discard(i)
        return sh(f"ip netns exec {self.hosts[i]} nft delete table inet fq") == 0

    def close(self):
        if self.clients is not None:
            self.clients.stop.set()
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                except ProcessLookupError:
                    pass
                p.wait()
        if self.clients is not None:
            self.clients.finish()  # Their requests fail at once: the server is gone.
        for i in list(self.cuts):
            self.lift(i)
        for ns in [self.fe] + self.hosts:
            sh(f"ip netns del {ns}")


def poll_until(port, pred, timeout_s, poll_s):
    """The first status for which pred holds and the monotonic time it came; (None, t) on
    timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = status(port)
        t = time.monotonic()
        if s is not None and pred(s):
            return s, t
        if t > deadline:
            return None, t
        time.sleep(poll_s)


def serving_with(s, n):
    return (s["phase"] == "serving" and len(s["members"]) == n
            and not s["reconfiguration"]["in_progress"])


def wait_exit(p, timeout_s):
    try:
        return p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default=os.path.join(ROOT, "build/flexpert"))
    ap.add_argument("--model", default=os.path.join(ROOT, "testdata/qwen3moe-tiny"))
    ap.add_argument("--runs", type=int, default=3, help="rounds of each kind")
    ap.add_argument("--kinds", default="kill,kill-idle,stop,cut,leave")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--max-ranks", type=int, default=8, help="serve --max-ranks")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    ap.add_argument("--transport-timeout-ms", type=int, default=2000)
    ap.add_argument("--poll-ms", type=float, default=5)
    ap.add_argument("--timeout-s", type=int, default=600, help="the whole run's bound")
    ap.add_argument("--logs", default="", help="a folder for the processes' output")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    kinds = [k for k in a.kinds.split(",") if k]
    if any(k not in ("kill", "kill-idle", "stop", "cut", "leave") for k in kinds):
        sys.exit(f"unknown kind in {a.kinds}")
    if os.geteuid() != 0:
        sys.exit("needs root (ip netns, veth, bridge, nft)")
    for tool in ("ip -V", "nft --version"):
        if sh(tool) != 0:
            sys.exit(f"needs {tool.split()[0]}")
    binary, model = os.path.abspath(a.binary), os.path.abspath(a.model)
    with open(os.path.join(model, "reference.json")) as f:
        ref = json.load(f)

    hosts = Hosts()
    try:
        return run(a, kinds, binary, model, ref, hosts)
    finally:
        hosts.close()


def run(a, kinds, binary, model, ref, hosts):
    def bail(signum, _frame):
        raise SystemExit(f"stopped by signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
        signal.signal(sig, bail)
    signal.alarm(a.timeout_s)
    hosts.setup()
    hosts.enter_front_end()
    load_start = os.getloadavg()
    logs = {}

    def log(name):
        if not a.logs:
            return subprocess.DEVNULL
        os.makedirs(a.logs, exist_ok=True)
        logs[name] = logs.get(name, 0) + 1
        return open(os.path.join(a.logs, f"{name}.{logs[name]}.log"), "w")

    host_of = {}  # worker pid -> host index

    def worker(h, join, rank):
        out = log(f"worker-{'ab'[h]}")
        p = hosts.start(hosts.hosts[h], [binary, "worker", "--join", join, "--rank", str(rank)],
                        out, out)
        host_of[p.pid] = h
        return p

    server = hosts.start(
        hosts.fe,
        [binary, "serve", "--model", model, "--port", "0", "--no-spawn", "--ranks", "4",
         "--max-ranks", str(a.max_ranks), "--min-ranks", "2", "--threads-per-worker", "1",
         "--transport", "ucx", "--control-host", "10.79.0.1", "--start-timeout-ms", "30000",
         "--heartbeat-timeout-ms", str(a.heartbeat_timeout_ms), "--transport-timeout-ms",
         str(a.transport_timeout_ms)], subprocess.PIPE, log("serve"))
    port, join = 0, ""
    for line in server.stdout:
        if line.startswith("waiting for ") and "--join " in line and not join:
            join = line.split("--join ")[1].split()[0]
            for r in range(4):
                worker(0 if r < 2 else 1, join, r)
        if line.startswith("serving on http://127.0.0.1:"):
            port = int(line.split(":")[2].split()[0])
            break
    if not port:
        sys.exit("the group did not start")

    threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()
    poll_s = a.poll_ms / 1e3
    if poll_until(port, lambda s: serving_with(s, 4), 30, 0.05)[0] is None:
        sys.exit("the group is not serving with 4 ranks")

    clients = hosts.clients = Clients(port, ref, a.clients)
    time.sleep(1.0)  # Steady traffic before the first fault.
    events, scales = [], []
    finished = []  # Clients stopped for an idle fault, for the totals.

    def max_gap_ms(t0, t1):
        with clients.lock:
            return max([g * 1e3 for t, g in clients.gaps if t0 <= t <= t1], default=0.0)

    def on_b(s):
        """Serving ranks of host b, highest first: (rank, pid)."""
        out = [(r["rank"], r["pid"]) for r in s["ranks"]
               if r["state"] == "serving" and host_of.get(r["pid"]) == 1]
        return sorted(out, reverse=True)

    procs = {p.pid: p for p in hosts.procs}
    for run in range(a.runs):
        for kind in kinds:
            s = status(port)
            b = on_b(s)
            victims = b if kind == "cut" else b[:1]
            n_before = len(s["members"])
            ev = {"kind": kind, "run": run, "ranks": [r for r, _ in victims]}
            if kind == "kill-idle":
                finished.append(clients)
                clients.finish()
                time.sleep(0.5)
            t0 = time.monotonic()
            if kind in ("kill", "kill-idle"):
                os.kill(victims[0][1], signal.SIGKILL)
            elif kind == "stop":
                os.kill(victims[0][1], signal.SIGSTOP)
            elif kind == "leave":
                os.kill(victims[0][1], signal.SIGTERM)
            else:
                if not hosts.cut(1):
                    sys.exit("nft refused the cut")
                # From when nft has applied the rules (the command's start would add its
                # own run time to the figure).
                ev["nft_ms"] = (time.monotonic() - t0) * 1e3
                t0 = time.monotonic()
            gone = {r for r, _ in victims}
            got, t1 = poll_until(port, lambda s: not gone & set(s["members"]), 30, poll_s)
            ev["detected_ms"] = (t1 - t0) * 1e3 if got else None
            got, t2 = poll_until(port, lambda s: serving_with(s, n_before - len(gone)), 30,
                                 poll_s)
            ev["serving_ms"] = (t2 - t0) * 1e3 if got else None
            ev["cause"] = sorted({r.get("last_error", "") for r in (got or {"ranks": []})["ranks"]
                                  if r["rank"] in gone})
            if got and kind == "leave":
                ev["cause"] = [got["reconfiguration"]["last"].get("kind", "")]
            # The victims' processes: a stopped one continues and finds itself fenced; a cut
            # host's wake up fenced once the cut is lifted.
            if kind == "stop":
                os.kill(victims[0][1], signal.SIGCONT)
            if kind == "cut":
                hosts.lift(1)
            ev["exits"] = [wait_exit(procs[pid], 20) for _, pid in victims]
            ev["stall_ms"] = max_gap_ms(t0, t2 + 0.2)
            events.append(ev)
            print(f"run {run} {kind:9s} ranks {ev['ranks']}: detected "
                  f"{ev['detected_ms'] or -1:7.1f} ms, serving {ev['serving_ms'] or -1:7.1f} ms, "
                  f"exits {ev['exits']}, cause {ev['cause']}", flush=True)
            if got is None:
                sys.exit("the group did not recover")
            # Back to 4: joiners on host b once the front end is scaling (an id opens then).
            answer = {}
            t_scale = time.monotonic()
            th = threading.Thread(target=lambda: answer.update(
                r=http(port, "POST", "/v1/scale", {"ranks": 4})))
            th.start()
            if poll_until(port, lambda s: s["phase"] == "scaling" or not th.is_alive(), 10,
                          poll_s)[0] is None or not th.is_alive():
                th.join()
                sys.exit(f"the scale back to 4 did not start: {answer.get('r')}")
            for _ in gone:
                p = worker(1, join, "auto")
                procs[p.pid] = p
            th.join()
            code, body = answer["r"]
            if code != 200:
                sys.exit(f"the scale back to 4 failed: {code} {body[:300]}")
            body = json.loads(body)
            sc = {"after": kind, "run": run, "joiners": len(gone),
                  "prepare_ms": body.get("prepare_s", 0) * 1e3,
                  "commit_ms": body.get("commit_s", 0) * 1e3,
                  "answer_ms": (time.monotonic() - t_scale) * 1e3}
            sc["stall_ms"] = max_gap_ms(t_scale, time.monotonic())
            scales.append(sc)
            print(f"      scale {4 - len(gone)} -> 4: prepare {sc['prepare_ms']:6.0f} ms, "
                  f"commit {sc['commit_ms']:5.1f} ms, longest token gap {sc['stall_ms']:5.0f} ms",
                  flush=True)
            poll_until(port, lambda s: serving_with(s, 4), 30, poll_s)
            if kind == "kill-idle":
                clients = hosts.clients = Clients(port, ref, a.clients)
            time.sleep(0.5)  # Steady traffic again.
    # The steady token gap, for reference: gaps over 50 ms are all the clients keep.
    clients.finish()
    ok, failed, wrong = (sum(getattr(c, k) for c in finished + [clients])
                         for k in ("ok", "failed", "wrong"))
    load_end = os.getloadavg()
    server.send_signal(signal.SIGTERM)
    rc = wait_exit(server, 60)

    def stats(xs):
        xs = [x for x in xs if x is not None]
        return {"min": min(xs), "median": statistics.median(xs), "max": max(xs),
                "n": len(xs)} if xs else None

    summary = {}
    for kind in kinds:
        evs = [e for e in events if e["kind"] == kind]
        summary[kind] = {"detected_ms": stats([e["detected_ms"] for e in evs]),
                         "serving_ms": stats([e["serving_ms"] for e in evs]),
                         "stall_ms": stats([e["stall_ms"] for e in evs]),
                         "causes": sorted({c for e in evs for c in e["cause"]})}
    summary["scale"] = {k: stats([s[k] for s in scales])
                        for k in ("prepare_ms", "commit_ms", "stall_ms")}
    print(f"\n{a.runs} runs per kind, --heartbeat-timeout-ms {a.heartbeat_timeout_ms}, "
          f"status polled every {a.poll_ms:g} ms; load average {load_start[0]:.1f} at the "
          f"start, {load_end[0]:.1f} at the end")
    print(f"{'fault':9s} {'detected ms min/med/max':>26s} {'serving ms min/med/max':>26s} "
          f"{'longest gap':>12s}  cause")

    def fmt(st):
        return f"{st['min']:7.1f} {st['median']:8.1f} {st['max']:8.1f}" if st else "-"

    def gap(st):
        # The clients keep only gaps over 50 ms.
        return "< 50 ms" if not st or st["max"] == 0 else f"{st['max']:.0f} ms"

    for kind in kinds:
        sm = summary[kind]
        print(f"{kind:9s} {fmt(sm['detected_ms']):>26s} {fmt(sm['serving_ms']):>26s} "
              f"{gap(sm['stall_ms']):>12s}  {'; '.join(sm['causes'])}")
    sc = summary["scale"]
    print(f"scale back to 4: prepare ms {fmt(sc['prepare_ms'])}, commit ms "
          f"{fmt(sc['commit_ms'])}, longest gap {gap(sc['stall_ms'])}")
    print(f"requests ok {ok}, failed {failed}, wrong {wrong}; server exit {rc}")
    result = {"config": {"runs": a.runs, "kinds": kinds, "clients": a.clients,
                         "heartbeat_timeout_ms": a.heartbeat_timeout_ms,
                         "transport_timeout_ms": a.transport_timeout_ms, "poll_ms": a.poll_ms,
                         "cpus": os.cpu_count(), "loadavg_start": load_start,
                         "loadavg_end": load_end},
              "events": events, "scales": scales, "summary": summary,
              "requests": {"ok": ok, "failed": failed, "wrong": wrong},
              "server_exit": rc}
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {a.json}")
    return 1 if failed or wrong or rc != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
