"""Planners on a live job: the true worker-count curve of the CTR example (issue "The brain drives real jobs").

    .venv/bin/python bench/planner_live.py [--max-workers 6] [--json] [--keep DIR]

EMULATED ACCELERATOR TIME. On this 2-core VM extra worker processes add no compute, so a planner
would have nothing real to discover. Every run here trains examples/ctr/train.py with
``--device-ms-per-step`` and ``--device-us-per-sample``: after each batch's backward a worker
sleeps as if a GPU ran the step (CPU idle). Throughput then grows with the workers until their
real CPU work (forward, backward, Adam, gloo, tidal's per-step exchange) fills the two cores, and
flattens there. The defaults: batch 512 per worker, 4 ms/step + 40 us/sample = 24.5 ms of
emulated device time per step, against about 5 ms of real CPU per step at one worker (29.5 ms a
step in all); with more workers each step also waits for the slowest of them and for the
all-reduce, and the CPU fills up. Measured on this VM (load average 1.4-2.9 from other jobs,
409,600 samples): samples/s 1.00, 1.59, 2.26, 2.73, 3.06, 3.13x for 1..6 workers, job time best
at 4 workers (17.5 s, against 28.1 s at 1; start-up, 7-14 s and growing with the workers, is
part of it), oracle 3 workers. Every figure this bench prints is of that emulation, not of real
accelerators; say so wherever you quote one.

The oracle sweep: for N = 1 .. ``--max-workers``, one ``tidal run --workers N:N`` job (the
example's own ``main`` run by bench/common.py, which adds a stamp per applied step) over the same
dataset (``--samples``, one epoch), run to its end. Per run:

* job s: wall time of ``tidal run``, from its start to its exit (start-up, rendezvous, training,
  final evaluation, shutdown: what a user waits for);
* worker-s: the sum over the job's worker processes of their lifetimes (creation time to the
  first poll, every 0.2 s, that finds them gone; a midpoint, so within 0.1 s each), watched as
  the children of ``tidal run`` that carry the job's ``TIDAL_JOB_ID``;
* samples/s: steady throughput from the step stamps, ``--warmup`` s after the first step to 0.5 s
  before the last (bench/common.py ``steady_rate``); speedup is that rate over N = 1's.

The oracle is the N with the fewest worker-seconds among the runs whose job time is within 10%
of the best job time (``ORACLE_SLACK``): as fast as the fastest, give or take noise, at the
least cost.

Once ``tidal run`` takes a planner (a later piece of the issue), the same invocation will also
run the job elastically (``--workers 1:MAX``) under each per-job planner registered in
``tidal.brain.planners`` and report, per planner, its job time, worker-seconds, the worker count
it settled on and when; until then ``planners`` is empty and no planner figure is printed.

Progress goes to stderr, one line per run, with the 1-minute load average before it (other jobs
may share the cores; a busy machine moves the knee to fewer workers). Every process a run starts
ends with it: ``tidal run`` is started in a session of its own and stopped by process group, and
its workers, which run in sessions of their own, are found by their ``TIDAL_JOB_ID`` and killed
if any is left.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    bench_env,
    load_average,
    one_epoch_args,
    start,
    steady_rate,
    stop,
    table,
    tidal_argv,
)

BATCH = 512
DEVICE_MS_PER_STEP = 4.0
DEVICE_US_PER_SAMPLE = 40.0
SAMPLES = 409_600  # 800 steps at one worker
ORACLE_SLACK = 0.10  # job times within 10% of the best count as "as fast"
POLL_S = 0.2
RUN_TIMEOUT_S = 300.0


class Failed(RuntimeError):
    pass


@dataclass(frozen=True)
class FixedRun:
    workers: int
    job_s: float
    worker_s: float
    samples_per_s: float
    load_average: float


class WorkerMeter:
    """Lifetimes of a job's worker processes, polled as children of its ``tidal run``.

    A child counts as a worker when its environment carries the job's ``TIDAL_JOB_ID``
    (checked once per process). A worker ends at the midpoint between the last poll that saw it
    running and the first that did not (or saw a zombie)."""

    def __init__(self, master_pid: int) -> None:
        self._master = psutil.Process(master_pid)
        self._procs: dict[int, psutil.Process] = {}
        self._not_workers: set[int] = set()
        self._started: dict[int, float] = {}
        self._ended: dict[int, float] = {}
        self._last_poll = time.time()

    def poll(self) -> None:
        now = time.time()
        with contextlib.suppress(psutil.Error):
            for child in self._master.children(recursive=True):
                if child.pid in self._procs or child.pid in self._not_workers:
                    continue
                try:
                    is_worker = "TIDAL_JOB_ID" in child.environ()
                    created = child.create_time()
                except psutil.Error:
                    continue
                if is_worker:
                    self._procs[child.pid] = child
                    self._started[child.pid] = created
                else:
                    self._not_workers.add(child.pid)
        for pid, proc in self._procs.items():
            if pid in self._ended:
                continue
            try:
                gone = not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
            except psutil.Error:
                gone = True
            if gone:
                self._ended[pid] = (self._last_poll + now) / 2
        self._last_poll = now

    def worker_seconds(self) -> float:
        """Sum of the lifetimes (a worker still running counts up to the last poll)."""
        return sum(self._ended.get(pid, self._last_poll) - t for pid, t in self._started.items())

    def count(self) -> int:
        return len(self._procs)

    def kill_survivors(self) -> None:
        for proc in self._procs.values():
            with contextlib.suppress(psutil.Error):
                if proc.is_running():  # also checks the pid was not reused
                    proc.kill()


def kill_job_workers(job_dir: Path) -> None:
    """SIGKILL every process whose environment names this job (workers the meter never saw)."""
    try:
        job_id = json.loads((job_dir / "job.json").read_text())["job_id"]
    except (OSError, ValueError, KeyError):
        return
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get("TIDAL_JOB_ID") == job_id:
                p.kill()


def train_args(samples: int, batch: int, ms_per_step: float, us_per_sample: float) -> list[str]:
    return [*one_epoch_args(samples, batch), "--device-ms-per-step", f"{ms_per_step:g}",
            "--device-us-per-sample", f"{us_per_sample:g}"]


def run_fixed(work: Path, workers: int, args: list[str], warmup: float, timeout: float = RUN_TIMEOUT_S) -> FixedRun:
    """One ``tidal run --workers N:N`` job to its end: job time, worker-seconds, samples/s."""
    job_dir, stamps = work / "job", work / "stamps"
    load = load_average()
    t0 = time.monotonic()
    proc = start(tidal_argv(f"{workers}:{workers}", job_dir, stamps, args), work / "tidal.log", bench_env())
    meter = WorkerMeter(proc.pid)
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout:
                raise Failed(f"{workers} workers: tidal run still running after {timeout:.0f}s")
            meter.poll()
            time.sleep(POLL_S)
        job_s = time.monotonic() - t0
        meter.poll()
    finally:
        stop(proc)
        meter.kill_survivors()
        kill_job_workers(job_dir)
    if proc.returncode != 0:
        tail = (work / "tidal.log").read_text(errors="replace")[-2000:]
        raise Failed(f"{workers} workers: tidal run exited with {proc.returncode}\n{tail}")
    if meter.count() != workers:
        raise Failed(f"{workers} workers: saw {meter.count()} worker processes")
    rate, seen = steady_rate(stamps, warmup)
    if seen != workers:
        raise Failed(f"{workers} workers: {seen} processes stamped steps")
    return FixedRun(workers, job_s, meter.worker_seconds(), rate, load)


def pick_oracle(sweep: list[FixedRun]) -> FixedRun:
    """The fewest worker-seconds among the runs within ``ORACLE_SLACK`` of the best job time."""
    best = min(r.job_s for r in sweep)
    return min((r for r in sweep if r.job_s <= best * (1 + ORACLE_SLACK)), key=lambda r: r.worker_s)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-workers", type=int, default=6, help="sweep N = 1 .. this")
    p.add_argument("--samples", type=int, default=SAMPLES, help="samples of the one epoch (the same for every run)")
    p.add_argument("--batch-size", type=int, default=BATCH, help="samples per worker per step")
    p.add_argument("--device-ms-per-step", type=float, default=DEVICE_MS_PER_STEP, help="emulated device ms per step")
    p.add_argument("--device-us-per-sample", type=float, default=DEVICE_US_PER_SAMPLE,
                   help="emulated device us per sample")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds after the first step left out of samples/s")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--keep", type=Path, default=None, help="keep logs, stamps and job dirs here")
    args = p.parse_args(argv)
    if args.max_workers < 1:
        p.error("--max-workers must be >= 1")
    example = train_args(args.samples, args.batch_size, args.device_ms_per_step, args.device_us_per_sample)
    emulation = {"batch_size": args.batch_size, "device_ms_per_step": args.device_ms_per_step,
                 "device_us_per_sample": args.device_us_per_sample, "samples": args.samples}
    print(f"EMULATED accelerator time: {args.device_ms_per_step:g} ms/step + {args.device_us_per_sample:g} us/sample, "
          f"batch {args.batch_size}/worker, {args.samples} samples", file=sys.stderr, flush=True)
    base = Path(tempfile.mkdtemp(prefix="tidal-planner-live-")) if args.keep is None else args.keep
    sweep: list[FixedRun] = []
    try:
        for n in range(1, args.max_workers + 1):
            r = run_fixed(base / f"fixed-{n}", n, example, args.warmup)
            sweep.append(r)
            print(f"fixed {n}:{n}: job {r.job_s:.1f} s, {r.worker_s:.1f} worker-s, {r.samples_per_s:,.0f} samples/s "
                  f"(load {r.load_average:.2f})", file=sys.stderr, flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    oracle = pick_oracle(sweep)
    result: dict[str, Any] = {
        "oracle": {"workers": oracle.workers, "job_s": oracle.job_s, "worker_s": oracle.worker_s},
        "planners": {},
        "sweep": [asdict(r) for r in sweep],
        "emulation": emulation,
    }
    if args.json:
        print(json.dumps(result))
        return
    one = sweep[0]
    rows = [["workers", "job s", "worker-s", "samples/s", "speedup", "job speedup", "load (1 min)"]]
    for r in sweep:
        rows.append([f"{r.workers}{' (oracle)' if r is oracle else ''}", f"{r.job_s:.1f}", f"{r.worker_s:.1f}",
                     f"{r.samples_per_s:,.0f}", f"{r.samples_per_s / one.samples_per_s:.2f}x",
                     f"{one.job_s / r.job_s:.2f}x", f"{r.load_average:.2f}"])
    print(table(rows))
    print(f"EMULATED accelerator time ({args.device_ms_per_step:g} ms/step + {args.device_us_per_sample:g} us/sample, "
          f"batch {args.batch_size}/worker), {args.samples} samples, one epoch; oracle: {oracle.workers} workers "
          f"(fewest worker-s within {ORACLE_SLACK:.0%} of the best job time)")


if __name__ == "__main__":
    main()
