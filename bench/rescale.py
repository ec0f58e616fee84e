"""Training pause on a killed worker, scale-out 1->2 and scale-in 2->1: tidal vs torchrun (issue 2, part 1).

    .venv/bin/python bench/rescale.py [--repeats 3] [--json] [--keep DIR] [--tidal-only]

What is measured, the same way for both runtimes: every worker appends the wall-clock time of
every applied optimizer step to its own file (bench/common.py ``StampWriter``; tidal: the
example's loop in bench/common.py, torchrun: bench/ddp_ctr.py). The *pause* of an event is

* the largest gap between consecutive steps (of any worker) from the last step before the
  bench triggered the event (SIGKILL, scale request, agent start or stop) until 20 steps were
  made at the world size that follows it (tidal's kill: 1, the survivor; torchrun's kill: 2).

A window rather than "the gap around the kill instant": a survivor whose gradients were already
reduced finishes that step a few ms after the kill, so the gap straddling the kill instant is
not the pause.

Nothing is subtracted. Both run the same model and data (DLRM, ClickDataset, batch 512 per
worker, Adam, gloo, one thread per worker) paced with ``--step-sleep 0.02`` so steps are regular
(about 25 ms) and the 2 cores are not saturated by training (a starting process gets its CPU).

tidal (one ``tidal run --workers 1:2 --initial 1`` job): ``POST /v1/scale`` 2 then 1 (``tidal
scale`` without the CLI's start-up), ``--repeats`` times; then scale to 2 and, ``--repeats``
times, SIGKILL the worker of the highest rank and wait for its replacement to be training again.
The survivor goes on alone (MIN is 1) and the replacement joins later; that second, scale-out
like pause is reported separately ("kill, rejoin"), it is not part of the kill pause.

torchrun (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, c10d rendezvous on 127.0.0.1,
``--rdzv-conf last_call_timeout=1`` (the rendezvous keep-alive stays at its default, 3 missed
5 s keep-alives: that is most of torchrun's scale-in pause; shorter keep-alives made the second
agent declare the first one dead and train as a separate job; ``--rdzv-conf`` to try others),
``--monitor-interval 0.1``, ``--max-restarts 20``,
``--local-addr 127.0.0.1``):

* scale-out: a second agent (``--nnodes 1:2 --nproc-per-node 1``, the same endpoint) is started
  next to the running one; both restart their workers in a new rendezvous round;
* scale-in: SIGTERM to that second agent (it stops its worker and exits); the first agent's
  worker fails in its next collective and that agent re-forms alone;
* killed worker: one agent with ``--nproc-per-node 2`` (the cheapest torchrun recovery: no second
  agent to notice), SIGKILL of its second worker; torchrun restarts both.

Restarted DDP workers resume from the checkpoint rank 0 writes every 50 steps; the pause ends at
the first step applied after the restart, so re-done steps are not counted (favours torchrun).
The second agent's Python start-up happens while training goes on, as does the start of tidal's
new worker: neither is counted unless it stops training.

``--tidal-only`` skips the torchrun runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    bench_env,
    free_port,
    kill_pids,
    largest_gap,
    load_average,
    load_stamps,
    median,
    runs,
    start,
    stop,
    table,
    tidal_argv,
    torchrun_argv,
    torchrun_env,
    wait_for_steps,
)

BATCH = 512
STEP_SLEEP = 0.02
SETTLE_STEPS = 20  # steps at the new world size that end an event
EVENT_TIMEOUT = 60.0
# torchrun's rendezvous keep-alive stays at its defaults (a node is dead after 3 missed 5 s
# keep-alives): with keep_alive_interval=1,keep_alive_max_attempt=2 the second agent declared the
# first one dead while it was training and formed a separate world-1 job next to it
RDZV_CONF = "last_call_timeout=1"
TRAIN_ARGS = ["--samples", "1000000", "--epochs", "1000", "--batch-size", str(BATCH), "--step-sleep", str(STEP_SLEEP),
              "--log-every", "0"]
TORCHRUN_OPTS = ["--max-restarts", "20", "--monitor-interval", "0.1"]


class Failed(RuntimeError):
    pass


def _settle(stamps: Path, world: int, after: float) -> float:
    if not wait_for_steps(stamps, world, SETTLE_STEPS, EVENT_TIMEOUT, after=after):
        raise Failed(f"no {SETTLE_STEPS} steps at world size {world} within {EVENT_TIMEOUT:.0f}s")
    return time.time()


# ---------------------------------------------------------------------------- tidal
class TidalJob:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.stamps = work / "stamps"
        job_dir = work / "job"
        argv = tidal_argv("1:2", job_dir, self.stamps, TRAIN_ARGS, run_opts=["--initial", "1"])
        self.proc = start(argv, work / "tidal.log", bench_env())
        deadline = time.time() + 30
        while not (job_dir / "job.json").is_file():
            if time.time() > deadline or self.proc.poll() is not None:
                raise Failed("tidal run did not start")
            time.sleep(0.1)
        info = json.loads((job_dir / "job.json").read_text())
        self.http = httpx.Client(base_url=info["url"], headers={"Authorization": f"Bearer {info['token']}"}, timeout=10)

    def scale(self, n: int) -> None:
        self.http.post("/v1/scale", json={"workers": n}).raise_for_status()

    def top_rank_pid(self) -> int:
        st = self.http.get("/v1/status").json()
        active = [w for w in st["workers"] if w["state"] == "active"]
        return max(active, key=lambda w: w["rank"])["pid"]

    def close(self) -> None:
        self.http.close()
        stop(self.proc, signal.SIGINT)  # the master fails the job and SIGKILLs its workers


def run_tidal(work: Path, repeats: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"scale_out": [], "scale_in": [], "kill": [], "kill_rejoin": []}
    job = TidalJob(work)
    try:
        _settle(job.stamps, 1, 0.0)
        for _ in range(repeats):
            t = time.time()
            job.scale(2)
            done = _settle(job.stamps, 2, t)
            out["scale_out"].append(largest_gap(load_stamps(job.stamps), t, done))
            t = time.time()
            job.scale(1)
            done = _settle(job.stamps, 1, t)
            out["scale_in"].append(largest_gap(load_stamps(job.stamps), t, done))
        job.scale(2)
        _settle(job.stamps, 2, time.time())
        for _ in range(repeats):
            pid = job.top_rank_pid()
            t = time.time()
            kill_pids([pid])
            alone = _settle(job.stamps, 1, t)  # the survivor trains on alone ...
            done = _settle(job.stamps, 2, alone)  # ... until the replacement has joined
            stamps = load_stamps(job.stamps)
            out["kill"].append(largest_gap(stamps, t, alone))
            out["kill_rejoin"].append(largest_gap(stamps, alone, done))
    finally:
        job.close()
    return out


# ---------------------------------------------------------------------------- torchrun
def _agent(nnodes: str, nproc: int, work: Path, conf: str, port: int) -> list[str]:
    return torchrun_argv(nnodes, nproc, work / "stamps", TRAIN_ARGS, port=port, conf=conf, agent_opts=TORCHRUN_OPTS,
                         script_opts=["--ckpt", str(work / "ckpt.pt"), "--ckpt-every", "50"])


def run_torchrun_scale(work: Path, repeats: int, conf: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"scale_out": [], "scale_in": []}
    env = torchrun_env()
    argv = _agent("1:2", 1, work, conf, free_port())
    stamps = work / "stamps"
    first = start(argv, work / "agent-0.log", env)
    second: subprocess.Popen[bytes] | None = None
    try:
        _settle(stamps, 1, 0.0)
        for i in range(repeats):
            t = time.time()
            second = start(argv, work / f"agent-{i + 1}.log", env)
            done = _settle(stamps, 2, t)
            out["scale_out"].append(largest_gap(load_stamps(stamps), t, done))
            t = time.time()
            second.send_signal(signal.SIGTERM)
            done = _settle(stamps, 1, t)
            out["scale_in"].append(largest_gap(load_stamps(stamps), t, done))
            stop(second, signal.SIGTERM)
            second = None
    finally:
        if second is not None:
            stop(second, signal.SIGTERM)
        stop(first, signal.SIGTERM)
    return out


def run_torchrun_kill(work: Path, repeats: int, conf: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"kill": []}
    stamps = work / "stamps"
    agent = start(_agent("1:2", 2, work, conf, free_port()), work / "agent.log", torchrun_env())
    try:
        _settle(stamps, 2, 0.0)
        for _ in range(repeats):
            workers = sorted(c.pid for c in psutil.Process(agent.pid).children() if c.is_running())
            if len(workers) < 2:
                raise Failed(f"torchrun has {len(workers)} workers, expected 2")
            t = time.time()
            kill_pids([workers[-1]])
            done = _settle(stamps, 2, t)
            out["kill"].append(largest_gap(load_stamps(stamps), t, done))
    finally:
        stop(agent, signal.SIGTERM)
    return out


# ---------------------------------------------------------------------------- report
def report(tidal: dict[str, list[float]], peer: dict[str, list[float]], load: list[float], as_json: bool) -> None:
    events = ["kill", "scale_out", "scale_in"]
    result: dict[str, Any] = {"events": {}, "load_average": load}
    for ev in events:
        t, r = median(tidal[ev]), median(peer[ev])
        result["events"][ev] = {"tidal_s": round(t, 4), "torchrun_s": round(r, 4), "ratio": round(t / r, 4)}
    if as_json:
        result["runs"] = {"tidal": tidal, "torchrun": peer}
        result["kill_rejoin_tidal_s"] = round(median(tidal["kill_rejoin"]), 4)
        print(json.dumps(result))
        return
    rows = [["event (median)", "tidal s", "torchrun s", "ratio", "target", "tidal runs", "torchrun runs"]]
    targets = {"kill": "<= 0.25x, < 1 s", "scale_out": "<= 0.25x", "scale_in": "<= 0.25x"}
    for ev in events:
        t, r = median(tidal[ev]), median(peer[ev])
        rows.append([ev, f"{t:.3f}", f"{r:.3f}", f"{t / r:.2f}x", targets[ev], runs(tidal[ev]), runs(peer[ev])])
    rj = tidal["kill_rejoin"]
    rows.append(["kill, rejoin (tidal only)", f"{median(rj):.3f}", "-", "", "", runs(rj), ""])
    print(table(rows))
    print(f"load average (1 min) at start / after tidal / at end: {runs(load, '{:.2f}')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help='print {"events": {...}} as JSON')
    p.add_argument("--tidal-only", action="store_true", help="skip the torchrun runs (their cells print nan)")
    p.add_argument("--rdzv-conf", default=RDZV_CONF, help="torchrun's --rdzv-conf")
    p.add_argument("--keep", type=Path, default=None, help="keep logs and stamps in this directory")
    args = p.parse_args()
    conf = args.rdzv_conf
    base = Path(tempfile.mkdtemp(prefix="tidal-rescale-")) if args.keep is None else args.keep
    load = [load_average()]
    try:
        tidal = run_tidal(base / "tidal", args.repeats)
        load.append(load_average())
        if args.tidal_only:
            peer = {"scale_out": [], "scale_in": [], "kill": []}
        else:
            peer = run_torchrun_scale(base / "torchrun-scale", args.repeats, conf)
            peer.update(run_torchrun_kill(base / "torchrun-kill", args.repeats, conf))
        load.append(load_average())
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    report(tidal, peer, load, args.json)


if __name__ == "__main__":
    main()
