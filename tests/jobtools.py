"""Drive real ``tidal run`` jobs from tests: start, watch over HTTP, kill, audit, clean up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil

from tidal.master.audit import LedgerAudit, audit_ledger

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ctr" / "train.py"
TIDAL = str(Path(sys.executable).with_name("tidal"))


class Job:
    """One ``tidal run`` subprocess and its job directory."""

    def __init__(self, tmp: Path, workers: str, script_args: list[str], *, run_args: list[str] | None = None,
                 script: Path = EXAMPLE, name: str = "job") -> None:
        self.dir = tmp / name
        self.ledger = tmp / f"{name}.ledger"
        self.out = tmp / f"{name}.out"
        run_args = list(run_args or [])
        if "--planner" not in run_args:  # the runtime's tests keep MAX workers unless they test a planner
            run_args = ["--planner", "max", *run_args]
        self.argv = [TIDAL, "run", "-q", "--workers", workers, "--job-dir", str(self.dir),
                     "--ledger", str(self.ledger), *run_args, str(script), *script_args]
        self.proc: subprocess.Popen[bytes] | None = None
        self.masters: list[subprocess.Popen[bytes]] = []
        self._info: dict[str, Any] | None = None

    def start(self) -> Job:
        self.proc = self._spawn(self.argv)
        return self

    def _spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        out = open(self.out, "ab")
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env={**os.environ, "TIDAL_HOME": str(self.dir.parent / ".tidal")})
        out.close()
        self.masters.append(proc)
        return proc

    def resume_master(self) -> subprocess.Popen[bytes]:
        self.proc = self._spawn([TIDAL, "master", "--resume", str(self.dir / "journal.sqlite"), "-q"])
        return self.proc

    def kill_master(self) -> None:
        """SIGKILL the master (its workers, in sessions of their own, train on)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def resume_master_and_train(self, steps: int = 5) -> dict[str, Any]:
        """A new master from the journal, once it runs and ``steps`` more steps are final."""
        self.resume_master()
        st = self.wait_status(lambda s: s["state"] == "running", 60, "the resumed master")
        return self.wait_step(st["finalized_step"] + steps, 120)

    def resume(self) -> subprocess.Popen[bytes]:
        """``tidal resume JOBDIR``: a job whose master (and maybe every worker) is gone."""
        self.proc = self._spawn([TIDAL, "resume", str(self.dir), "-q"])
        return self.proc

    # ------------------------------------------------------------------ observing
    def info(self) -> dict[str, Any]:
        if self._info is None:
            wait_for(lambda: (self.dir / "job.json").is_file(), 60, "job.json")
            self._info = json.loads((self.dir / "job.json").read_text())
        return self._info

    def status(self) -> dict[str, Any]:
        info = self.info()
        resp = httpx.get(info["url"] + "/v1/status", headers={"Authorization": f"Bearer {info['token']}"}, timeout=5)
        resp.raise_for_status()
        data = resp.json()
        return data

    def try_status(self) -> dict[str, Any] | None:
        try:
            return self.status()
        except (httpx.HTTPError, OSError):
            return None

    def active(self) -> list[dict[str, Any]]:
        st = self.try_status()
        return [w for w in st["workers"] if w["state"] == "active"] if st else []

    def wait_status(self, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        box: dict[str, Any] = {}

        def check() -> bool:
            st = self.try_status()
            if st is not None and pred(st):
                box["st"] = st
                return True
            return False

        wait_for(check, timeout, what, self)
        return box["st"]

    def wait_active(self, timeout: float = 60) -> list[dict[str, Any]]:
        """The active workers, once there is one (``active()`` is empty while a status read times
        out on a loaded machine, or while the workers re-form)."""
        st = self.wait_status(lambda s: any(w["state"] == "active" for w in s["workers"]), timeout, "an active worker")
        return [w for w in st["workers"] if w["state"] == "active"]

    def wait_step(self, step: int, timeout: float = 90) -> dict[str, Any]:
        return self.wait_status(lambda s: s["finalized_step"] >= step, timeout, f"step {step}")

    def scale(self, n: int) -> None:
        info = self.info()
        httpx.post(info["url"] + "/v1/scale", json={"workers": n}, timeout=5,
                   headers={"Authorization": f"Bearer {info['token']}"}).raise_for_status()

    def scale_ps(self, n: int) -> None:
        info = self.info()
        httpx.post(info["url"] + "/v1/scale", json={"ps": n}, timeout=5,
                   headers={"Authorization": f"Bearer {info['token']}"}).raise_for_status()

    def scale_data(self, n: int) -> None:
        info = self.info()
        httpx.post(info["url"] + "/v1/scale", json={"data_workers": n}, timeout=5,
                   headers={"Authorization": f"Bearer {info['token']}"}).raise_for_status()

    def wait(self, timeout: float = 180) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"job did not finish in {timeout}s:\n{self.output()[-3000:]}") from None

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def audit(self, size: int, epochs: int) -> LedgerAudit:
        return audit_ledger(self.ledger.read_text().splitlines(), size, epochs)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        st = self.try_status()
        evs = st["events"] if st else []
        return [e for e in evs if kind is None or e["kind"] == kind]

    # ------------------------------------------------------------------ cleanup
    def worker_processes(self) -> list[psutil.Process]:
        """The job's training processes (not their persisters, which are in sessions of their own,
        nor its parameter servers)."""
        return self._processes(lambda env, cmd: "TIDAL_WORKER_ID" in env and "persister" not in cmd)

    def server_processes(self) -> list[psutil.Process]:
        """The job's parameter servers (``--ps``)."""
        return self._processes(lambda env, cmd: "TIDAL_PS_ID" in env)

    def _processes(self, pick: Callable[[dict[str, str], str], bool]) -> list[psutil.Process]:
        job_id = self.info()["job_id"]
        out = []
        for p in psutil.process_iter():
            try:
                env = p.environ()
                if env.get("TIDAL_JOB_ID") == job_id and pick(env, " ".join(p.cmdline())):
                    out.append(p)
            except psutil.Error:
                pass
        return out

    def kill_workers(self) -> list[int]:
        """SIGKILL every training process of the job at once; their pids."""
        procs = self.worker_processes()
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=10)
        return [p.pid for p in procs]

    def kill_all(self) -> None:
        for proc in self.masters:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        if self._info is None and (self.dir / "job.json").is_file():
            self._info = json.loads((self.dir / "job.json").read_text())
        job_id = self._info["job_id"] if self._info else None
        if not job_id:
            return
        # every worker of the job, also those no status showed (they run in sessions of their
        # own, so killing the master's process group does not reach them); scanned again until
        # none is left: a process forked while the scan ran (a persister) is not in it
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            found = []
            for p in psutil.process_iter():
                try:
                    if p.environ().get("TIDAL_JOB_ID") == job_id:
                        p.kill()
                        found.append(p)
                except psutil.Error:
                    pass
            if not found:
                return
            psutil.wait_procs(found, timeout=5)


