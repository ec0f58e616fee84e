"""Shared pieces of the runtime benchmarks (issues 2 and 5), and the instrumented tidal worker.

Run as a script (``tidal run ... bench/common.py --stamp-dir DIR [example args]``, or plain
``python bench/common.py ...`` for a local job without a master) this file runs
examples/ctr/train.py's ``main`` itself, unchanged: same arguments, ClickDataset, DLRM, Adam,
BCE loss, ``job.loader``/``job.step()`` calls, ``--step-sleep`` pacing, ``--logical-workers``.
The only addition is made from outside: ``tidal.worker.init`` is wrapped so that every step the
process applies appends one line ``wall_time world_size local_samples step`` to
``DIR/<pid>.txt``, and the process's peak RSS (``VmHWM``, kB) is written to ``DIR/<pid>.mem``
when the script ends. bench/ddp_ctr.py writes the same lines under torchrun, so both runtimes are
measured by the same code (``load_stamps``, ``largest_gap``, ``throughput``) from the same files.

Stamps are written with ``time.time()`` right after the step's ``optimizer.step()``, one small
line-buffered ``write`` each, on both sides. With logical workers a stamp carries the samples of
every EST of the process in that step: one stamp per optimizer step, as DDP's.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
VENV_BIN = Path(PYTHON).parent
TIDAL = str(VENV_BIN / "tidal")
TORCHRUN = str(VENV_BIN / "torchrun")
WORKER = str(ROOT / "bench" / "common.py")
DDP_WORKER = str(ROOT / "bench" / "ddp_ctr.py")
MACHINE = "2-core x86_64 VM, 24 GiB, CPU only, torch 2.13.0+cpu"


# ---------------------------------------------------------------------------- stamps
@dataclass(frozen=True)
class Stamp:
    t: float
    world: int
    samples: int
    step: int
    pid: int


class StampWriter:
    """Appends one line per applied step to ``<dir>/<pid>.txt`` (no-op without a directory).

    It also samples the process's resident set every ``RSS_EVERY`` stamps (one read of
    ``/proc/self/statm``) and, on ``close``, writes ``<dir>/<pid>.mem``: the largest sample (the
    peak while training, kB) and ``VmHWM`` (the peak over the whole life, start-up and the
    example's final evaluation included, kB)."""

    RSS_EVERY = 16

    def __init__(self, directory: str | None) -> None:
        self._dir = Path(directory) if directory else None
        self._f = None
        self._n = 0
        self.train_peak_kb = 0
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._f = open(self._dir / f"{os.getpid()}.txt", "a", buffering=1)

    def stamp(self, world: int, samples: int, step: int) -> None:
        if self._f is not None:
            self._f.write(f"{time.time():.6f} {world} {samples} {step}\n")
            if self._n % self.RSS_EVERY == 0:
                self.train_peak_kb = max(self.train_peak_kb, rss_kb())
            self._n += 1

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._dir is not None:
            (self._dir / f"{os.getpid()}.mem").write_text(f"{self.train_peak_kb} {peak_rss_kb()}")


def rss_kb() -> int:
    """The current resident set size of this process in kB (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def peak_rss_kb(pid: int | str = "self") -> int:
    """``VmHWM`` of a process: its peak resident set size in kB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return -1


def load_stamps(directory: Path) -> list[Stamp]:
    """Every stamp of every process in ``directory``, sorted by time."""
    out: list[Stamp] = []
    for path in Path(directory).glob("*.txt"):
        pid = int(path.stem)
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 4:
                continue  # a line being written
            out.append(Stamp(float(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), pid))
    out.sort(key=lambda s: s.t)
    return out


def load_peak_rss(directory: Path) -> dict[int, tuple[int, int]]:
    """pid -> (peak RSS while training, VmHWM) in kB, as written by ``StampWriter.close``."""
    out = {}
    for p in Path(directory).glob("*.mem"):
        train, hwm = p.read_text().split()
        out[int(p.stem)] = (int(train), int(hwm))
    return out


def largest_gap(stamps: Sequence[Stamp], t0: float, t1: float) -> float:
    """The largest gap between consecutive steps (any worker) from the last step before ``t0``
    up to the first step after ``t1``."""
    times = [s.t for s in stamps]
    lo = max((i for i, x in enumerate(times) if x <= t0), default=0)
    hi = min((i for i, x in enumerate(times) if x > t1), default=len(times) - 1)
    window = times[lo:hi + 1]
    if len(window) < 2:
        return float("nan")
    return max(b - a for a, b in itertools.pairwise(window))


def throughput(stamps: Sequence[Stamp], t0: float, t1: float) -> float:
    """Samples/s of every worker together over ``(t0, t1]``."""
    n = sum(s.samples for s in stamps if t0 < s.t <= t1)
    return n / max(t1 - t0, 1e-9)


def steady_rate(stamp_dir: Path, warmup: float, tail: float = 0.5) -> tuple[float, int]:
    """(samples/s, processes) of a finished run: from ``warmup`` s after its first stamp to
    ``tail`` s before its last (start-up, first rendezvous and state sync, and the end where a
    worker may run out of data first are left out)."""
    stamps = load_stamps(stamp_dir)
    if len(stamps) < 10:
        raise RuntimeError(f"too few steps stamped in {stamp_dir}")
    t0, t1 = stamps[0].t + warmup, stamps[-1].t - tail
    return throughput(stamps, t0, t1), len({s.pid for s in stamps})


def wait_for_steps(directory: Path, world: int, steps: int, timeout: float, after: float | None = None) -> bool:
    """Wait until ``steps`` steps were stamped at world size ``world`` after time ``after``."""
    deadline = time.time() + timeout
    after = time.time() if after is None else after
    while time.time() < deadline:
        n = sum(1 for s in load_stamps(directory) if s.t > after and s.world == world)
        if n >= steps * world:
            return True
        time.sleep(0.2)
    return False


# ---------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_env(**extra: str) -> dict[str, str]:
    """Environment of every process a bench starts: one intra-op thread, loopback-only gloo."""
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT),
    })
    env.update(extra)
    return env


