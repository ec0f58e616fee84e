"""``tidal demo``: the example job on this machine through a scale-out and a SIGKILL.

The scenario runs beside the master in its event loop and acts the way a user would: it asks
for a second worker once training is under way, then kills one worker with SIGKILL, and lets
the master replace it. The summary comes from what the master measured and from the ledger.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import typer

import tidal
from tidal.api import JobState, WorkerState
from tidal.master.api import JobSpec
from tidal.master.audit import audit_ledger
from tidal.master.job import JobMaster, new_token
from tidal.master.server import run_master


def example_script() -> Path:
    path = Path(tidal.__file__).resolve().parents[1] / "examples" / "ctr" / "train.py"
    if not path.is_file():
        raise typer.Exit(_say(f"tidal: error: the example {path} is missing (run the demo from a checkout)", 2))
    return path


def _say(text: str, code: int = 0) -> int:
    typer.echo(text)
    return code


async def _wait(master: JobMaster, condition, timeout: float = 120.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if master.state is not JobState.RUNNING:
            return False
        if condition():
            return True
        await asyncio.sleep(0.05)
    return False


def run_demo(samples: int, epochs: int, keep: Path | None) -> int:
    script = example_script()
    workdir = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="tidal-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ledger = workdir / "ledger.jsonl"
    ledger.unlink(missing_ok=True)
    spec = JobSpec(
        job_id="demo", argv=[sys.executable, str(script), "--samples", str(samples), "--epochs", str(epochs),
                             "--log-every", "200"],
        min_workers=1, max_workers=2, initial_workers=1, token=new_token(), job_dir=str(workdir / "job"),
        ledger_path=str(ledger), cwd=os.getcwd(),
    )
    timeline: dict[str, float] = {}

    async def scenario(master: JobMaster) -> None:
        say = lambda text: print(f"demo: {text}", flush=True)  # noqa: E731
        say("starting with 1 worker (workers 1:2)")
        if not await _wait(master, lambda: master.round >= 0 and master.finalized_step >= 40):
            return
        timeline["start"] = time.time()
        say(f"step {master.finalized_step}: scaling out to 2 workers (tidal scale 2)")
        master.scale(2)
        if not await _wait(master, lambda: len(master.members) == 2 and not master.reforming):
            return
        step = master.finalized_step
        if not await _wait(master, lambda: master.finalized_step >= step + 30):
            return
        victim = master.workers[master.members[-1]]
        say(f"step {master.finalized_step}: SIGKILL worker {victim.worker_id} (pid {victim.pid})")
        os.kill(victim.pid, signal.SIGKILL)
        await _wait(master, lambda: victim.state is WorkerState.FAILED, 30)
        say("the survivor keeps training; the master launches a replacement")
        if await _wait(master, lambda: len(master.members) == 2 and victim.worker_id not in master.members, 120):
            say(f"step {master.finalized_step}: the replacement joined, 2 workers again")

    started = time.time()
    code, master = run_master(spec, workdir / "job" / "journal.sqlite", follow_logs=True, scenario=scenario)
    elapsed = time.time() - started
    typer.echo("")
    typer.echo("== tidal demo summary " + "=" * 40)
    typer.echo(f"job:            {master.state.value} in {elapsed:.1f}s" + (f" ({master.error})" if master.error else ""))
    trained = samples * epochs
    train_s = master.metrics.get("train_seconds", 0.0)
    if train_s:
        typer.echo(f"throughput:     {trained / train_s:,.0f} samples/s over {train_s:.1f}s of training")
    for ev in master.pauses():
        if ev.cause != "start":
            typer.echo(f"pause:          {ev.seconds:.3f}s  ({ev.cause})")
    if "auc" in master.metrics:
        typer.echo(f"final AUC:      {master.metrics['auc']:.4f}  (ceiling of the known model "
                   f"{master.metrics.get('oracle_auc', float('nan')):.4f})")
    result = audit_ledger(ledger.read_text().splitlines() if ledger.exists() else [], samples, epochs)
    typer.echo(f"exactly-once:   {result.summary()}")
    typer.echo(f"ledger:         {ledger}" if keep else "ledger:         (removed; pass --keep DIR to keep it)")
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return code if result.ok else 1