def fingerprint(directory: Path) -> str:
    """``tidal fingerprint`` of the newest checkpoint in ``directory``."""
    out = subprocess.run([TIDAL, "fingerprint", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[0]


def plain_python_fingerprint(directory: Path, script_args: list[str]) -> str:
    """The example under plain python (no master, no ``TIDAL_*`` environment), checkpointed into
    ``directory``: the reference a job's fingerprint is compared with."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    out = subprocess.run([sys.executable, str(EXAMPLE), *script_args, "--checkpoint-dir", str(directory)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return fingerprint(directory)


def example_args(samples: int, epochs: int, batch: int = 256, sleep: float = 0.0, *extra: str) -> list[str]:
    """Arguments of examples/ctr/train.py: a small job, no progress lines."""
    return ["--samples", str(samples), "--epochs", str(epochs), "--batch-size", str(batch),
            "--step-sleep", str(sleep), "--log-every", "0", *extra]


def wait_for(pred: Callable[[], bool], timeout: float, what: str, job: Job | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    tail = job.output()[-3000:] if job else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tail}")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def mount_tmpfs(point: Path, size: str) -> None:
    """Mount a tmpfs of ``size`` (``"512k"``, ``"64m"``) at ``point`` (created): a real disk
    that fills up. Skips the test where mounting is not allowed; unmount with ``umount_lazy``."""
    import pytest

    point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to make a full disk here: {done.stderr.strip()}")


def umount_lazy(points: list[Path]) -> None:
    for point in points:
        subprocess.run(["umount", "-l", str(point)], check=False)


@contextmanager
def tmpfs_mounts(directory: Path) -> Iterator[Callable[[str, str], Path]]:
    """``mount(name, size)`` mounts a tmpfs of ``size`` at ``directory/name`` (a real disk that
    fills up, ``mount_tmpfs``); every one is unmounted on exit."""
    mounted: list[Path] = []

    def mount(name: str, size: str) -> Path:
        point = directory / name
        mount_tmpfs(point, size)
        mounted.append(point)
        return point

    try:
        yield mount
    finally:
        umount_lazy(mounted)