def torchrun_env() -> dict[str, str]:
    """torchrun's agents each with their own rendezvous store (no shared TCPStore surprises)."""
    return bench_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def one_epoch_args(samples: int, batch: int = 512) -> list[str]:
    """The example's arguments of a throughput run: one epoch, no progress lines."""
    return ["--samples", str(samples), "--epochs", "1", "--batch-size", str(batch), "--log-every", "0"]


def tidal_argv(workers: str, job_dir: Path, stamp_dir: Path, train_args: Sequence[str],
               run_opts: Sequence[str] = ()) -> list[str]:
    """``tidal run --workers W ... bench/common.py TRAIN_ARGS --stamp-dir DIR``."""
    return [TIDAL, "run", "--workers", workers, "--job-dir", str(job_dir), "-q", *run_opts,
            WORKER, *train_args, "--stamp-dir", str(stamp_dir)]


def torchrun_argv(nnodes: str, nproc: int, stamp_dir: Path, train_args: Sequence[str], *,
                  port: int | None = None, conf: str = "last_call_timeout=1",
                  agent_opts: Sequence[str] = (), script_opts: Sequence[str] = ()) -> list[str]:
    """One torchrun agent (c10d rendezvous on 127.0.0.1) running bench/ddp_ctr.py."""
    return [TORCHRUN, "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port or free_port()}", "--rdzv-id", "bench", "--rdzv-conf", conf,
            "--local-addr", "127.0.0.1", *agent_opts, DDP_WORKER, *train_args, "--stamp-dir", str(stamp_dir),
            *script_opts]


