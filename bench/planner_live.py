"""Planners on a live job: the true worker-count curve of the CTR example, and what each planner
makes of it (issue "The brain drives real jobs").

    .venv/bin/python bench/planner_live.py [--max-workers 6] [--samples N] [--json] [--keep DIR]
        [--planners max,es,dlrover,dlrover-rm-cold,dlrover-rm-warm] [--no-sweep [--oracle-json FILE]]

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

The default dataset is 1,638,400 samples (one epoch; 3,200 steps at one worker), four times the
one above, so that the oracle's job takes roughly 60-90 s: a planner measures each count it
tries for about 3 s (``tidal.brain.dataparallel.SETTLE_S``) and a new worker takes several
seconds to start here, so a shorter job would end before any planner has explored.

The oracle sweep: for N = 1 .. ``--max-workers``, one ``tidal run --workers N:N --planner fixed
--history none`` job (the example's own ``main`` run by bench/common.py, which adds a stamp per
applied step) over the same dataset (``--samples``, one epoch), run to its end. Per run:

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

The planner runs, after the sweep, in this order (``--planners`` picks a subset, run in the same
order): one ``tidal run --workers 1:MAX --planner NAME`` job each, same dataset and example
arguments as the sweep, the planner deciding the count live (every ``--planner-interval`` s,
tidal's default unless given):

* ``max``, ``es``, ``dlrover``: with ``--history none``;
* ``dlrover-rm-cold``: ``--planner dlrover-rm`` with ``--history`` a fresh file in the bench's
  directory (emptied first), which this job fills when it succeeds;
* ``dlrover-rm-warm``: ``--planner dlrover-rm`` again, same ``--history`` file: it warm-starts
  from the cold run (it needs ``dlrover-rm-cold`` in the same invocation). Both dlrover-rm runs
  use the same ``--stamp-dir`` path (moved into the run's directory afterwards), so that the
  warm job's signature (script and arguments) is the cold one's exactly.

Per planner run: job s and worker-s (the same meters as the sweep); the planner's decisions, read
live from the ``tidal {HH:MM:SS} planner NAME: A -> B workers (reason)`` lines ``tidal run``
prints on stdout (``-q`` keeps them), each timed by its arrival (``time.monotonic()``, in a
reader thread) from the start of ``tidal run``; settled workers, the count of the last decision
(MAX, tidal's initial count of MIN:MAX, when there is none); settle s, the time of the last
decision (0 when there is none). The targets, checked in words and marked PASS or MISS (a bench
reports, it does not assert): dlrover-rm warm within 10% of the oracle's job time and 15% of its
worker-seconds, cold within 25% of both, and max using more worker-seconds than every other
planner run.

``--no-sweep`` skips the sweep (to rerun only the planners); the oracle then comes from
``--oracle-json FILE`` (this bench's ``--json`` output, or its ``oracle`` object alone), else
there is none (``"oracle": null``, no ratios, targets against it n/a).

``--json`` prints one object::

    {"oracle": {"workers", "job_s", "worker_s"} | null,
     "planners": {NAME: {"job_s", "worker_s", "settled_workers", "settle_s", "decisions": [{"at_s",
                  "from_workers", "to_workers", "reason"}], "workers_started", "load_average",
                  "planner_errors", "error"}},
     "targets": {NAME: {"target", "result"}}, "sweep": [...], "emulation": {...}}

for the planners run (names above). A planner run that fails (tidal run exits non-zero, or runs
past ``--timeout``) is reported with null figures and its ``error``; the others still run, and
the bench exits 1 at the end.

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
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    ROOT,
    bench_env,
    load_average,
    one_epoch_args,
    steady_rate,
    stop,
    table,
    tidal_argv,
)
from tidal.brain.dataparallel import DLRoverRMWorkers
from tidal.brain.history import InMemoryHistory, JobRecord
from tidal.history import SQLiteHistory
from tidal.sim.job import simulate_job

BATCH = 512
DEVICE_MS_PER_STEP = 4.0
DEVICE_US_PER_SAMPLE = 40.0
SAMPLES = 1_638_400  # 3,200 steps at one worker: the oracle's job takes roughly 60-90 s
ORACLE_SLACK = 0.10  # job times within 10% of the best count as "as fast"
POLL_S = 0.2
RUN_TIMEOUT_S = 600.0

#: bench name -> (tidal's --planner, whether it uses the bench's --history file)
PLANNERS: dict[str, tuple[str, bool]] = {
    "max": ("max", False),
    "es": ("es", False),
    "dlrover": ("dlrover", False),
    "dlrover-rm-cold": ("dlrover-rm", True),
    "dlrover-rm-warm": ("dlrover-rm", True),
}
#: (job time, worker-seconds) allowed over the oracle's
WARM_TARGET = (0.10, 0.15)
COLD_TARGET = (0.25, 0.25)

# "tidal 01:21:07 planner dlrover-rm: 2 -> 5 workers (reason...)", as tidal.master.server prints it
DECISION = re.compile(r"^tidal (\d\d:\d\d:\d\d) planner (\S+): (\d+) -> (\d+) workers \((.*)\)$")
PLANNER_ERROR = re.compile(r"^tidal \d\d:\d\d:\d\d planner \S+ failed: ")


class Failed(RuntimeError):
    pass


@dataclass(frozen=True)
class FixedRun:
    workers: int
    job_s: float
    worker_s: float
    samples_per_s: float
    load_average: float


@dataclass(frozen=True)
class Decision:
    at_s: float  # arrival of the line, seconds after the start of tidal run
    from_workers: int
    to_workers: int
    reason: str


@dataclass
class PlannerRun:
    job_s: float | None
    worker_s: float | None
    settled_workers: int | None
    settle_s: float | None
    decisions: list[Decision] = field(default_factory=list)
    workers_started: int = 0
    load_average: float = 0.0
    planner_errors: list[str] = field(default_factory=list)
    error: str | None = None


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


class LineReader:
    """Reads a process's output in a thread: every line copied to ``log`` and kept with its
    arrival time (``time.monotonic()``)."""

    def __init__(self, stream: IO[bytes], log: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self._stream, self._log = stream, log
        self._thread = threading.Thread(target=self._read, name="tidal-run-stdout", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with open(self._log, "ab") as out:
            for raw in iter(self._stream.readline, b""):
                self.lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\r\n")))
                out.write(raw)
                out.flush()

    def join(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)


@dataclass
class JobResult:
    job_s: float
    returncode: int
    meter: WorkerMeter
    lines: list[tuple[float, str]]  # (seconds after the start, line)


def run_job(work: Path, workers: str, args: list[str], timeout: float, run_opts: list[str] | None = None,
            stamps: Path | None = None) -> JobResult:
    """One ``tidal run --workers W`` job to its end (or ``Failed`` past ``timeout``), its output
    read live; every process it started is gone when this returns."""
    job_dir = work / "job"
    work.mkdir(parents=True, exist_ok=True)
    argv = tidal_argv(workers, job_dir, stamps or work / "stamps", args, run_opts or [])
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=ROOT, env=bench_env(), start_new_session=True)
    assert proc.stdout is not None
    reader = LineReader(proc.stdout, work / "tidal.log")
    meter = WorkerMeter(proc.pid)
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout:
                raise Failed(f"tidal run still running after {timeout:.0f}s")
            meter.poll()
            time.sleep(POLL_S)
        job_s = time.monotonic() - t0
        meter.poll()
    finally:
        stop(proc)
        meter.kill_survivors()
        kill_job_workers(job_dir)
        reader.join()
        proc.stdout.close()
    return JobResult(job_s, proc.returncode, meter, [(t - t0, line) for t, line in reader.lines])


def log_tail(work: Path) -> str:
    return (work / "tidal.log").read_text(errors="replace")[-2000:]


def train_args(samples: int, batch: int, ms_per_step: float, us_per_sample: float) -> list[str]:
    return [*one_epoch_args(samples, batch), "--device-ms-per-step", f"{ms_per_step:g}",
            "--device-us-per-sample", f"{us_per_sample:g}"]


def run_fixed(work: Path, workers: int, args: list[str], warmup: float, timeout: float = RUN_TIMEOUT_S) -> FixedRun:
    """One ``tidal run --workers N:N`` job to its end: job time, worker-seconds, samples/s."""
    load = load_average()
    try:
        job = run_job(work, f"{workers}:{workers}", args, timeout, ["--planner", "fixed", "--history", "none"])
    except Failed as exc:
        raise Failed(f"{workers} workers: {exc}") from None
    if job.returncode != 0:
        raise Failed(f"{workers} workers: tidal run exited with {job.returncode}\n{log_tail(work)}")
    if job.meter.count() != workers:
        raise Failed(f"{workers} workers: saw {job.meter.count()} worker processes")
    rate, seen = steady_rate(work / "stamps", warmup)
    if seen != workers:
        raise Failed(f"{workers} workers: {seen} processes stamped steps")
    return FixedRun(workers, job.job_s, job.meter.worker_seconds(), rate, load)


def parse_decisions(lines: list[tuple[float, str]]) -> tuple[list[Decision], list[str]]:
    """The planner's decisions (timed by arrival) and its failures, from ``tidal run``'s output."""
    decisions, errors = [], []
    for t, line in lines:
        m = DECISION.match(line)
        if m:
            decisions.append(Decision(round(t, 2), int(m.group(3)), int(m.group(4)), m.group(5)))
        elif PLANNER_ERROR.match(line):
            errors.append(line)
    return decisions, errors


def history_rows(path: Path) -> int:
    """Jobs in a --history file (0 when it is missing or unreadable)."""
    if not path.exists():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(path)) as db:
            return int(db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])
    except sqlite3.Error:
        return 0


def run_planner(work: Path, name: str, max_workers: int, args: list[str], history: Path, stamps: Path,
                interval: float | None, timeout: float = RUN_TIMEOUT_S) -> PlannerRun:
    """One ``tidal run --workers 1:MAX --planner P`` job to its end. A failure is reported in the
    result (``error``), not raised."""
    planner, uses_history = PLANNERS[name]
    opts = ["--planner", planner, "--history", str(history) if uses_history else "none"]
    if interval is not None:
        opts += ["--planner-interval", f"{interval:g}"]
    load = load_average()
    shutil.rmtree(stamps, ignore_errors=True)
    try:
        job = run_job(work, f"1:{max_workers}", args, timeout, opts, stamps)
    except Failed as exc:
        return PlannerRun(None, None, None, None, load_average=load, error=str(exc))
    finally:
        if stamps.exists():  # the stamps go with the run (the path must be the same for every run)
            shutil.rmtree(work / "stamps", ignore_errors=True)
            stamps.rename(work / "stamps")
    decisions, errors = parse_decisions(job.lines)
    run = PlannerRun(
        job_s=job.job_s, worker_s=job.meter.worker_seconds(),
        settled_workers=decisions[-1].to_workers if decisions else max_workers,
        settle_s=decisions[-1].at_s if decisions else 0.0, decisions=decisions,
        workers_started=job.meter.count(), load_average=load, planner_errors=errors)
    if job.returncode != 0:
        run.error = f"tidal run exited with {job.returncode}\n{log_tail(work)}"
    return run


def pick_oracle(sweep: list[FixedRun]) -> FixedRun:
    """The fewest worker-seconds among the runs within ``ORACLE_SLACK`` of the best job time."""
    best = min(r.job_s for r in sweep)
    return min((r for r in sweep if r.job_s <= best * (1 + ORACLE_SLACK)), key=lambda r: r.worker_s)


def read_oracle(path: Path) -> dict[str, Any]:
    """The oracle of an earlier run: this bench's --json output, or its "oracle" object alone."""
    data = json.loads(path.read_text())
    if isinstance(data, dict) and isinstance(data.get("oracle"), dict):
        data = data["oracle"]
    if not isinstance(data, dict) or not {"workers", "job_s", "worker_s"} <= data.keys():
        raise ValueError(f"{path}: no oracle (an object with workers, job_s, worker_s)")
    return {"workers": int(data["workers"]), "job_s": float(data["job_s"]), "worker_s": float(data["worker_s"])}


