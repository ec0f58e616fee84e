"""How long new workers take to train: workers forked from the fork server vs started with exec.

    .venv/bin/python bench/launch.py [--repeats 3] [--json] [--keep DIR]

A scale-out or a replacement costs training nothing with tidal's seamless re-form (bench/rescale.py:
a 0.05 s pause), but the job trains at the old size until the new workers are there, and a
stream job's lag grows meanwhile (bench/online_live.py). This measures that delay: from the
request (``POST /v1/scale``, or the SIGKILL of a worker) to the first step the job applies at the
new size (bench/common.py ``StampWriter`` stamps, any worker), for

* ``+1``: 1 -> 2 workers; ``+3``: 1 -> 4 workers (each scaled back to 1 before the next event);
* ``kill``: the SIGKILL of one of 2 workers, until the replacement trains beside the survivor.

Sides, in alternation (``--repeats`` events of each kind per side, the median reported): one
``tidal run --workers 1:4 --initial 1`` job with the local backend forking new workers from its
fork server (``fork``, the default; tidal.backends.forkserver), and the same job with
``TIDAL_FORKSERVER=0`` (``exec``: each worker a new interpreter that imports torch, as before,
and as torchrun and every launcher that execs starts a worker). The example (DLRM, batch 512,
Adam, gloo) is paced with ``--step-sleep 0.02``: EMULATED accelerator time, so the 2 cores are not
saturated by training. On this 2-core VM a starting process competes with the training ones for
the cores; the 1-minute load average is printed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    MACHINE,
    bench_env,
    kill_pids,
    load_average,
    load_stamps,
    median,
    runs,
    start,
    stop,
    table,
    tidal_argv,
    wait_for_steps,
)

TRAIN_ARGS = ["--samples", "1000000", "--epochs", "1000", "--batch-size", "512", "--step-sleep", "0.02",
              "--log-every", "0"]
SETTLE_STEPS = 10  # steps at a size that end an event
TIMEOUT_S = 120.0
SIDES = ("fork", "exec")
EVENTS = ("+1", "+3", "kill")


class Failed(RuntimeError):
    pass


class Job:
    def __init__(self, work: Path, fork: bool) -> None:
        self.stamps = work / "stamps"
        job_dir = work / "job"
        env = bench_env(TIDAL_FORKSERVER="1" if fork else "0")
        self.proc = start(tidal_argv("1:4", job_dir, self.stamps, TRAIN_ARGS, run_opts=["--initial", "1"]),
                          work / "tidal.log", env)
        deadline = time.time() + 60
        while not (job_dir / "job.json").is_file():
            if time.time() > deadline or self.proc.poll() is not None:
                raise Failed(f"tidal run did not start; see {work / 'tidal.log'}")
            time.sleep(0.1)
        info = json.loads((job_dir / "job.json").read_text())
        self.http = httpx.Client(base_url=info["url"], headers={"Authorization": f"Bearer {info['token']}"},
                                 timeout=10)

    def scale(self, n: int) -> None:
        self.http.post("/v1/scale", json={"workers": n}).raise_for_status()

    def settle(self, world: int, after: float) -> None:
        if not wait_for_steps(self.stamps, world, SETTLE_STEPS, TIMEOUT_S, after=after):
            raise Failed(f"no {SETTLE_STEPS} steps at {world} workers within {TIMEOUT_S:.0f} s")

    def first_step_at(self, world: int, after: float) -> float:
        """Seconds from ``after`` to the first step stamped at ``world`` workers."""
        self.settle(world, after)
        return min(s.t for s in load_stamps(self.stamps) if s.t > after and s.world == world) - after

    def top_rank_pid(self) -> int:
        active = [w for w in self.http.get("/v1/status").json()["workers"] if w["state"] == "active"]
        return int(max(active, key=lambda w: w["rank"])["pid"])

    def close(self) -> None:
        self.http.close()
        stop(self.proc, signal.SIGINT)  # the master fails the job and SIGKILLs its workers


def run_side(work: Path, fork: bool, repeats: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {e: [] for e in EVENTS}
    job = Job(work, fork)
    try:
        job.settle(1, 0.0)
        for _ in range(repeats):
            for event, size in (("+1", 2), ("+3", 4)):
                t = time.time()
                job.scale(size)
                out[event].append(job.first_step_at(size, t))
                t = time.time()
                job.scale(1)
                job.settle(1, t)
        job.scale(2)
        job.settle(2, time.time())
        for _ in range(repeats):
            pid = job.top_rank_pid()
            t = time.time()
            kill_pids([pid])
            job.settle(1, t)  # the survivor goes on alone (MIN is 1) ...
            out["kill"].append(job.first_step_at(2, t))  # ... until the replacement trains beside it
    finally:
        job.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="events of each kind per side (median reported)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--keep", type=Path, default=None, help="keep the jobs' logs and stamps in this directory")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    base = Path(tempfile.mkdtemp(prefix="tidal-launch-")) if args.keep is None else args.keep
    results: dict[str, dict[str, list[float]]] = {}
    load = []
    for side in SIDES:
        print(f"{side}: one job, {args.repeats} x ({', '.join(EVENTS)}) ...", file=sys.stderr, flush=True)
        results[side] = run_side(base / side, side == "fork", args.repeats)
        load.append(load_average())
    med = {side: {e: median(v) for e, v in r.items()} for side, r in results.items()}
    if args.json:
        print(json.dumps({"seconds_to_first_step": med, "runs": results, "load_1min": load}, indent=1))
        return 0
    rows = [["event", "fork (s)", "exec (s)", "fork / exec", "fork runs", "exec runs"]]
    for e in EVENTS:
        rows.append([e, f"{med['fork'][e]:.2f}", f"{med['exec'][e]:.2f}", f"{med['fork'][e] / med['exec'][e]:.2f}x",
                     runs(results["fork"][e], "{:.2f}"), runs(results["exec"][e], "{:.2f}")])
    print(f"{MACHINE}; EMULATED device time (--step-sleep 0.02); load (1 min) {', '.join(f'{x:.1f}' for x in load)}")
    print("seconds from the request (scale, or SIGKILL of a worker) to the first step at the new size, median")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