def run_to_end(argv: list[str], log: Path, env: dict[str, str], timeout: float = 300) -> None:
    """Run ``argv`` to completion (output to ``log``); raise if it fails or runs too long."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=True, cwd=ROOT)


def steady_tidal(work: Path, procs: int, train_args: Sequence[str], warmup: float = 3.0,
                 run_opts: Sequence[str] = ()) -> float:
    """Samples/s of one ``tidal run --workers P:P`` job run to its end (``steady_rate``)."""
    run_to_end(tidal_argv(f"{procs}:{procs}", work / "job", work / "stamps", train_args, run_opts),
               work / "tidal.log", bench_env(), timeout=400)
    return _checked_rate(work / "stamps", procs, warmup)


def steady_ddp(work: Path, procs: int, train_args: Sequence[str], warmup: float = 3.0) -> float:
    """Samples/s of one torchrun agent with ``--nproc-per-node P`` run to its end (``steady_rate``)."""
    run_to_end(torchrun_argv("1", procs, work / "stamps", train_args), work / "torchrun.log", torchrun_env(),
               timeout=400)
    return _checked_rate(work / "stamps", procs, warmup)


def _checked_rate(stamp_dir: Path, procs: int, warmup: float) -> float:
    rate, seen = steady_rate(stamp_dir, warmup)
    if seen != procs:
        raise RuntimeError(f"expected {procs} worker processes in {stamp_dir}, saw {seen}")
    return rate


def cleanup_on_sigterm() -> None:
    """SIGTERM unwinds the bench as Ctrl-C does, so its ``finally`` blocks stop what it started
    (redis-servers and jobs run in sessions of their own: a killed bench would leave them)."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own process group (so that it and its children can be stopped together)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=ROOT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGINT, grace: float = 10.0) -> None:
    """Signal the process group; SIGKILL it if it is still there after ``grace`` seconds."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def kill_pids(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def load_average() -> float:
    """The 1-minute load average (reported next to every measurement: the 2 cores may be shared)."""
    return os.getloadavg()[0]


# ---------------------------------------------------------------------------- report
def median(values: Sequence[float]) -> float:
    vals = [v for v in values if v == v]
    return statistics.median(vals) if vals else float("nan")


def runs(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    return " ".join(fmt.format(v) for v in values)


def table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the workers' arguments
def split_args(argv: list[str] | None = None, extra: Sequence[tuple[str, dict[str, Any]]] = ()
               ) -> tuple[argparse.Namespace, list[str]]:
    """(bench-only arguments, the rest) of a worker's command line.

    The rest is examples/ctr/train.py's to parse (``train.parse_args``): the example's own
    parser defines the training arguments of both workers (tidal and DDP), so they cannot drift
    apart. The bench adds ``--stamp-dir`` and the ``extra`` options."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--stamp-dir", default=None)
    for flag, kwargs in extra:
        p.add_argument(flag, **kwargs)
    return p.parse_known_args(sys.argv[1:] if argv is None else argv)


def _instrument(job: Any, stamps: StampWriter) -> None:
    """Stamp every step this process applies, with its own samples of that step.

    Wraps the job's public ``step_applied`` (the step runner calls it once per applied step,
    after ``optimizer.step()``, in both the plain and the logical-worker path), so there is one
    stamp per optimizer step, as bench/ddp_ctr.py writes one: with E logical workers in a
    process, one stamp carries their E batches (a stamp per EST would cost the logical run E
    writes per step to the peer's one).
    """
    applied = job.step_applied

    def stamped_applied(step: Any) -> None:
        applied(step)
        stamps.stamp(job.world_size, step.mine, step.step)

    job.step_applied = stamped_applied


def _worker_log_level() -> None:
    """``BENCH_WORKER_LOG_LEVEL=INFO`` in the environment: tidal's own log lines (``tidal.*``
    loggers only, not httpx's) go to the worker's stderr at that level (bench/recovery.py reads
    "resumed from the shm checkpoint of step N" from the worker logs). Unset: nothing changes."""
    import logging

    level = os.environ.get("BENCH_WORKER_LOG_LEVEL")
    if level:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger = logging.getLogger("tidal")
        logger.setLevel(level.upper())
        logger.addHandler(handler)


def tidal_worker(argv: list[str] | None = None) -> None:
    """examples/ctr/train.py's ``main``, with a stamp per applied step."""
    import tidal.worker
    from examples.ctr import train

    bench, rest = split_args(argv)
    stamps = StampWriter(bench.stamp_dir)
    _worker_log_level()
    real_init = tidal.worker.init

    def init(*args: Any, **kwargs: Any) -> Any:
        job = real_init(*args, **kwargs)
        _instrument(job, stamps)
        return job

    tidal.worker.init = init  # type: ignore[assignment]
    try:
        train.main(rest)
    finally:
        tidal.worker.init = real_init  # type: ignore[assignment]
        stamps.close()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    tidal_worker()