def parse_planners(text: str) -> list[str]:
    """``--planners``: names of PLANNERS, comma-separated, returned in PLANNERS' order."""
    wanted = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in PLANNERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown planner(s) {', '.join(unknown)}; known: {', '.join(PLANNERS)}")
    if "dlrover-rm-warm" in wanted and "dlrover-rm-cold" not in wanted:
        raise argparse.ArgumentTypeError("dlrover-rm-warm needs dlrover-rm-cold (its --history) in the same run")
    return [n for n in PLANNERS if n in wanted]


def within(run: dict[str, Any], oracle: dict[str, Any] | None, slack: tuple[float, float]) -> str:
    if oracle is None or run.get("job_s") is None:
        return "n/a"
    ok = (run["job_s"] <= oracle["job_s"] * (1 + slack[0]) and run["worker_s"] <= oracle["worker_s"] * (1 + slack[1]))
    return "PASS" if ok else "MISS"


def check_targets(planners: dict[str, dict[str, Any]], oracle: dict[str, Any] | None) -> dict[str, dict[str, str]]:
    """The targets, in words, with PASS, MISS or n/a (a planner not run, or no oracle)."""
    out: dict[str, dict[str, str]] = {}
    warm, cold, mx = planners.get("dlrover-rm-warm"), planners.get("dlrover-rm-cold"), planners.get("max")
    out["dlrover-rm-warm"] = {
        "target": f"dlrover-rm warm within {WARM_TARGET[0]:.0%} of the oracle's job time and "
                  f"{WARM_TARGET[1]:.0%} of its worker-s",
        "result": "n/a" if warm is None else within(warm, oracle, WARM_TARGET)}
    out["dlrover-rm-cold"] = {
        "target": f"dlrover-rm cold within {COLD_TARGET[0]:.0%} of the oracle's job time and "
                  f"{COLD_TARGET[1]:.0%} of its worker-s",
        "result": "n/a" if cold is None else within(cold, oracle, COLD_TARGET)}
    others = [r["worker_s"] for n, r in planners.items() if n != "max" and r.get("worker_s") is not None]
    result = "n/a"
    if mx is not None and mx.get("worker_s") is not None and others:
        result = "PASS" if mx["worker_s"] > max(others) else "MISS"
    out["max"] = {"target": "max uses more worker-s than every other planner run", "result": result}
    return out


