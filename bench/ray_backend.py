"""tidal on Ray (tidal.backends.ray): the pause when a machine is lost, against Ray Train; steady
samples/s and the time to the first step, against tidal's local backend.

    .venv/bin/python bench/ray_backend.py [--runs 3] [--only pause,steady,start] [--json PATH]   # about 10 minutes

Needs Ray Train for the peer (``pip install 'ray[train]'``; ``make test`` installs Ray's core only).

The cluster: a real multi-node Ray cluster on 127.0.0.1 (tests/ray_cluster.py): a head with no
CPU (it runs no worker, like a login machine) and 3 machines with 1 CPU each, so Ray puts each
worker on a machine of its own and the third is a spare. Every machine is a raylet of this 2-core
computer: "machines" share the cores, and only the control path (placement, failure detection,
re-forming) differs from real ones.

Pause (``--only pause``): 2 workers, one of them on a machine that is removed (its raylet and
every process of it SIGKILLed, ``Cluster.remove_node``) after ``--kill-after`` seconds of steps.

* tidal: ``tidal run --backend ray --workers 1:2`` of bench/common.py (the example, a stamp per
  step); the survivor re-forms alone at once and the replacement, placed by Ray on the spare
  machine, joins without restarting it.
* Ray Train: bench/ray_train_peer.py, ``TorchTrainer`` on the same cluster with the same model,
  data, optimizer and batch, in its elastic configuration (``num_workers=(1, 2)``,
  ``FailureConfig(max_failures=3)``), checkpointing every ``--checkpoint-every`` steps (its way of
  surviving a failure: the worker group restarts from the last checkpoint).

The pause is the largest gap between two consecutive steps (any worker) from the removal until
``--window`` seconds after it; the table also gives the steps trained again after the restart
(Ray Train redoes those since its last checkpoint; tidal none) and the median step before the
removal. Emulated device time: ``--step-sleep`` seconds per step (default 0.05), so that steps are
paced as on an accelerator; both sides sleep the same.

Steady (``--only steady``): samples/s of 2 workers over one epoch, no emulated device time: tidal
on Ray (the cluster up, 2 machines of 1 CPU) against tidal on the local backend (no cluster
running), from 3 s after the first step to the end (bench/common.py ``steady_rate``); the runs
of the two sides alternate.

Start (``--only start``): from ``tidal run`` to the first step stamped, 2 workers, local backend
against Ray (the cluster already running: connecting, placing 2 actors and starting their
processes is what is measured).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

from bench.common import (
    PYTHON,
    ROOT,
    bench_env,
    largest_gap,
    load_stamps,
    median,
    one_epoch_args,
    runs,
    start,
    steady_rate,
    stop,
    table,
    tidal_argv,
)
from tests.ray_cluster import RayCluster

PEER = str(ROOT / "bench" / "ray_train_peer.py")


def new_cluster(machines: int) -> RayCluster:
    return RayCluster(head_cpus=0, nodes=[1] * machines)


def ray_node_of_actor(address: str, namespace: str, node_id: str) -> str:
    """The Ray machine of one of a tidal job's nodes (asked of its actor)."""
    import ray

    from tidal.backends.ray import connect

    connect(address)
    actor = ray.get_actor(node_id, namespace=namespace)
    return str(ray.get(actor.describe.remote(), timeout=10)["ray_node"])


def wait_stamps(stamp_dir: Path, count: int, timeout: float, workers: int = 1) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        stamps = load_stamps(stamp_dir)
        if len(stamps) >= count and len({s.pid for s in stamps}) >= workers:
            return
        time.sleep(0.1)
    raise RuntimeError(f"fewer than {count} steps in {stamp_dir} after {timeout:.0f} s")


