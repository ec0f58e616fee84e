"""Chaos ledger audit: real jobs under mixed faults, each must end exactly once or FAILED with a reason.

    sudo .venv/bin/python bench/chaos.py --runs 20 --seed 0     # root: the disk-full window mounts a tmpfs

Every run trains examples/ctr/train.py with ``tidal run`` (3 workers, the job directory and the
ledger on a 64 MiB tmpfs) and, at seeded random times, injects a mix of:

* ``kill``: SIGKILL of a random active worker (1-2 per run);
* ``master``: SIGKILL of the master, then ``tidal master --resume`` one second later;
* ``disk``: the tmpfs filled to ENOSPC for 10 s, then emptied;
* ``hang``: one worker's main thread hangs at a random step while its heartbeat thread goes on
  (``--hang-worker``), which the master must detect by progress (``--round-timeout``).

A run's outcome is one of: ``exactly once`` (exit 0 and the ledger covers every epoch exactly
once), ``failed: REASON`` (exit 1 with the master's reason) or the two defects this guards
against: ``FALSE SUCCESS`` (exit 0 with a ledger that is not exactly once) and ``HUNG`` (no end
within the time limit). The table goes to stdout; the exit status is 1 if any run is a defect.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import MACHINE, ROOT, TIDAL, load_average, table
from tidal.master.audit import audit_ledger

EXAMPLE = ROOT / "examples" / "ctr" / "train.py"


@dataclass
class Run:
    index: int
    faults: list[str] = field(default_factory=list)
    code: int | None = None
    outcome: str = ""
    seconds: float = 0.0
    paused_s: float = 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=80_000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.06, help="seconds per step on top of compute")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    p.add_argument("--work", type=Path, default=None, help="where runs keep their files (default: a temp dir)")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="tidal-chaos-"))
    rng = random.Random(args.seed)
    results = []
    started = time.time()
    for i in range(args.runs):
        run = one_run(i, rng, work / f"run-{i:02d}", args)
        results.append(run)
        print(f"run {i:2d}: {', '.join(run.faults):48s} -> {run.outcome} ({run.seconds:.0f} s)", flush=True)
    rows = [["run", "faults", "exit", "paused (s)", "time (s)", "outcome"]]
    for r in results:
        rows.append([str(r.index), " ".join(r.faults), str(r.code), f"{r.paused_s:.1f}", f"{r.seconds:.0f}", r.outcome])
    print()
    print(table(rows))
    defects = [r for r in results if r.outcome in ("FALSE SUCCESS", "HUNG")]
    ok = sum(r.outcome == "exactly once" for r in results)
    print(f"\n{len(results)} runs: {ok} exactly once and succeeded, {len(results) - ok - len(defects)} failed with a "
          f"reason, {len(defects)} defects (false success or hung); {time.time() - started:.0f} s; {MACHINE}; "
          f"load {load_average():.1f}")
    return 1 if defects else 0


def one_run(index: int, rng: random.Random, directory: Path, args: argparse.Namespace) -> Run:
    run = Run(index)
    directory.mkdir(parents=True, exist_ok=True)
    disk = directory / "disk"
    disk.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], check=True)
    job_dir, ledger, log = disk / "job", disk / "ledger.jsonl", directory / "out.log"
    # the fault schedule: seconds after step 10
    schedule: list[tuple[float, str]] = [(rng.uniform(1, 12), "kill") for _ in range(rng.randint(1, 2))]
    schedule.append((rng.uniform(2, 14), "master"))
    schedule.append((rng.uniform(2, 14), "disk"))
    schedule.sort()
    hang_worker = rng.randrange(args.workers)
    hang_step = rng.randint(30, 180)  # a job of 208 steps at the defaults
    argv = [TIDAL, "run", "-q", "--workers", f"{args.workers}:{args.workers}", "--job-dir", str(job_dir),
            "--ledger", str(ledger), "--collective-timeout", "3", "--round-timeout", "3",
            str(EXAMPLE), "--samples", str(args.samples), "--epochs", str(args.epochs), "--batch-size", "256",
            "--step-sleep", str(args.step_sleep), "--log-every", "0",
            "--hang-worker", str(hang_worker), "--hang-at-step", str(hang_step)]
    env = {**os.environ, "TIDAL_HOME": str(directory / "home")}
    t0 = time.time()
    masters = [spawn(argv, log, env)]
    job_id = ""
    try:
        info = wait_job_file(job_dir, 60)
        job_id = info["job_id"]
        wait_step(info, 10, 120)
        t_faults = time.time()
        for at, name in schedule:
            time.sleep(max(0.0, t_faults + at - time.time()))
            if masters[-1].poll() is not None:
                run.faults.append(f"{name}(after the end)")
                continue
            run.faults.append(f"{name}@{time.time() - t_faults:.0f}s")  # faults run one after another
            if name == "kill":
                kill_a_worker(info, rng)
            elif name == "master":
                masters[-1].send_signal(signal.SIGKILL)
                masters[-1].wait()
                time.sleep(1.0)
                masters.append(spawn([TIDAL, "master", "--resume", str(job_dir / "journal.sqlite"), "-q"], log, env))
            elif name == "disk":
                run.paused_s += disk_full_window(disk, info, 10.0)
        try:
            run.code = masters[-1].wait(max(1.0, args.timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            run.outcome = "HUNG"
        hung = f"hang(w{hang_worker}@step{hang_step})"
        run.faults.append(hung if hang_seen(log, hang_worker) else f"{hung}(not caught)")
        if not run.outcome:
            run.outcome = outcome(run.code, log, ledger, args)
    finally:
        run.seconds = time.time() - t0
        for proc in masters:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        kill_job(job_id)
        if ledger.exists():
            shutil.copy(ledger, directory / "ledger.jsonl")
        if job_dir.exists():  # the workers' logs and the journal, for a post-mortem
            shutil.copytree(job_dir, directory / "job", dirs_exist_ok=True)
        subprocess.run(["umount", "-l", str(disk)], check=False)
    return run


def outcome(code: int | None, log: Path, ledger: Path, args: argparse.Namespace) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("tidal: job ")]
    summary = lines[-1] if lines else ""
    if code == 0:
        audit = audit_ledger(ledger.read_text().splitlines(), args.samples, args.epochs)
        return "exactly once" if audit.ok else "FALSE SUCCESS"
    reason = summary.split(": ", 2)[-1] if "failed" in summary else f"exit {code} without a reason"
    return f"failed: {reason[:90]}"


def hang_seen(log: Path, worker: int) -> bool:
    """Whether the hung worker was caught (its main thread hung and the master failed it)."""
    return f"worker {worker} failed: did not reach the rendezvous" in log.read_text(errors="replace")


def spawn(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)


def wait_job_file(job_dir: Path, timeout: float) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            return json.loads((job_dir / "job.json").read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            time.sleep(0.1)
    raise RuntimeError("the job never wrote job.json")


def status(info: dict) -> dict | None:
    try:
        resp = httpx.get(info["url"] + "/v1/status", headers={"Authorization": f"Bearer {info['token']}"}, timeout=2)
        return resp.json() if resp.status_code == 200 else None
    except httpx.HTTPError:
        return None


def wait_step(info: dict, step: int, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = status(info)
        if st and st["finalized_step"] >= step:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the job did not reach step {step}")


def kill_a_worker(info: dict, rng: random.Random) -> None:
    st = status(info)
    active = [w for w in (st or {}).get("workers", []) if w["state"] == "active"]
    if active:
        os.kill(rng.choice(active)["pid"], signal.SIGKILL)


def disk_full_window(disk: Path, info: dict, seconds: float) -> float:
    """Fill the filesystem for ``seconds``; returns how long the master reported itself paused."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass
    paused, end = 0.0, time.time() + seconds
    while time.time() < end:
        st = status(info)
        if st and st.get("paused"):
            paused += 0.2
        time.sleep(0.2)
    filler.unlink()
    return paused


def kill_job(job_id: str) -> None:
    if not job_id:
        return
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("TIDAL_JOB_ID") == job_id:
                proc.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    sys.exit(main())
