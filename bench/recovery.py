"""Recovery after every worker of a job is SIGKILLed at once: tidal (shared memory, disk) vs torchrun.

    .venv/bin/python bench/recovery.py [--rounds 2] [--every 20] [--samples N] [--sides tidal-shm,tidal-disk,torchrun]
                                       [--json] [--keep DIR]

The example (examples/ctr/train.py, ``--model-size large``: ~30 MB of parameters plus twice that
of Adam state, 89.5 MB in all; the size is printed) trained by two workers, checkpointing every
``--every`` steps; once a checkpoint exists and the job is a few steps past it, every training
worker is SIGKILLed at once (the same instant for all) and the runtime has to bring the job back
from the checkpoint. What is measured, the same way on every side:

* *recovery*: from the SIGKILL of every training worker to the first step stamp written after
  it by a new process (any step number: steps re-done from the checkpoint are not counted as
  pause, which favours torchrun, whose checkpoint is older on average). Stamps are the per-step
  lines of bench/common.py ``StampWriter`` (tidal: the example's loop, bench/common.py run as the
  tidal worker script; torchrun: bench/ddp_ctr.py);
* *resumed after*: the step number of that first stamp minus one (the step the state was at);
* *checkpoint*: the step of the checkpoint the new workers loaded, and from where (tidal: read
  from the worker's log line "resumed from the shm checkpoint of step N", the workers run with
  ``BENCH_WORKER_LOG_LEVEL=INFO``, bench/common.py; else from the master's events, source "?").
  A tidal job that resumes from before that checkpoint (e.g. from scratch) counts as failed.

Sides, ``--rounds`` fresh jobs each (alternated: a slow phase of the machine hits all), median
reported, ratio tidal/torchrun:

1. ``tidal-shm``: ``tidal run --planner fixed --history none --workers 2:2 --checkpoint-dir D
   --checkpoint-every EVERY``. The bench waits until ``GET /v1/status`` shows a
   ``checkpoint_step`` and a ``finalized_step`` a few steps past it, then SIGKILLs every worker
   process of the job (processes whose environment has the job's ``TIDAL_JOB_ID``; not the
   master, and not the checkpoint persister, which is built to outlive its worker and is not a
   training process). The master relaunches the workers; they restore the newest snapshot, which
   is still in shared memory (``/dev/shm/tidal-<job>-w<id>-<slot>``).
2. ``tidal-disk``: the same, but before the kill the bench waits until D holds a verified
   checkpoint (``tidal.worker.flash.list_checkpoints``) of at least the reported step, and right
   after the kill it deletes the job's shared-memory slots, so the new workers must load from disk.
3. ``torchrun``: one agent (``--nproc-per-node 2 --max-restarts 3 --monitor-interval 0.1``,
   c10d rendezvous on 127.0.0.1) running bench/ddp_ctr.py ``--ckpt FILE --ckpt-every EVERY``
   (rank 0 ``torch.save``-s model, Adam state and position; a temporary file renamed). Once the
   file exists and both workers are a few steps past it, both workers (the agent's children,
   not the agent) are SIGKILLed; torchrun restarts them and they ``torch.load`` the file.

Accelerator time is EMULATED: ``--device-ms-per-step`` (default 20 ms) of sleep per step on both
sides (not real compute), with a small batch, so steps are short and regular and the 2 cores are
not saturated by training. This is a 2-core CPU-only machine (bench/common.py ``MACHINE``): the
workers' Python start-up (torch import), the model construction and the checkpoint load compete
with each other and with the master/agent for those 2 cores; the 1-minute load average is printed.

A side that does not recover (tidal's master declaring the job failed, an agent giving up, no
step within ``--timeout``) is reported as failed with the reason, never waited on forever; every
process a run started (master, agent, workers, persisters) is killed when it ends, also on errors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    MACHINE,
    Stamp,
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
    torchrun_argv,
    torchrun_env,
)

SIDES = ("tidal-shm", "tidal-disk", "torchrun")
JSON_KEYS = {"tidal-shm": "tidal_shm_s", "tidal-disk": "tidal_disk_s", "torchrun": "torchrun_s"}
SHM_DIR = Path("/dev/shm")
POLL = 0.1  # seconds between looks at stamps and status (the measurement itself uses the stamps' times)


class Failed(RuntimeError):
    """A run did not get to (or through) its measurement; the message says why."""


@dataclass
class Recovery:
    seconds: float
    resumed_after: int  # step of the first stamp after the kill, minus one
    checkpoint_step: int | None  # step of the checkpoint the new workers loaded (None: not known)
    checkpoint_source: str | None  # where they loaded it from: "shm" or "disk" (None: not known)
    killed_at_step: int  # the newest step stamped before the kill
    killed: int  # how many worker processes were SIGKILLed


# ---------------------------------------------------------------------------- shared helpers
def wait_until(what: str, cond: Callable[[], Any], timeout: float, check: Callable[[], None] | None = None,
               poll: float = POLL) -> Any:
    """``cond()``'s first truthy value; ``check()`` (may raise ``Failed``) between tries;
    ``Failed`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Failed(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)


def newest_steps(stamp_dir: Path) -> dict[int, int]:
    """pid -> the newest step it stamped."""
    out: dict[int, int] = {}
    for s in load_stamps(stamp_dir):
        out[s.pid] = max(out.get(s.pid, -1), s.step)
    return out


def first_stamp_after(stamp_dir: Path, t: float, old_pids: set[int]) -> Stamp | None:
    """The earliest stamp after ``t`` of a process not in ``old_pids`` (reads only new processes' files)."""
    best: Stamp | None = None
    for path in stamp_dir.glob("*.txt"):
        pid = int(path.stem)
        if pid in old_pids:
            continue
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 4:
                continue
            st = Stamp(float(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), pid)
            if st.t > t and (best is None or st.t < best.t):
                best = st
            break  # lines are in time order: the first one of a new process is its earliest
    return best


def log_tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join("    " + ln for ln in text[-lines:])


def state_mb(model_size: str) -> float:
    """MB of model parameters + Adam state (exp_avg, exp_avg_sq, step) of the example's DLRM."""
    import torch

    from examples.ctr.model import DLRM
    from examples.ctr.train import MODEL_SIZES

    model = DLRM(**MODEL_SIZES[model_size])  # type: ignore[arg-type]
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates the state
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    n += sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
             if isinstance(v, torch.Tensor))
    return n / 2**20


# ---------------------------------------------------------------------------- tidal
def job_processes(job_id: str, exclude: set[int]) -> list[psutil.Process]:
    """Every process (of this user) whose environment has ``TIDAL_JOB_ID == job_id``."""
    out = []
    for p in psutil.process_iter():
        if p.pid in exclude:
            continue
        with contextlib.suppress(psutil.Error):
            if p.environ().get("TIDAL_JOB_ID") == job_id:
                out.append(p)
    return out


def is_persister(p: psutil.Process) -> bool:
    try:
        return any("persister" in a for a in p.cmdline())
    except psutil.Error:
        return False


def remove_job_shm(job_id: str) -> list[Path]:
    """Unlink every shared-memory slot (and temporary) of the job: ``/dev/shm/[.]tidal-<job>-*``."""
    removed = []
    for pattern in (f"tidal-{job_id}-*", f".tidal-{job_id}-*"):
        for path in SHM_DIR.glob(pattern):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
    return removed


class TidalJob:
    def __init__(self, work: Path, train: Sequence[str], every: int, timeout: float) -> None:
        self.work = work
        self.stamps = work / "stamps"
        self.ckpt = work / "ckpt"
        self.log = work / "tidal.log"
        job_dir = work / "job"
        opts = ["--planner", "fixed", "--history", "none", "--checkpoint-dir", str(self.ckpt),
                "--checkpoint-every", str(every)]
        # the workers log tidal's INFO lines: "resumed from the shm checkpoint of step N" (bench/common.py)
        self.proc = start(tidal_argv("2:2", job_dir, self.stamps, train, run_opts=opts), self.log,
                          bench_env(BENCH_WORKER_LOG_LEVEL="INFO"))
        self.job_id = ""
        self.master_pid = self.proc.pid
        self.http: httpx.Client | None = None
        self._last_status: dict[str, Any] = {}
        self._last_poll = 0.0
        path = job_dir / "job.json"
        wait_until("tidal run to write job.json", lambda: path.is_file(), timeout, self.check_master)
        info = json.loads(path.read_text())
        self.job_id = str(info["job_id"])
        self.master_pid = int(info.get("master_pid", self.proc.pid))
        self.http = httpx.Client(base_url=info["url"], headers={"Authorization": f"Bearer {info['token']}"},
                                 timeout=10)

    def check_master(self) -> None:
        if self.proc.poll() is not None:
            raise Failed(f"tidal run exited with code {self.proc.returncode}:\n{log_tail(self.log)}")

    def status(self) -> dict[str, Any]:
        assert self.http is not None
        try:
            r = self.http.get("/v1/status")
            r.raise_for_status()
        except httpx.HTTPError as exc:
            self.check_master()
            raise Failed(f"GET /v1/status failed: {exc}") from None
        st: dict[str, Any] = r.json()
        self._last_status = st
        return st

    def check(self) -> None:
        """Raise ``Failed`` if the master has gone or declared the job failed (status at most every 0.5 s)."""
        self.check_master()
        if time.monotonic() - self._last_poll < 0.5:
            return
        self._last_poll = time.monotonic()
        st = self.status()
        if st.get("state") == "failed":
            raise Failed(f"the tidal job FAILED instead of recovering: {st.get('error')}")

    def workers(self) -> list[psutil.Process]:
        """The job's training worker processes (not the master, not checkpoint persisters)."""
        procs = job_processes(self.job_id, {os.getpid(), self.master_pid, self.proc.pid})
        return [p for p in procs if not is_persister(p)]

    def loaded(self, after: float) -> tuple[int | None, str | None]:
        """(step, "shm" | "disk") of the checkpoint the new workers restored, as the worker that
        loaded it logs it (tidal.worker.job: "resumed from the shm checkpoint of step N"); else
        the step from the master's last event after ``after`` that names one ("resuming from the
        checkpoint of step N"; "resuming from scratch": (-1, "scratch")), source unknown; else
        (None, None)."""
        for log in sorted((self.work / "job" / "logs").glob("worker-*.log")):
            with contextlib.suppress(OSError):
                if log.stat().st_mtime > after and (
                        m := re.search(r"resumed from the (\w+) checkpoint of step (\d+)", log.read_text(errors="replace"))):
                    return int(m.group(2)), m.group(1)
        found: tuple[int | None, str | None] = (None, None)
        with contextlib.suppress(Failed):
            for ev in self.status().get("events", []):
                message = ev.get("message", "")
                if ev.get("time", 0) <= after:
                    continue
                if m := re.search(r"checkpoint of step (\d+)", message):
                    found = int(m.group(1)), None
                elif "from scratch" in message:
                    found = -1, "scratch"
        return found

    def close(self) -> None:
        """Stop the master (SIGINT: it fails the job and kills its workers), then kill whatever of
        the job is left (workers and persisters run in sessions of their own) and free its slots."""
        if self.http is not None:
            self.http.close()
        stop(self.proc, signal.SIGINT)
        if self.job_id:
            leftover = job_processes(self.job_id, {os.getpid()})
            kill_pids(p.pid for p in leftover)
            psutil.wait_procs(leftover, timeout=5)
            remove_job_shm(self.job_id)


def disk_checkpoint(directory: Path, at_least: int) -> int | None:
    """The step of a verified checkpoint in ``directory`` of step >= ``at_least`` (None: none yet).
    Only lists (and so hashes) the checkpoints once a directory of such a step exists."""
    steps = [int(p.name[5:]) for p in directory.glob("step-*") if p.name[5:].isdigit()]
    if not any(s >= at_least for s in steps):
        return None
    from tidal.worker.flash import list_checkpoints

    ok = [c.step for c in list_checkpoints(directory) if c.ok and c.step >= at_least]
    return max(ok) if ok else None


def tidal_round(work: Path, train: Sequence[str], args: argparse.Namespace, disk: bool) -> Recovery:
    job = TidalJob(work, train, args.every, args.timeout)
    try:
        warm, settle = args.warm, args.settle

        def ready() -> dict[str, Any] | None:
            st = job.status()
            ck = int(st.get("checkpoint_step", -1))  # steps count from 0: step s is s + 1 applied steps
            return st if ck + 1 >= warm and int(st.get("finalized_step", -1)) >= ck + settle else None

        st = wait_until(f"checkpoint_step >= {warm - 1} and finalized_step >= it + {settle}", ready,
                        args.timeout, job.check, poll=0.25)
        reported = int(st["checkpoint_step"])
        on_disk = None
        if disk:
            on_disk = wait_until(f"a verified checkpoint of step >= {reported} in {job.ckpt}",
                                 lambda: disk_checkpoint(job.ckpt, reported), args.timeout, job.check, poll=0.5)
        victims = job.workers()
        active = {w["pid"] for w in job.status().get("workers", []) if w.get("state") == "active"}
        pids = {p.pid for p in victims}
        if len(pids) < 2 or not active <= pids:
            raise Failed(f"expected the 2 active workers {sorted(active)} among the job's processes, "
                         f"found {sorted(pids)}")
        before = newest_steps(job.stamps)
        t = time.time()
        kill_pids(pids)
        removed = remove_job_shm(job.job_id) if disk else []  # then the new workers must load from disk
        psutil.wait_procs(victims, timeout=5)
        first = wait_until("the first step after the kill", lambda: first_stamp_after(job.stamps, t, pids),
                           args.timeout, job.check)
        step, source = job.loaded(t)
        if first.step - 1 < reported:
            raise Failed(f"the job resumed after step {first.step - 1}, before the checkpoint of step {reported} "
                         f"that existed at the kill: the checkpoint was not restored (loaded: {step}, {source})")
        if disk and source == "shm":
            raise Failed("the new workers loaded the shared-memory snapshot although the bench removed it")
        if not disk and source not in ("shm", None):
            print(f"    NOTE: the new workers loaded the checkpoint from {source}, not from shared memory",
                  file=sys.stderr, flush=True)
        note = f"status checkpoint_step {reported}" + (
            f", on disk {on_disk}, {len(removed)} shared-memory files removed" if disk else "")
        print(f"    killed {len(pids)} workers at step {max(before.values(), default=-1)} ({note})",
              file=sys.stderr, flush=True)
        return Recovery(first.t - t, first.step - 1, step, source, max(before.values(), default=-1), len(pids))
    finally:
        job.close()


# ---------------------------------------------------------------------------- torchrun
def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def torchrun_round(work: Path, train: Sequence[str], args: argparse.Namespace) -> Recovery:
    stamps, ckpt, log = work / "stamps", work / "ckpt.pt", work / "torchrun.log"
    argv = torchrun_argv("1", 2, stamps, train, agent_opts=["--max-restarts", "3", "--monitor-interval", "0.1"],
                         script_opts=["--ckpt", str(ckpt), "--ckpt-every", str(args.every)])
    agent = start(argv, log, torchrun_env())
    seen: dict[int, psutil.Process] = {}

    def check() -> None:
        for p in descendants(agent.pid):
            seen.setdefault(p.pid, p)
        if agent.poll() is not None:
            raise Failed(f"torchrun exited with code {agent.returncode}:\n{log_tail(log)}")

    try:
        # rank 0 writes the checkpoint of step c (a multiple of EVERY; steps count from 0: step c
        # is c + 1 applied steps, as tidal's) before it stamps step c + 1
        c = math.ceil(max(args.warm - 1, 0) / args.every) * args.every

        def ready() -> bool:
            steps = newest_steps(stamps)
            return ckpt.is_file() and len(steps) >= 2 and min(steps.values()) >= c + args.settle

        wait_until(f"the checkpoint of step {c} and step {c + args.settle} on both workers", ready,
                   args.timeout, check)
        victims = [p for p in psutil.Process(agent.pid).children() if p.is_running()]
        if len(victims) != 2:
            raise Failed(f"torchrun has {len(victims)} workers, expected 2")
        pids = {p.pid for p in victims}
        before = newest_steps(stamps)
        t = time.time()
        kill_pids(pids)
        # the file as it was at the kill: rank 0 renames a new one over it once it is training again
        at_kill = work / "ckpt-at-kill.pt"
        os.link(ckpt, at_kill)
        first = wait_until("the first step after the kill", lambda: first_stamp_after(stamps, t, pids),
                           args.timeout, check)
        import torch

        loaded = int(torch.load(at_kill, weights_only=True, mmap=True)["step"])
        return Recovery(first.t - t, first.step - 1, loaded, "disk", max(before.values(), default=-1), len(pids))
    finally:
        with contextlib.suppress(psutil.Error):
            seen.update({p.pid: p for p in descendants(agent.pid)})
        stop(agent, signal.SIGTERM)
        left = [p for p in seen.values() if p.is_running()]
        kill_pids(p.pid for p in left)  # the workers run in sessions of their own
        psutil.wait_procs(left, timeout=5)


# ---------------------------------------------------------------------------- report
def _num(x: float) -> float | None:
    return None if x != x else round(x, 4)


def report(results: dict[str, list[Recovery]], failures: dict[str, str], mb: float, load: list[float],
           args: argparse.Namespace) -> dict[str, Any]:
    med = {side: median([r.seconds for r in results[side]]) for side in args.sides}
    peer = med.get("torchrun", float("nan"))
    out: dict[str, Any] = {
        "recovery": {**{JSON_KEYS[s]: _num(med.get(s, float("nan"))) for s in SIDES}, "state_mb": round(mb, 1)},
        "ratio_vs_torchrun": {JSON_KEYS[s].removesuffix("_s"): _num(med[s] / peer)
                              for s in args.sides if s != "torchrun"},
        "runs": {s: [asdict(r) for r in results[s]] for s in args.sides},
        "failures": failures,
        "every_steps": args.every, "rounds": args.rounds, "device_ms_per_step": args.device_ms_per_step,
        "batch_size": args.batch_size, "load_average": load, "machine": MACHINE,
    }
    if args.json:
        print(json.dumps(out))
        return out
    rows = [["side", "recovery s (median)", "ratio vs torchrun", "runs s", "resumed after step",
             "checkpoint step loaded", "killed at step"]]
    for s in args.sides:
        rs = results[s]
        ratio = "-" if s == "torchrun" else (f"{med[s] / peer:.2f}x" if med[s] == med[s] and peer == peer else "n/a")
        cell = f"{med[s]:.3f}" if med[s] == med[s] else "FAILED" if s in failures else "n/a"
        rows.append([s, cell, ratio, runs([r.seconds for r in rs]),
                     " ".join(str(r.resumed_after) for r in rs),
                     " ".join(("?" if r.checkpoint_step is None else str(r.checkpoint_step))
                              + f" ({r.checkpoint_source or '?'})" for r in rs),
                     " ".join(str(r.killed_at_step) for r in rs)])
    print(table(rows))
    print(f"state: {mb:.1f} MB (model + Adam state, --model-size large); checkpoint every {args.every} steps; "
          f"EMULATED accelerator time {args.device_ms_per_step:g} ms/step; batch {args.batch_size} per worker")
    print(f"load average (1 min) at start / end: {runs(load, '{:.2f}')}; {MACHINE}")
    for side, why in failures.items():
        print(f"{side}: FAILED: {why}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="fresh jobs per side (alternated); the median is reported")
    p.add_argument("--every", type=int, default=20, help="checkpoint every EVERY steps (both runtimes)")
    p.add_argument("--warm", type=int, default=20,
                   help="kill only once a checkpoint taken after at least WARM applied steps exists (start-up "
                        "settled; with the defaults: tidal's of step 19, torchrun's of step 20)")
    p.add_argument("--settle", type=int, default=5, help="... and the job is SETTLE steps past that checkpoint")
    p.add_argument("--samples", type=int, default=2_000_000,
                   help="samples of the one epoch (enough that no job ends before its measurement)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per worker per step")
    p.add_argument("--device-ms-per-step", type=float, default=20.0,
                   help="EMULATED accelerator time per step (sleep), both sides")
    p.add_argument("--model-size", default="large", help="examples/ctr/train.py --model-size")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any one wait may take before the run fails")
    p.add_argument("--json", action="store_true",
                   help='print {"recovery": {"tidal_shm_s", "tidal_disk_s", "torchrun_s", "state_mb"}, ...} as JSON')
    p.add_argument("--keep", type=Path, default=None, help="keep logs, stamps and checkpoints in this directory")
    args = p.parse_args()
    args.sides = [s for s in args.sides.split(",") if s]
    bad = [s for s in args.sides if s not in SIDES]
    if bad or not args.sides:
        p.error(f"--sides: unknown {bad}; choose from {', '.join(SIDES)}")
    if args.rounds < 1 or args.every < 1:
        p.error("--rounds and --every must be >= 1")
    train = ["--samples", str(args.samples), "--epochs", "1", "--batch-size", str(args.batch_size),
             "--log-every", "0", "--model-size", args.model_size, "--device-ms-per-step", str(args.device_ms_per_step)]
    mb = state_mb(args.model_size)
    print(f"state {mb:.1f} MB (model + Adam); sides {', '.join(args.sides)}; {args.rounds} round(s)",
          file=sys.stderr, flush=True)
    base = Path(tempfile.mkdtemp(prefix="tidal-recovery-")) if args.keep is None else args.keep
    results: dict[str, list[Recovery]] = {s: [] for s in args.sides}
    failures: dict[str, str] = {}
    load = [load_average()]
    try:
        for i in range(args.rounds):
            for side in args.sides:
                if side in failures:
                    continue  # a side that failed once is not run again
                work = base / f"{side}-{i}"
                print(f"{side} round {i} (load {load_average():.2f}) ...", file=sys.stderr, flush=True)
                try:
                    if side == "torchrun":
                        r = torchrun_round(work, train, args)
                    else:
                        r = tidal_round(work, train, args, disk=side == "tidal-disk")
                except (Failed, OSError, subprocess.SubprocessError, psutil.Error) as exc:
                    failures[side] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    print(f"  {side} round {i}: FAILED: {exc}", file=sys.stderr, flush=True)
                    continue
                results[side].append(r)
                print(f"  {side} round {i}: recovery {r.seconds:.3f}s, resumed after step {r.resumed_after}, "
                      f"checkpoint step {r.checkpoint_step} ({r.checkpoint_source or 'source not known'})",
                      file=sys.stderr, flush=True)
        load.append(load_average())
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    report(results, failures, mb, load, args)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