def gap_stats(stamp_dir: Path, removed_at: float, window: float) -> dict[str, float]:
    stamps = load_stamps(stamp_dir)
    before = [s.t for s in stamps if s.t <= removed_at]
    steps = [b - a for a, b in itertools.pairwise(before)][-40:]
    last_before = max((s.step for s in stamps if s.t <= removed_at), default=-1)
    redone = len({s.step for s in stamps if s.t > removed_at and s.step <= last_before})
    return {"pause_s": largest_gap(stamps, removed_at, removed_at + window),
            "step_s": statistics.median(steps) if steps else float("nan"), "redone_steps": float(redone)}


def lose_a_machine(proc: subprocess.Popen[bytes], cluster: RayCluster, stamps: Path, victim: Callable[[], str],
                   kill_after: float, window: float, start_timeout: float) -> dict[str, float]:
    """Once 2 workers train, ``kill_after`` s of steps, then the machine ``victim()`` names is
    removed; the gaps from there to ``window`` s later. Stops ``proc`` whatever happens."""
    try:
        wait_stamps(stamps, 20, start_timeout, workers=2)
        time.sleep(kill_after)
        machine = cluster.node_of(victim())
        removed_at = time.time()
        cluster.remove(machine)
        time.sleep(window)
        return gap_stats(stamps, removed_at, window)
    finally:
        stop(proc)


def tidal_pause(work: Path, cluster: RayCluster, train: list[str], kill_after: float, window: float) -> dict[str, float]:
    job_dir, stamps = work / "job", work / "stamps"
    argv = tidal_argv("1:2", job_dir, stamps, train, ["--backend", "ray", "--ray-address", cluster.address])

    def worker_0() -> str:
        job_id = json.loads((job_dir / "job.json").read_text())["job_id"]
        return ray_node_of_actor(cluster.address, f"tidal-{job_id}", "worker-0")

    return lose_a_machine(start(argv, work / "tidal.log", bench_env()), cluster, stamps, worker_0, kill_after,
                          window, 120)