def sim_vs_live(runs: dict[str, PlannerRun], cold_records: list[JobRecord], args: argparse.Namespace,
                ) -> dict[str, dict[str, Any]]:
    """The dlrover-rm runs replayed by ``tidal.sim.job`` from the model the cold run fitted (the
    history's record): the simulator should settle on the same count and predict the job time."""
    record = cold_records[-1]
    model = {k: v for k, v in record.params.items() if k in ("theta0", "theta1", "knee")}
    if len(model) != 3:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name in ("dlrover-rm-cold", "dlrover-rm-warm"):
        live = runs.get(name)
        if live is None or live.error is not None or live.job_s is None:
            continue
        history = InMemoryHistory(cold_records) if name.endswith("warm") else None
        planner = DLRoverRMWorkers(features=record.features if history else None, history=history)
        sim = simulate_job(planner, model, samples=args.samples, batch_size=args.batch_size, min_workers=1,
                           max_workers=args.max_workers, interval_s=args.planner_interval or 1.0,
                           start_s=args.sim_start_s, tail_s=args.sim_tail_s)
        out[name] = {"params": model, "live_settled": live.settled_workers,
                     "sim_settled": sim.settled_workers, "live_job_s": live.job_s, "sim_job_s": round(sim.job_s, 2),
                     "job_ratio": round(sim.job_s / live.job_s, 3), "sim_decisions": sim.decisions}
    return out


