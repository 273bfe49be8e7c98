#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Where the survivors of a killed worker wait: samples every flexpert worker's threads
(/proc: state, the system call each sits in, its first argument, wchan), and with
--front-end the threads of the front end (`flexpert serve` or `bench`) too, while a run such as
`flexpert bench elastic --events 3:kill:1` goes on, and reports, relative to the first kill
it sees (a worker whose leader is exiting, a zombie or gone), every stretch of at least
--min-ms that a surviving thread spent in one ioctl or in uninterruptible sleep, with the
kernel stack read in its middle (root only), and when the killed worker was gone.

  python3 bench/kill_probe.py --out probe.txt --seconds 60 &   # then start the run

docs/benchmarks.md, "Losing a rank", says what it found.
"""
import argparse
import os
import time

SYSCALLS = {"0": "read", "1": "write", "7": "poll", "16": "ioctl", "24": "sched_yield",
            "35": "nanosleep", "202": "futex", "232": "epoll_wait", "270": "pselect6",
            "271": "ppoll", "281": "epoll_pwait", "230": "clock_nanosleep"}
PF_EXITING = 0x4


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def processes(kinds):
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        cmd = read(f"/proc/{pid}/cmdline")
        if cmd and cmd.split("\0")[1:2] and cmd.split("\0")[1] in kinds:
            out.append(int(pid))
    return out


def workers():
    return processes(("worker",))


def leader_exiting(pid):
    stat = read(f"/proc/{pid}/stat")
    if stat is None:
        return True
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0] in "ZX" or int(fields[6]) & PF_EXITING != 0


def thread_sample(pid, tid):
    stat = read(f"/proc/{pid}/task/{tid}/stat")
    if stat is None:
        return None
    comm = stat[stat.index("(") + 1:stat.rindex(")")]
    state = stat[stat.rindex(")") + 2]
    sc = (read(f"/proc/{pid}/task/{tid}/syscall") or "").split()
    nr = sc[0] if sc else "?"
    arg = sc[2] if len(sc) > 2 else ""
    where = SYSCALLS.get(nr, "running" if nr == "running" else f"sys{nr}")
    if where == "ioctl":
        where += " " + arg
    return comm, state, where


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=60, help="give up after this long")
    ap.add_argument("--after-ms", type=float, default=1500, help="sample this long after a kill")
    ap.add_argument("--min-ms", type=float, default=5)
    ap.add_argument("--interval-ms", type=float, default=2)
    ap.add_argument("--front-end", action="store_true",
                    help="also the front end's threads: any stretch in one system call other "
                         "than an idle wait (epoll, poll, nanosleep), futex included")
    a = ap.parse_args()
    start = time.monotonic()
    known = set()
    victim = t_kill = t_gone = None
    runs = {}   # (pid, tid) -> [comm, what, since, last, stack]
    found = []  # finished stretches
    while time.monotonic() - start < a.seconds:
        now = time.monotonic()
        if t_kill is not None and now - t_kill > a.after_ms / 1e3:
            break
        pids = workers()
        if t_kill is None:
            for pid in pids:
                known.add(pid)
            for pid in sorted(known):
                if leader_exiting(pid):
                    victim, t_kill = pid, now
                    break
        elif t_gone is None and read(f"/proc/{victim}/stat") is None:
            t_gone = now
        front = processes(("serve", "bench")) if a.front_end else []
        for pid in pids + front:
            if pid == victim:
                continue
            for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
                s = thread_sample(pid, tid)
                if s is None:
                    continue
                comm, state, where = s
                what = "D " + where if state == "D" else where
                idle = where in ("epoll_wait", "epoll_pwait", "poll", "ppoll", "nanosleep",
                                 "clock_nanosleep", "pselect6")
                interesting = state == "D" or where.startswith("ioctl") or (
                    pid in front and t_kill is not None and not idle)
                key = (pid, tid)
                run = runs.get(key)
                if run and run[1] == what:
                    run[3] = now
                    if run[4] is None and (now - run[2]) * 1e3 >= a.min_ms:
                        run[4] = (read(f"/proc/{pid}/task/{tid}/stack") or "").strip()
                    continue
                if run and (run[3] - run[2]) * 1e3 >= a.min_ms:
                    found.append((pid, tid) + tuple(run))
                runs[key] = [comm, what, now, now, None] if interesting else None
        time.sleep(a.interval_ms / 1e3)
    for key, run in runs.items():
        if run and (run[3] - run[2]) * 1e3 >= a.min_ms:
            found.append(key + tuple(run))
    with open(a.out, "w") as f:
        if t_kill is None:
            f.write("no kill seen\n")
            return
        f.write(f"kill seen: worker pid {victim}; gone {((t_gone or now) - t_kill) * 1e3:.0f} ms "
                f"later{'' if t_gone else ' (still there at the end)'}\n")
        f.write("survivor threads' stretches in one ioctl or uninterruptible sleep "
                f">= {a.min_ms} ms (ms from the kill):\n")
        for pid, tid, comm, what, since, last, stack in sorted(found, key=lambda x: x[4]):
            if t_kill is not None and last < t_kill - 0.1:
                continue
            f.write(f"  pid {pid} tid {tid} ({comm}): {what}, {(since - t_kill) * 1e3:.0f} .. "
                    f"{(last - t_kill) * 1e3:.0f} ms\n")
            if stack:
                f.write("    " + stack.replace("\n", "\n    ") + "\n")


if __name__ == "__main__":
    main()