def ray_train_pause(work: Path, cluster: RayCluster, train: list[str], kill_after: float, window: float,
                    checkpoint_every: int) -> dict[str, float]:
    stamps = work / "stamps"
    stamps.mkdir(parents=True)
    argv = [PYTHON, PEER, "--address", cluster.address, "--stamp-dir", str(stamps), "--storage", str(work / "storage"),
            "--workers", "2", "--min-workers", "1", "--checkpoint-every", str(checkpoint_every), "--", *train]

    def first_worker() -> str:  # each Ray Train worker writes its machine's id to <pid>.node
        return sorted(stamps.glob("*.node"))[0].read_text().strip()

    proc = start(argv, work / "ray_train.log", bench_env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"))
    return lose_a_machine(proc, cluster, stamps, first_worker, kill_after, window, 180)


def pause(tmp: Path, n: int, samples: int, step_sleep: float, kill_after: float, window: float,
          checkpoint_every: int) -> dict[str, Any]:
    train = [*one_epoch_args(samples), "--step-sleep", str(step_sleep)]
    out: dict[str, list[dict[str, float]]] = {"tidal": [], "ray_train": []}
    for i in range(n):
        for side in ("tidal", "ray_train"):
            cluster = new_cluster(3)
            try:
                work = tmp / f"pause-{side}-{i}"
                if side == "tidal":
                    r = tidal_pause(work, cluster, train, kill_after, window)
                else:
                    r = ray_train_pause(work, cluster, train, kill_after, window, checkpoint_every)
            finally:
                cluster.shutdown()
            print(f"  pause {side} run {i}: {r}", flush=True)
            out[side].append(r)
    return out


def tidal_steady_and_start(work: Path, train: list[str], run_opts: list[str]) -> tuple[float, float]:
    job_dir, stamps = work / "job", work / "stamps"
    t0 = time.time()
    subprocess.run(tidal_argv("2:2", job_dir, stamps, train, run_opts), env=bench_env(), cwd=ROOT, timeout=600,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    first = load_stamps(stamps)[0].t
    rate, procs = steady_rate(stamps, 3.0)
    if procs != 2:
        raise RuntimeError(f"expected 2 workers in {stamps}, saw {procs}")
    return rate, first - t0


def steady(tmp: Path, n: int, samples: int) -> dict[str, Any]:
    train = one_epoch_args(samples)
    local, on_ray = [], []
    for i in range(n):  # alternated, so that a noisy minute of the machine hits both sides
        local.append(tidal_steady_and_start(tmp / f"local-{i}", train, []))
        cluster = new_cluster(2)
        try:
            on_ray.append(tidal_steady_and_start(tmp / f"ray-{i}", train,
                                                 ["--backend", "ray", "--ray-address", cluster.address]))
        finally:
            cluster.shutdown()
    return {"local_rate": [r for r, _ in local], "ray_rate": [r for r, _ in on_ray],
            "local_start_s": [s for _, s in local], "ray_start_s": [s for _, s in on_ray]}


def report(r: dict[str, Any]) -> None:
    if "pause" in r:
        p = r["pause"]
        t_pause = [x["pause_s"] for x in p["tidal"]]
        r_pause = [x["pause_s"] for x in p["ray_train"]]
        rows = [["", "tidal on Ray", "Ray Train (elastic 1:2)", "ratio"],
                ["pause on a lost machine, s (median)", f"{median(t_pause):.2f}", f"{median(r_pause):.2f}",
                 f"{median(t_pause) / median(r_pause):.3f}x"],
                ["  runs", runs(t_pause, "{:.2f}"), runs(r_pause, "{:.2f}"), ""],
                ["steps trained again", runs([x["redone_steps"] for x in p["tidal"]], "{:.0f}"),
                 runs([x["redone_steps"] for x in p["ray_train"]], "{:.0f}"), ""],
                ["median step before, s", f"{median([x['step_s'] for x in p['tidal']]):.3f}",
                 f"{median([x['step_s'] for x in p['ray_train']]):.3f}", ""]]
        print(table(rows))
    if "steady" in r:
        s = r["steady"]
        rows = [["", "tidal on Ray", "tidal local", "ratio"],
                ["samples/s, 2 workers (median)", f"{median(s['ray_rate']):.0f}", f"{median(s['local_rate']):.0f}",
                 f"{median(s['ray_rate']) / median(s['local_rate']):.3f}x"],
                ["  runs", runs(s["ray_rate"], "{:.0f}"), runs(s["local_rate"], "{:.0f}"), ""],
                ["tidal run -> first step, s (median)", f"{median(s['ray_start_s']):.2f}",
                 f"{median(s['local_start_s']):.2f}", f"{median(s['ray_start_s']) / median(s['local_start_s']):.2f}x"],
                ["  runs", runs(s["ray_start_s"], "{:.2f}"), runs(s["local_start_s"], "{:.2f}"), ""]]
        print(table(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--only", default="pause,steady", help="pause, steady (which also times the start), or both")
    p.add_argument("--samples", type=int, default=2_000_000, help="samples of the steady runs' epoch")
    p.add_argument("--pause-samples", type=int, default=400_000, help="samples of the pause runs' epoch (not run to the end)")
    p.add_argument("--step-sleep", type=float, default=0.05, help="emulated device time per step in the pause runs")
    p.add_argument("--kill-after", type=float, default=5.0, help="seconds of 2-worker steps before the machine is removed")
    p.add_argument("--window", type=float, default=30.0, help="seconds after the removal in which the pause is sought")
    p.add_argument("--checkpoint-every", type=int, default=20, help="Ray Train's checkpoint interval, steps")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    only = set(a.only.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="tidal-ray-bench-"))
    result: dict[str, Any] = {"runs": a.runs, "step_sleep": a.step_sleep, "emulated_device_time": True}
    try:
        if "steady" in only:
            result["steady"] = steady(tmp, a.runs, a.samples)
        if "pause" in only:
            result["pause"] = pause(tmp, a.runs, a.pause_samples, a.step_sleep, a.kill_after, a.window,
                                    a.checkpoint_every)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(result)
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