def ratio(value: float | None, of: float | None) -> str:
    return "-" if value is None or not of else f"{value / of:.2f}x"


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-workers", type=int, default=6, help="sweep N = 1 .. this; the planners run 1:this")
    p.add_argument("--samples", type=int, default=SAMPLES, help="samples of the one epoch (the same for every run)")
    p.add_argument("--batch-size", type=int, default=BATCH, help="samples per worker per step")
    p.add_argument("--device-ms-per-step", type=float, default=DEVICE_MS_PER_STEP, help="emulated device ms per step")
    p.add_argument("--device-us-per-sample", type=float, default=DEVICE_US_PER_SAMPLE,
                   help="emulated device us per sample")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds after the first step left out of samples/s")
    p.add_argument("--planners", type=parse_planners, default=list(PLANNERS),
                   help=f"planner runs, comma-separated (default all: {','.join(PLANNERS)}); empty: none")
    p.add_argument("--planner-interval", type=float, default=None,
                   help="tidal run --planner-interval for the planner runs (default: tidal's)")
    p.add_argument("--no-sweep", action="store_true", help="skip the oracle sweep (see --oracle-json)")
    p.add_argument("--oracle-json", type=Path, default=None,
                   help="with --no-sweep: the oracle from this file (this bench's --json output)")
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S, help="seconds one tidal run may take")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--keep", type=Path, default=None, help="keep logs, stamps, job dirs and the history here")
    p.add_argument("--sim-start-s", type=float, default=4.0,
                   help="the replay's seconds from asking for a worker to its first step (tidal sim job --start-s)")
    p.add_argument("--sim-tail-s", type=float, default=2.0,
                   help="the replay's seconds after the last step (evaluation, exit: tidal sim job --tail-s)")
    args = p.parse_args(argv)
    if args.max_workers < 1:
        p.error("--max-workers must be >= 1")
    if args.oracle_json is not None and not args.no_sweep:
        p.error("--oracle-json goes with --no-sweep")
    example = train_args(args.samples, args.batch_size, args.device_ms_per_step, args.device_us_per_sample)
    emulation = {"batch_size": args.batch_size, "device_ms_per_step": args.device_ms_per_step,
                 "device_us_per_sample": args.device_us_per_sample, "samples": args.samples}
    oracle: dict[str, Any] | None = None
    if args.oracle_json is not None:
        try:
            oracle = read_oracle(args.oracle_json)
        except (OSError, ValueError) as exc:
            p.error(f"--oracle-json: {exc}")
        with contextlib.suppress(OSError, ValueError, AttributeError):
            theirs = json.loads(args.oracle_json.read_text()).get("emulation")
            if theirs is not None and theirs != emulation:
                print(f"warning: the oracle of {args.oracle_json} was measured with {theirs}, not {emulation}",
                      file=sys.stderr, flush=True)
    print(f"EMULATED accelerator time: {args.device_ms_per_step:g} ms/step + {args.device_us_per_sample:g} us/sample, "
          f"batch {args.batch_size}/worker, {args.samples} samples", file=sys.stderr, flush=True)
    base = Path(tempfile.mkdtemp(prefix="tidal-planner-live-")) if args.keep is None else args.keep
    base.mkdir(parents=True, exist_ok=True)
    sweep: list[FixedRun] = []
    runs: dict[str, PlannerRun] = {}
    cold_records: list[JobRecord] = []
    try:
        if not args.no_sweep:
            for n in range(1, args.max_workers + 1):
                fixed = run_fixed(base / f"fixed-{n}", n, example, args.warmup, args.timeout)
                sweep.append(fixed)
                print(f"fixed {n}:{n}: job {fixed.job_s:.1f} s, {fixed.worker_s:.1f} worker-s, "
                      f"{fixed.samples_per_s:,.0f} samples/s (load {fixed.load_average:.2f})",
                      file=sys.stderr, flush=True)
            best = pick_oracle(sweep)
            oracle = {"workers": best.workers, "job_s": best.job_s, "worker_s": best.worker_s}
        history, stamps = base / "history.sqlite", base / "stamps-planner"
        for name in args.planners:
            if name == "dlrover-rm-cold":
                history.unlink(missing_ok=True)  # a fresh history: the cold run starts from nothing
            elif name == "dlrover-rm-warm" and history_rows(history) == 0:
                print("warning: the history is empty (the cold run did not record itself): the warm run starts cold",
                      file=sys.stderr, flush=True)
            r = runs[name] = run_planner(base / f"planner-{name}", name, args.max_workers, example, history, stamps,
                                         args.planner_interval, args.timeout)
            if name == "dlrover-rm-cold" and history.exists():
                cold_records = SQLiteHistory(history).records()  # what the warm run starts from
            if r.error is not None:
                print(f"planner {name}: FAILED (load {r.load_average:.2f}): {r.error}", file=sys.stderr, flush=True)
                continue
            print(f"planner {name}: job {r.job_s:.1f} s, {r.worker_s:.1f} worker-s, settled on {r.settled_workers} "
                  f"at {r.settle_s:.1f} s, {len(r.decisions)} decision(s), {r.workers_started} worker(s) started "
                  f"(load {r.load_average:.2f})", file=sys.stderr, flush=True)
            for e in r.planner_errors:
                print(f"  {e}", file=sys.stderr, flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    planners = {name: asdict(r) for name, r in runs.items()}
    targets = check_targets(planners, oracle)
    replay = sim_vs_live(runs, cold_records, args) if cold_records else {}
    failed = any(r.error is not None for r in runs.values())
    result: dict[str, Any] = {"oracle": oracle, "planners": planners, "targets": targets,
                              "sweep": [asdict(f) for f in sweep], "emulation": emulation, "sim_vs_live": replay}
    if args.json:
        print(json.dumps(result))
        return 1 if failed else 0
    if sweep:
        one = sweep[0]
        rows = [["workers", "job s", "worker-s", "samples/s", "speedup", "job speedup", "load (1 min)"]]
        for f in sweep:
            rows.append([f"{f.workers}{' (oracle)' if oracle and f.workers == oracle['workers'] else ''}",
                         f"{f.job_s:.1f}", f"{f.worker_s:.1f}", f"{f.samples_per_s:,.0f}",
                         f"{f.samples_per_s / one.samples_per_s:.2f}x", f"{one.job_s / f.job_s:.2f}x",
                         f"{f.load_average:.2f}"])
        print(table(rows))
        print()
    if oracle is not None:
        source = "sweep" if sweep else str(args.oracle_json)
        print(f"oracle ({source}): {oracle['workers']} workers, job {oracle['job_s']:.1f} s, "
              f"{oracle['worker_s']:.1f} worker-s (fewest worker-s within {ORACLE_SLACK:.0%} of the best job time)")
    else:
        print("oracle: none (--no-sweep without --oracle-json)")
    if runs:
        o_job = oracle["job_s"] if oracle else None
        o_ws = oracle["worker_s"] if oracle else None
        rows = [["planner", "job s", "worker-s", "settled", "settle s", "job / oracle", "worker-s / oracle",
                 "decisions", "started", "load (1 min)"]]
        for name, r in runs.items():
            rows.append([name, fmt(r.job_s), fmt(r.worker_s), fmt(r.settled_workers, "d"), fmt(r.settle_s),
                         ratio(r.job_s, o_job), ratio(r.worker_s, o_ws), str(len(r.decisions)),
                         str(r.workers_started), f"{r.load_average:.2f}"])
        print()
        print(table(rows))
        print()
        for name, r in runs.items():
            if r.error is not None:
                print(f"{name}: FAILED: {r.error.splitlines()[0]}")
                continue
            print(f"{name}:" + ("" if r.decisions else " no decision (kept the initial MAX)"))
            for d in r.decisions:
                print(f"  {d.at_s:6.1f} s  {d.from_workers} -> {d.to_workers}  {d.reason}")
            for e in r.planner_errors:
                print(f"  {e}")
        print()
        for t in targets.values():
            print(f"{t['result']:4}  {t['target']}")
    if replay:
        print()
        rows = [["replayed (tidal sim job)", "settled live", "settled sim", "job s live", "job s sim", "sim / live"]]
        for name, v in replay.items():
            rows.append([name, str(v["live_settled"]), str(v["sim_settled"]), f"{v['live_job_s']:.1f}",
                         f"{v['sim_job_s']:.1f}", f"{v['job_ratio']:.2f}x"])
        print(table(rows))
        print(f"model fitted by the cold run: {replay[next(iter(replay))]['params']}")
    print(f"EMULATED accelerator time ({args.device_ms_per_step:g} ms/step + {args.device_us_per_sample:g} us/sample, "
          f"batch {args.batch_size}/worker), {args.samples} samples, one epoch; every figure above is of that "
          f"emulation, not of real accelerators")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
