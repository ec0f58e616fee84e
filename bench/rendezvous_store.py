"""Round formation through the master's rendezvous store, beside torch.distributed's TCPStore.

    .venv/bin/python bench/rendezvous_store.py [--worlds 2,4] [--trials 15] [--gap 1.0] [--json]

What a round's members do when the master closes a round (tidal.worker.comm ``RoundComm.connect``):
build a store client under the round's prefix and construct ``ProcessGroupGloo`` on it; then
the first collective. Measured for both stores, the same way:

- tidal: ``MasterStore`` (tidal.worker.store), HTTP long-polls to a real ``tidal run`` master on
  127.0.0.1 (bearer token, ``/v1/store``), the master also serving its idle worker's heartbeats;
- peer: ``dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False))``, what tidal
  did before, against a ``TCPStore`` server held by this process (the master held it before).

``world`` member processes start once per (store, world) and import torch; then every trial
``i`` starts on a shared clock (``t0 + i * gap``, all members together, as after a
rendezvous), under a fresh prefix. Per trial, "formed" is the slowest member's time from the
trial's start to its ``ProcessGroupGloo`` returning (the group exists for all only then), and
"+ all-reduce" the slowest member's time to the end of a first one-element all-reduce. Reported:
median, p90 and max over the trials, and the median's ratio to the peer's. Everything shares
the machine's cores (the 1-minute load average is printed): read the numbers side by side.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import PYTHON, ROOT, TIDAL, bench_env, load_average, stop, table

TIMEOUT = datetime.timedelta(seconds=30)
SLEEPER = textwrap.dedent(
    """
    import os, time
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.2)
    """
)


# ---------------------------------------------------------------------------- one member process
def member(kind: str, where: str, token: str, prefix: str, rank: int, world: int, trials: int, gap: float) -> None:
    """Form ``trials`` groups, one per start time; print one JSON line per trial."""
    import torch
    import torch.distributed as dist

    from tidal.worker.store import MasterStore

    print("ready", flush=True)
    t0 = float(sys.stdin.readline())
    for i in range(trials):
        start = t0 + i * gap
        time.sleep(max(0.0, start - time.time()))
        store: Any
        if kind == "tcp":
            host, port = where.rsplit(":", 1)
            store = dist.PrefixStore(f"{prefix}t{i}/", dist.TCPStore(host, int(port), is_master=False,
                                                                     timeout=TIMEOUT))
        else:
            store = MasterStore(where, token, f"{prefix}t{i}/", timeout=TIMEOUT)
        group = dist.ProcessGroupGloo(store, rank, world, TIMEOUT)
        formed = time.time() - start
        one = torch.ones(1)
        group.allreduce([one]).wait()
        reduced = time.time() - start
        print(json.dumps({"trial": i, "rank": rank, "formed": formed, "reduced": reduced}), flush=True)
        group.shutdown()
        if kind != "tcp":
            store.close()


# ---------------------------------------------------------------------------- the driver
def run_members(kind: str, where: str, token: str, prefix: str, world: int, trials: int,
                gap: float) -> list[dict[str, float]]:
    argv = [PYTHON, str(Path(__file__).resolve()), "--member", kind, where, token, prefix]
    procs = [subprocess.Popen([*argv, str(rank), str(world), str(trials), str(gap)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=bench_env(), cwd=ROOT)
             for rank in range(world)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready", f"a {kind} member did not start"
    t0 = time.time() + 0.5
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(f"{t0}\n")
        p.stdin.flush()
    lines = [json.loads(line) for p in procs for line in p.communicate(timeout=60 + trials * gap)[0].splitlines()]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a {kind} member failed")
    per_trial: list[dict[str, float]] = []
    for i in range(trials):
        rows = [r for r in lines if r["trial"] == i]
        assert len(rows) == world
        per_trial.append({"formed": max(r["formed"] for r in rows), "reduced": max(r["reduced"] for r in rows)})
    return per_trial


def start_master(work: Path) -> tuple[Any, str, str, str]:
    script = work / "sleeper.py"
    script.write_text(SLEEPER)
    job_dir = work / "job"
    log = open(work / "master.log", "wb")
    proc = subprocess.Popen([TIDAL, "run", "--workers", "1:1", "--job-dir", str(job_dir), "--port", "0", "-q",
                             "--heartbeat-timeout", "600", str(script)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=bench_env(TIDAL_HOME=str(work / "home")), cwd=work)
    log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            info = json.loads((job_dir / "job.json").read_text())
            return proc, info["url"], info["token"], f"tidal/{info['job_id']}/round0/"
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)
    stop(proc)
    raise SystemExit("the master did not start")


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between trial starts")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    with tempfile.TemporaryDirectory(prefix="tidal-bench-store-") as tmp:
        master, url, token, prefix = start_master(Path(tmp))
        results: dict[str, dict[int, list[dict[str, float]]]] = {"tidal": {}, "tcpstore": {}}
        try:
            for world in (int(w) for w in args.worlds.split(",")):
                results["tcpstore"][world] = run_members("tcp", f"127.0.0.1:{server.port}", "", f"bench/w{world}/",
                                                         world, args.trials, args.gap)
                results["tidal"][world] = run_members("master", url, token, f"{prefix}w{world}/",
                                                      world, args.trials, args.gap)
        finally:
            stop(master)
    if args.json:
        print(json.dumps(results))
        return
    rows = [["world", "store", "formed p50 ms", "p90", "max", "+ all-reduce p50 ms", "formed vs peer"]]
    for world in results["tidal"]:
        peer = statistics.median(t["formed"] for t in results["tcpstore"][world])
        for name in ("tidal", "tcpstore"):
            formed = [t["formed"] * 1e3 for t in results[name][world]]
            reduced = [t["reduced"] * 1e3 for t in results[name][world]]
            rows.append([str(world), "tidal MasterStore" if name == "tidal" else "peer TCPStore",
                         f"{statistics.median(formed):.1f}", f"{quantile(formed, 0.9):.1f}", f"{max(formed):.1f}",
                         f"{statistics.median(reduced):.1f}", f"{statistics.median(formed) / 1e3 / peer:.2f}x"])
    print(table(rows))
    print(f"{args.trials} trials each, load average {load_average():.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--member":
        kind, where, token, prefix, rank, world, trials, gap = sys.argv[2:10]
        member(kind, where, token, prefix, int(rank), int(world), int(trials), float(gap))
    else:
        main()
