"""Parameter servers (tidal.ps): samples/s and memory of the example with its embedding tables on
parameter servers, against the same model with replicated tables and tidal's all-reduce; and the
training pause of changing the number of servers while training, against a stop-and-restart.

    .venv/bin/python bench/ps.py [--samples 200000] [--batch-size 512] [--rounds 2] [--json]   # about 3 minutes
    .venv/bin/python bench/ps.py --only throughput     # about 1 minute
    .venv/bin/python bench/ps.py --only pause          # about 1 minute a round
    .venv/bin/python bench/ps.py --only hot            # about 3 minutes

Throughput
----------

Both sides are ``tidal run`` jobs of examples/ctr/train.py (unchanged, no stamping wrapper),
2 workers fixed (``--workers 2 --planner fixed --history none``), one epoch of ``--samples``:

* tidal_ps: ``tidal run --ps 2 ... examples/ctr/train.py --ps --ps-hash-size 16777216``: 8
  tables (one per sparse field) of 2^24 ids x 16 float32 each on 2 parameter-server processes,
  rows created when first trained, Adam on the servers; the dense MLPs all-reduced between the
  workers;
* replicated: ``tidal run ... examples/ctr/train.py --table-rows N`` without ``--ps``: every
  worker holds the 8 ``nn.Embedding`` tables of N rows and their Adam state, and all-reduces
  their (dense) gradient with the MLPs'. The headline is at the example's default N = 1,000: the
  data's 10,000 raw categories per field then share rows ~10 to one (a smaller model than the
  servers', whose 2^24 ids keep every category apart). At 2^24 rows replication does not fit (8 x
  2^24 x 16 float32 = 8 GiB of weights, 24 GiB with Adam's two moments, 32 GiB with the dense
  gradient, in every worker: the bench prints the arithmetic next to the machine's RAM), so
  ``--replicated-rows`` also runs it at 2^14 (categories nearly apart), 2^17 and 2^20 rows, once
  each, on fewer samples past 2^14 (``sweep_samples``): where replication stops being cheaper;
* torchrec: not measured when ``import torchrec`` fails (it is not installed here: it does not
  install with torch 2.13 CPU); the bench installs nothing.

samples/s = ``--samples`` / the job's ``train_seconds`` (rank 0's time from its first batch
request to the end of its loop, as ``tidal run`` prints it in the job summary: ``tidal:
train_seconds = X``); it includes the first round's formation. Runs alternate the two sides
``--rounds`` times; medians are reported.

Memory: a thread samples every process under ``tidal run`` every 0.2 s with psutil (RSS, and
``VmHWM`` from /proc, which catches peaks between samples): workers are the processes whose
command line names the script, servers those running ``tidal.ps.server``. Reported: the largest
peak of any worker and of any server. Rows held: the servers' own count (``tidal status``, the
last report before the job ended) for tidal_ps; 8 x 1,000 per worker for replicated.

Pure CPU, no emulated device time: the master, 2 workers and (tidal_ps) 2 servers share the
machine's cores.

Pause (``--only pause``)
------------------------

Each of ``--rounds`` rounds runs one job ``tidal run --ps 1:4 --workers 2 --planner fixed
--history none examples/ctr/train.py --ps --ps-hash-size 16777216 --samples 1000000
--step-sleep 0.1``: EMULATED accelerator time, 0.1 s of sleep per step (CPU idle, as a worker
waiting on a GPU; ``--step-sleep``), so that a step costs ~0.15 s and the job would last well
over a minute on this machine (it is stopped once measured). While it trains the bench, over the
job's HTTP API (url and token from ``DIR/job.json``):

* waits for ``--between-steps`` (10) finalized steps and rows on the server (``tidal status``:
  every server of ``ps_shard_map`` reports ``rows`` > 0);
* for each change 1 -> 2, 2 -> 4, 4 -> 2, 2 -> 1: times 10 more finalized steps (the step time
  next to the pause), ``POST /v1/scale {"ps": N}``, waits until ``ps_shard_map`` covers N servers,
  then 10 more finalized steps with rows on every server;
* reads the pauses the workers reported (``GET /v1/timeline``, causes ``parameter servers A ->
  B``: the longest of the workers, from the end of the last step before the re-form to the end of
  the first step after it, so one ordinary step is inside it) and, from the job log, the master's
  ``moving K virtual shards: A -> B ...`` and ``moved R rows in S s ...`` lines.

The headline ``tidal_s`` is the pause of 1 -> 2 (median over the rounds); the table shows all
four changes with the rows moved, the move's own seconds and what the pause holds beyond the move
and one step. Starting the new servers (seconds) is not a pause: training goes on meanwhile.

The restart peer is what a user without live parameter-server scaling does: stop the job (its
tables go with it) and start it again on 2 servers. At the end of each round, with the job on 1
server holding rows, the bench sends SIGINT to ``tidal run``, waits until every process of the
job (master, workers, servers) has exited, starts ``tidal run --ps 2 ...`` of the same script and
arguments in a new job directory, and polls its status every 0.05 s until ``finalized_step >= 0``.
``restart_s`` is SIGINT -> that first finalized step (median over the rounds), shown split into
stop, start until the job's API answers, and API -> first step. It is a LOWER bound of a real
stop-checkpoint-restart: the job writes no checkpoint before it stops, and the new job starts
with empty tables, so neither saving nor reloading the tables is counted.

Hot PS (``--only hot``)
-----------------------

DLRover 4.2's adjust stage for a hot server (tidal.brain.hotps, run live by the master every 5 s).

* Skew: the example's categories follow a power law (examples/ctr/data.py), so a few ids take
  most lookups. The bench counts, over ``--hot-probe`` samples of the dataset, the share of
  lookups that fall on the top 1% of the ids seen (per table, then over all tables): the
  issue's "80% of lookups on 1% of ids".
* Skewed ids alone: ``tidal run --ps 2 --workers 2 ... --ps --step-sleep S`` (EMULATED device
  time); the bench polls ``tidal status`` for ``--hot-window`` seconds and reports each server's
  mean busy share and whether the planner moved anything. Rows hash to virtual shards, so the hot
  ids spread over both servers: the finding is that skewed ids make no hot server here.
* A hot server: the same job with server 0 EMULATED slow (``TIDAL_PS_EMULATE_SLOW=0:US``: US
  microseconds per row pulled, as on a shared or slower machine; a real hot spot cannot be made
  on 2 cores otherwise), once with the planner (default) and once with ``--no-ps-hot-balance``
  (the control). Step time = seconds per finalized step over polls of ``tidal status`` every
  0.1 s: after the adjust stage, from 2 s after the shard map changed to the end of the window;
  before it, the control's over its whole window (the planner decides within seconds, so the
  planner run's own steps before its move, shown beside it, are few).

Printed: the ratio ``tidal_s / restart_s`` beside the issue's target (at most 0.1x), the load
average before each round (the 2 cores may be shared with other work), and job-log lines that
look like trouble (up to the bench's own SIGINT). ``--json`` prints ``{"throughput": {...},
"pause": {"tidal_s", "restart_s", "ratio", "changes": [...], "restart_runs": [...], ...}, ...}``;
``"hot": {"top1pct_share", "skew_busy": {...}, "step_s_before", "step_s_after", "step_s_control", ...}``;
a part not run (``--only``) leaves its figures null. With ``--json`` the tables go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import psutil

from bench.common import (
    MACHINE,
    ROOT,
    TIDAL,
    bench_env,
    cleanup_on_sigterm,
    load_average,
    median,
    peak_rss_kb,
    start,
    stop,
    table,
)
from examples.ctr.train import MODEL_SIZES

SCRIPT = "examples/ctr/train.py"
RUN_OPTS = ["--planner", "fixed", "--history", "none"]
FIELDS = 8  # the example's sparse fields: one table each
EMB_DIM = int(MODEL_SIZES["small"]["emb_dim"])  # type: ignore[call-overload]
REPLICATED_ROWS = 1000  # DLRM's and ClickDataset's default hash_size: the example's non-ps tables
PS_HASH_SIZE = 2**24
CATEGORIES = 10_000  # ClickDataset's default cardinality: raw categories per sparse field
SAMPLE_EVERY = 0.2  # seconds between RSS samples
STATUS_EVERY = 1.0  # seconds between status polls (the servers report their rows every second)
MIB = 1 << 20


# ---------------------------------------------------------------------------- watching a job
class Monitor(threading.Thread):
    """Samples the RSS of every process under ``root_pid`` every ``SAMPLE_EVERY`` s, and the
    servers' rows from the job's status every ``STATUS_EVERY`` s, until ``halt``."""

    def __init__(self, root_pid: int, job_dir: Path) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(root_pid)
        self.job_dir = job_dir
        self.halt = threading.Event()
        self.peak_kb: dict[int, int] = {}  # pid -> largest RSS / VmHWM seen, kB
        self.cpu_s: dict[int, float] = {}  # pid -> CPU seconds (user + system) at its last sample
        self.role: dict[int, str] = {}  # pid -> worker, server or other
        self.procs: dict[int, psutil.Process] = {}  # every process seen (to kill what outlives the job)
        self.rows = 0  # rows on the servers, at their last report
        self.bytes = 0

    def run(self) -> None:
        next_status = 0.0
        while not self.halt.is_set():
            self._sample()
            if time.monotonic() >= next_status:
                next_status = time.monotonic() + STATUS_EVERY
                self._poll_status()
            self.halt.wait(SAMPLE_EVERY)
        self._sample()

    def _sample(self) -> None:
        with contextlib.suppress(psutil.Error):
            children = self.root.children(recursive=True)
            for p in [self.root, *children]:
                with contextlib.suppress(psutil.Error, OSError, ValueError):
                    if p.pid not in self.role:
                        self.role[p.pid] = "master" if p is self.root else _role(p.cmdline())
                        if p is not self.root:
                            self.procs[p.pid] = p
                    t = p.cpu_times()
                    self.cpu_s[p.pid] = t.user + t.system
                    kb = p.memory_info().rss // 1024
                    kb = max(kb, peak_rss_kb(p.pid))
                    self.peak_kb[p.pid] = max(self.peak_kb.get(p.pid, 0), kb)

    def _poll_status(self) -> None:
        try:
            info = json.loads((self.job_dir / "job.json").read_text())
            resp = httpx.get(info["url"] + "/v1/status", headers={"Authorization": f"Bearer {info['token']}"},
                             timeout=2)
            servers = resp.json().get("servers", []) if resp.status_code == 200 else []
        except (OSError, ValueError, KeyError, httpx.HTTPError):
            return
        if servers:
            self.rows = max(self.rows, sum(int(s.get("rows", 0)) for s in servers))
            self.bytes = max(self.bytes, sum(int(s.get("bytes", 0)) for s in servers))

    def peak_mb(self, role: str) -> float | None:
        """The largest peak RSS of any process of ``role``, MiB (None: none seen)."""
        kbs = [kb for pid, kb in self.peak_kb.items() if self.role.get(pid) == role]
        return max(kbs) / 1024 if kbs else None

    def cpu(self, role: str) -> float:
        """CPU seconds of every process of ``role`` together (up to its last sample)."""
        return sum(s for pid, s in self.cpu_s.items() if self.role.get(pid) == role)

    def count(self, role: str) -> int:
        return sum(1 for r in self.role.values() if r == role)

    def kill_leftovers(self) -> None:
        """SIGKILL every process seen under the job that is still there (workers and servers run
        in sessions of their own: stopping ``tidal run``'s process group does not reach them)."""
        for p in self.procs.values():
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil checks the pid still names the process it saw


def _role(cmdline: list[str]) -> str:
    if any("tidal.ps.server" in a for a in cmdline):
        return "server"
    if any(a.endswith(SCRIPT) for a in cmdline):
        return "worker"
    return "other"


def _summary_metric(log: str, name: str) -> float:
    found = re.findall(rf"^tidal:\s+{re.escape(name)} = ([0-9.eE+-]+)\s*$", log, re.MULTILINE)
    if not found:
        raise RuntimeError(f"no '{name}' in the job's summary")
    return float(found[-1])


def run_job(work: Path, ps: bool, args: argparse.Namespace, table_rows: int = REPLICATED_ROWS,
            samples: int | None = None) -> dict[str, Any]:
    """One ``tidal run`` of the example to its end: its samples/s and peak RSS per role.
    ``table_rows``: rows of each replicated table (without ``ps``); ``samples``: the epoch's
    (default ``--samples``)."""
    samples = samples or args.samples
    train = [SCRIPT, "--samples", str(samples), "--epochs", "1", "--batch-size", str(args.batch_size),
             "--log-every", "0"]
    opts = [*RUN_OPTS, "--workers", str(args.workers)]
    if ps:
        opts += ["--ps", str(args.servers)]
        train += ["--ps", "--ps-hash-size", str(args.ps_hash_size)]
    else:
        train += ["--table-rows", str(table_rows)]
    argv = [TIDAL, "run", "-q", "--job-dir", str(work / "job"), *opts, *train]
    log = work / "tidal.log"
    t0 = time.monotonic()
    proc = start(argv, log, bench_env())
    monitor = Monitor(proc.pid, work / "job")
    monitor.start()
    try:
        try:
            proc.wait(args.timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the job in {work} ran over {args.timeout:g} s (see {log})") from None
    finally:
        stop(proc)
        monitor.halt.set()
        monitor.join(10)
        monitor.kill_leftovers()
    wall = time.monotonic() - t0
    text = log.read_text(errors="replace")
    if proc.returncode != 0 or "succeeded" not in text:
        raise RuntimeError(f"the job in {work} exited {proc.returncode}: {text[-2000:]}")
    if monitor.count("worker") != args.workers or monitor.count("server") != (args.servers if ps else 0):
        raise RuntimeError(f"expected {args.workers} workers and {args.servers if ps else 0} servers under the job, "
                           f"saw {monitor.count('worker')} and {monitor.count('server')}")
    train_s = _summary_metric(text, "train_seconds")
    return {"samples_per_s": samples / train_s, "samples": samples, "train_s": train_s, "steps": int(_summary_metric(text, "steps")),
            "auc": _summary_metric(text, "auc"), "wall_s": wall,
            "worker_mb": monitor.peak_mb("worker"), "server_mb": monitor.peak_mb("server"),
            "rows": monitor.rows if ps else FIELDS * table_rows, "server_bytes": monitor.bytes,
            "cpu_s": {role: round(monitor.cpu(role), 2) for role in ("worker", "server", "master")}}


def sweep_samples(args: argparse.Namespace, rows: int) -> int:
    """The epoch of the replicated peer at ``rows`` rows a table: ``--samples`` up to 2^14 rows,
    fewer past it (a step's all-reduce and Adam grow with the tables: at 2^20 rows a step takes
    ~2 s here), at least 10 steps of every worker."""
    shrink = max(1, rows // 2**14)
    return max(10 * args.batch_size * args.workers, args.samples // shrink)


def torchrec_status() -> str | None:
    """None when torchrec imports; otherwise why it is not measured."""
    probe = subprocess.run([sys.executable, "-c", "import torchrec"], capture_output=True, text=True, timeout=120,
                           cwd=ROOT)
    if probe.returncode == 0:
        return None
    return "not installed (it does not install with torch 2.13 CPU here)"


# ---------------------------------------------------------------------------- the pause of a PS change
MOVING_RE = re.compile(r"moving (\d+) virtual shards: (\d+) -> (\d+) parameter servers, at step (-?\d+)")
MOVED_RE = re.compile(r"moved (\d+) rows in ([0-9.]+) s; parameter servers now \[([0-9, ]*)\]")
PS_CAUSE = "parameter servers"
CHANGES = ((1, 2), (2, 4), (4, 2), (2, 1))  # the pause run's changes, in order; the first is the headline
TARGET_RATIO = 0.1  # the target: tidal's pause at most 0.1x the stop-and-restart pause
POLL_S = 0.05  # seconds between status polls while timing a restart
WAIT_POLL_S = 0.25  # seconds between status polls while waiting for the job to get somewhere


class Reaper(threading.Thread):
    """Notes every process under ``root_pid`` every half second (workers and servers run in
    sessions of their own: stopping ``tidal run``'s process group does not reach them), so that
    ``wait_all`` can wait for each to exit and ``kill_leftovers`` can end what outlived the job."""

    def __init__(self, root_pid: int) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(root_pid)
        self.halt = threading.Event()
        self.procs: dict[int, psutil.Process] = {}
        self._lock = threading.Lock()

    def run(self) -> None:
        while not self.halt.is_set():
            self.snapshot()
            self.halt.wait(0.5)

    def snapshot(self) -> None:
        with contextlib.suppress(psutil.Error):
            found = self.root.children(recursive=True)
            with self._lock:
                for p in found:
                    self.procs.setdefault(p.pid, p)

    def wait_all(self, timeout: float) -> list[psutil.Process]:
        """Wait until the root and every process seen under it have exited; those still alive."""
        with self._lock:
            procs = [self.root, *self.procs.values()]
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        return alive

    def kill_leftovers(self) -> None:
        self.halt.set()
        with self._lock:
            procs = list(self.procs.values())
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil checks the pid still names the process it saw


class JobClient:
    """The job's HTTP API (url and token from ``DIR/job.json``, once ``tidal run`` wrote it)."""

    def __init__(self, job_dir: Path, proc: subprocess.Popen[bytes], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        info_path = job_dir / "job.json"
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError):
                info = json.loads(info_path.read_text())
                url, token = info["url"], info["token"]
                break
            if proc.poll() is not None:
                raise RuntimeError(f"tidal run exited {proc.returncode} before writing {info_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {info_path} after {timeout:g} s")
            time.sleep(POLL_S)
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=5)

    def status(self) -> dict[str, Any] | None:
        """The job's status; None while the master does not answer (starting, or gone)."""
        try:
            resp = self.http.get("/v1/status")
        except httpx.HTTPError:
            return None
        return resp.json() if resp.status_code == 200 else None

    def pauses(self) -> list[dict[str, Any]]:
        resp = self.http.get("/v1/timeline")
        resp.raise_for_status()
        return list(resp.json()["pauses"])

    def scale_ps(self, servers: int) -> None:
        resp = self.http.post("/v1/scale", json={"ps": servers})
        if resp.status_code != 200:
            raise RuntimeError(f"scale to {servers} parameter servers: HTTP {resp.status_code} {resp.text}")

    def close(self) -> None:
        self.http.close()


def wait_status(client: JobClient, proc: subprocess.Popen[bytes], what: str, timeout: float,
                ok: Callable[[dict[str, Any]], bool], every: float = WAIT_POLL_S,
                trace: list[tuple[float, int]] | None = None) -> dict[str, Any]:
    """Poll the job's status until ``ok(status)``; raise if the job ends or ``timeout`` passes.
    ``trace``: gets ``(time, finalized_step)`` of every poll that saw the step move."""
    deadline = time.monotonic() + timeout
    while True:
        st = client.status()
        if st is not None and trace is not None and (not trace or st["finalized_step"] != trace[-1][1]):
            trace.append((time.monotonic(), st["finalized_step"]))
        if st is not None and ok(st):
            return st
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended (tidal run exited {proc.returncode}) while waiting for {what}")
        if st is not None and st.get("state") not in (None, "running"):
            raise RuntimeError(f"the job is {st.get('state')} ({st.get('error')}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not after {timeout:g} s (last status: finalized step "
                               f"{st and st.get('finalized_step')}, map {st and sorted(set(st.get('ps_shard_map', [])))})")
        time.sleep(every)


def _in_map(st: dict[str, Any]) -> list[int]:
    return sorted(set(st.get("ps_shard_map") or []))


def _rows_held(st: dict[str, Any]) -> bool:
    """Every server of the shard map has reported rows."""
    rows = {int(s["id"]): int(s.get("rows", 0)) for s in st.get("servers", [])}
    return all(rows.get(i, 0) > 0 for i in _in_map(st))


def pause_argv(job_dir: Path, ps: str, args: argparse.Namespace) -> list[str]:
    """``tidal run --ps PS ... examples/ctr/train.py --ps ...`` of the pause run and of its restart."""
    train = [SCRIPT, "--ps", "--ps-hash-size", str(args.ps_hash_size), "--samples", str(args.pause_samples),
             "--epochs", "1", "--batch-size", str(args.batch_size), "--log-every", "0",
             "--step-sleep", str(args.step_sleep)]
    return [TIDAL, "run", "-q", "--job-dir", str(job_dir), *RUN_OPTS, "--workers", str(args.workers),
            "--ps", ps, *train]


def parse_moves(log: str) -> list[dict[str, Any]]:
    """The master's ``moving ...`` / ``moved ...`` lines, paired in order."""
    moving = MOVING_RE.findall(log)
    moved = MOVED_RE.findall(log)
    out = []
    for i, (shards, a, b, step) in enumerate(moving):
        rows, secs, now = moved[i] if i < len(moved) else (None, None, None)
        out.append({"from": int(a), "to": int(b), "shards": int(shards), "at_step": int(step),
                    "rows": None if rows is None else int(rows), "move_s": None if secs is None else float(secs),
                    "servers_now": None if now is None else [int(x) for x in now.split(",") if x.strip()]})
    return out


def log_problems(log: str) -> list[str]:
    """Lines of the job log that look like trouble (errors, tracebacks, failed moves); the bench
    passes the log up to its own SIGINT (after it the master kills the workers, as it should)."""
    bad = re.compile(r"error|traceback|failed|exception", re.IGNORECASE)
    return [line for line in log.splitlines() if bad.search(line)]


def step_time(samples: list[tuple[float, int]]) -> float | None:
    """Seconds per finalized step over ``(time, finalized_step)`` polls of one steady window."""
    if len(samples) < 2 or samples[-1][1] <= samples[0][1]:
        return None
    return (samples[-1][0] - samples[0][0]) / (samples[-1][1] - samples[0][1])


def pause_round(work: Path, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One pause run (1 -> 2 -> 4 -> 2 -> 1 servers while training) and, at its end, the restart
    peer (stop it, start ``--ps 2`` anew, time to its first finalized step)."""
    log = work / "tidal.log"
    proc = start(pause_argv(work / "job", f"1:{max(s for c in CHANGES for s in c)}", args), log, bench_env())
    reaper = Reaper(proc.pid)
    reaper.start()
    client: JobClient | None = None
    restart_proc: subprocess.Popen[bytes] | None = None
    restart_reaper: Reaper | None = None
    restart_client: JobClient | None = None
    t = args.pause_timeout
    try:
        client = JobClient(work / "job", proc, t)
        st = wait_status(client, proc, f"{args.between_steps} finalized steps and rows on the server", t,
                         lambda s: s["finalized_step"] >= args.between_steps and _rows_held(s))
        changes: list[dict[str, Any]] = []
        for a, b in CHANGES:
            if _in_map(st) != list(range(a)):
                raise RuntimeError(f"expected servers {list(range(a))} before {a} -> {b}, the map has {_in_map(st)}")
            # the step time just before the change: the job's pace to compare the pause with
            window: list[tuple[float, int]] = []
            s0 = st["finalized_step"]
            st = wait_status(client, proc, "a steady window", t,
                             lambda s, s0=s0: s["finalized_step"] >= s0 + args.between_steps, every=POLL_S, trace=window)
            client.scale_ps(b)
            asked = time.monotonic()
            st = wait_status(client, proc, f"the shard map on {b} servers", t, lambda s, b=b: len(_in_map(s)) == b)
            moved_after = time.monotonic() - asked
            at = st["finalized_step"]
            st = wait_status(client, proc, f"{args.between_steps} steps on {b} servers with rows", t,
                             lambda s, at=at: s["finalized_step"] >= at + args.between_steps and _rows_held(s))
            changes.append({"from": a, "to": b, "scale_to_map_s": round(moved_after, 3),
                            "step_s": step_time(window[1:])})
            print(f"  {a} -> {b} servers: map changed {moved_after:.1f} s after the request", file=sys.stderr,
                  flush=True)
        pauses = [p for p in client.pauses() if str(p.get("cause", "")).startswith(PS_CAUSE)]
        # ---- the restart peer: stop the job (its tables go with it), start it again on 2 servers
        reaper.snapshot()
        restart_dir = work / "restart"
        cut = log.stat().st_size  # the log up to the stop: what follows is the stop's own doing
        t0 = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        alive = reaper.wait_all(timeout=60)
        t_stopped = time.monotonic()
        if alive:
            raise RuntimeError(f"processes of the stopped job still alive 60 s after SIGINT: {[p.pid for p in alive]}")
        restart_proc = start(pause_argv(restart_dir / "job", "2", args), restart_dir / "tidal.log", bench_env())
        restart_reaper = Reaper(restart_proc.pid)
        restart_reaper.start()
        restart_client = JobClient(restart_dir / "job", restart_proc, t)
        t_api = time.monotonic()
        rst = wait_status(restart_client, restart_proc, "the restarted job's first finalized step", t,
                          lambda s: s["finalized_step"] >= 0, every=POLL_S)
        t_first = time.monotonic()
        restart_cut = (restart_dir / "tidal.log").stat().st_size
        restart = {"restart_s": t_first - t0, "stop_s": t_stopped - t0, "start_to_api_s": t_api - t_stopped,
                   "api_to_first_step_s": t_first - t_api, "first_finalized_step": rst["finalized_step"],
                   "servers": len(_in_map(rst))}
    finally:
        for c in (client, restart_client):
            if c is not None:
                c.close()
        for p, r in ((proc, reaper), (restart_proc, restart_reaper)):
            if p is not None:
                if r is not None:
                    r.snapshot()
                stop(p)
            if r is not None:
                r.kill_leftovers()
    raw = log.read_bytes()
    text = raw.decode(errors="replace")
    moves = parse_moves(text)
    for ch in changes:
        cause = f"{PS_CAUSE} {ch['from']} -> {ch['to']}"
        found = [p for p in pauses if p.get("cause") == cause]
        ch["pause_s"] = float(found[0]["seconds"]) if found else None
        mv = [m for m in moves if (m["from"], m["to"]) == (ch["from"], ch["to"])]
        ch.update({k: mv[0][k] for k in ("shards", "rows", "move_s", "at_step")} if mv else
                  {"shards": None, "rows": None, "move_s": None, "at_step": None})
    restart["problems"] = (log_problems(raw[:cut].decode(errors="replace"))
                           + log_problems((restart_dir / "tidal.log").read_bytes()[:restart_cut].decode(errors="replace")))
    for job_dir in (work / "job", restart_dir / "job"):  # the workers' and servers' own output
        for f in sorted((job_dir / "logs").glob("*.log")):
            restart["problems"] += [f"{f.name}: {line}" for line in log_problems(f.read_text(errors="replace"))]
    return changes, restart


# ---------------------------------------------------------------------------- main
def measure_throughput(args: argparse.Namespace, base: Path) -> tuple[dict[str, Any], list[str]]:
    """The throughput part: (its JSON entries, its printed lines)."""
    torchrec_why = torchrec_status()
    results: dict[str, list[dict[str, Any]]] = {"tidal_ps": [], "replicated": []}
    loads: list[float] = []
    for i in range(args.rounds):
        order = ("tidal_ps", "replicated") if i % 2 == 0 else ("replicated", "tidal_ps")
        for kind in order:
            loads.append(load_average())
            r = run_job(base / f"{kind}-{i}", kind == "tidal_ps", args)
            results[kind].append(r)
            print(f"{kind} {i}: {r['samples_per_s']:,.0f} samples/s ({r['train_s']:.2f} s of training, "
                  f"job {r['wall_s']:.1f} s), worker peak {r['worker_mb']:.0f} MB"
                  + (f", server peak {r['server_mb']:.0f} MB, {r['rows']:,} rows" if r["server_mb"] else "")
                  + f" (load {loads[-1]:.2f})", file=sys.stderr, flush=True)

    def med(kind: str, key: str) -> float:
        return median([r[key] for r in results[kind] if r[key] is not None])

    sweep = []  # the replicated peer at larger tables: where the servers overtake it
    for rows in args.replicated_rows:
        if rows == REPLICATED_ROWS:
            continue
        samples = sweep_samples(args, rows)
        loads.append(load_average())
        r = run_job(base / f"replicated-{rows}", False, args, table_rows=rows, samples=samples)
        sweep.append({"rows": rows, "samples": samples, "samples_per_s": round(r["samples_per_s"], 1),
                      "worker_mb": round(r["worker_mb"], 1), "load": round(loads[-1], 2)})
        print(f"replicated at {rows:,} rows: {r['samples_per_s']:,.0f} samples/s ({samples:,} samples), worker "
              f"peak {r['worker_mb']:.0f} MB (load {loads[-1]:.2f})", file=sys.stderr, flush=True)

    ps_rate, rep_rate = med("tidal_ps", "samples_per_s"), med("replicated", "samples_per_s")
    ram_mb = psutil.virtual_memory().total / MIB
    weights_mb = FIELDS * args.ps_hash_size * EMB_DIM * 4 / MIB  # the tables at the servers' size, float32
    need_mb = 3 * weights_mb  # weights + Adam's two moments, per worker
    need_grad_mb = 4 * weights_mb  # + the dense gradient nn.Embedding's backward makes
    memory = {
        "tidal_ps_worker_peak": round(med("tidal_ps", "worker_mb"), 1),
        "tidal_ps_server_peak": round(med("tidal_ps", "server_mb"), 1),
        "replicated_worker_peak": round(med("replicated", "worker_mb"), 1),
        "replicated_at_ps_hash_size_per_worker": round(need_mb, 1),
        "replicated_at_ps_hash_size_per_worker_with_grad": round(need_grad_mb, 1),
        "machine_ram": round(ram_mb, 1),
    }
    ps_rows = int(med("tidal_ps", "rows"))
    out = {
        "throughput": {"tidal_ps": round(ps_rate, 1), "replicated": round(rep_rate, 1), "torchrec": None,
                       "replicated_by_rows": [{"rows": REPLICATED_ROWS, "samples_per_s": round(rep_rate, 1)},
                                              *sweep]},
        "memory_mb": memory,
        "config": {"samples": args.samples, "servers": args.servers, "replicated_hash_size": REPLICATED_ROWS,
                   "tables": FIELDS, "emb_dim": EMB_DIM, "ps_rows_held": ps_rows,
                   "load_average": [round(x, 2) for x in loads]},
        "runs": {k: [{kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in r.items()} for r in v]
                 for k, v in results.items()},
        "notes": {"torchrec": torchrec_why,
                  "replicated": f"measured at the example's default {REPLICATED_ROWS}-row tables: at "
                                f"{args.ps_hash_size} rows it does not fit ({need_mb / 1024:.1f} GiB per worker "
                                f"with Adam, RAM {ram_mb / 1024:.1f} GiB)"},
    }
    cap = FIELDS * args.ps_hash_size
    rows = [["config", "samples/s", "tidal_ps vs this", "worker peak RSS MB", "server peak RSS MB",
             "table rows held"],
            [f"tidal_ps ({args.servers} servers, {FIELDS} x 2^{args.ps_hash_size.bit_length() - 1} ids)",
             f"{ps_rate:,.0f}", "-", f"{memory['tidal_ps_worker_peak']:.0f}",
             f"{memory['tidal_ps_server_peak']:.0f}", f"{ps_rows:,} on the servers (of {cap:,})"],
            [f"replicated ({FIELDS} x {REPLICATED_ROWS:,} rows per worker)", f"{rep_rate:,.0f}",
             f"{ps_rate / rep_rate:.2f}x",
             f"{memory['replicated_worker_peak']:.0f}", "-",
             f"{FIELDS * REPLICATED_ROWS:,} in each of {args.workers} workers"],
            *[[f"replicated ({FIELDS} x {w['rows']:,} rows per worker)", f"{w['samples_per_s']:,.0f}",
               f"{ps_rate / w['samples_per_s']:.2f}x", f"{w['worker_mb']:.0f}", "-",
               f"{FIELDS * w['rows']:,} in each of {args.workers} workers ({w['samples']:,} samples)"] for w in sweep],
            ["torchrec", "-", "-", "-", "-", f"{torchrec_why}" if torchrec_why else "(importable, not measured yet)"]]
    lines = [table(rows), ""]
    ps_runs = ", ".join(f"{r['samples_per_s']:,.0f}" for r in results["tidal_ps"])
    rep_runs = ", ".join(f"{r['samples_per_s']:,.0f}" for r in results["replicated"])
    lines.append(f"runs (samples/s): tidal_ps {ps_runs}; replicated {rep_runs}; "
                 f"load average before each run: {' '.join(f'{x:.2f}' for x in loads)}")
    for kind in ("tidal_ps", "replicated"):
        cpu = {role: median([r["cpu_s"][role] for r in results[kind]]) for role in ("worker", "server", "master")}
        lines.append(f"CPU seconds of the whole job, {kind} (median): workers {cpu['worker']:.1f}, servers "
                     f"{cpu['server']:.1f}, master {cpu['master']:.1f}; training {med(kind, 'train_s'):.1f} s of "
                     f"wall time on {psutil.cpu_count()} cores")
    lines.append(f"memory per worker: with --ps {memory['tidal_ps_worker_peak']:,.0f} MB measured (independent of "
                 f"the table size: a worker holds only its batch's pulled rows); replicated at {args.ps_hash_size:,} "
                 f"rows would need {need_mb:,.0f} MB per worker (weights {weights_mb:,.0f} MB + Adam's two moments; "
                 f"{need_grad_mb:,.0f} MB with the dense gradient) against {ram_mb:,.0f} MB of RAM in the whole "
                 f"machine: does not fit")
    if torchrec_why:
        lines.append(f"torchrec: {torchrec_why}")
    ahead = [w["rows"] for w in sweep if ps_rate > w["samples_per_s"]]
    lines.append(f"the example's data has {CATEGORIES:,} raw categories per field: replicated tables of "
                 f"{REPLICATED_ROWS:,} rows merge them ~10 to a row (a smaller model), the servers' 2^"
                 f"{args.ps_hash_size.bit_length() - 1} ids keep every one apart; tidal_ps is ahead of the "
                 + (f"replicated peer from {min(ahead):,} rows per table on" if ahead else "replicated peer at no size measured"))
    lines.append(f"throughput: {args.workers} workers, batch {args.batch_size}, {args.samples:,} samples, 1 epoch, "
                 f"{args.rounds} rounds (medians), no emulated device time")
    return out, lines


def _med(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return round(median(vals), 4) if vals else None


def _fmt(value: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def measure_pause(args: argparse.Namespace, base: Path) -> tuple[dict[str, Any], list[str]]:
    """The pause part: (its JSON entries, its printed lines)."""
    rounds: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []
    loads: list[float] = []
    for i in range(args.rounds):
        loads.append(load_average())
        print(f"pause round {i} (load {loads[-1]:.2f}):", file=sys.stderr, flush=True)
        changes, restart = pause_round(base / f"pause-{i}", args)
        rounds.append((changes, restart))
        done = ", ".join(f"{c['from']}->{c['to']} {_fmt(c['pause_s'])} s" for c in changes)
        print(f"  pauses {done}; "
              f"restart {restart['restart_s']:.2f} s (stop {restart['stop_s']:.2f} s)", file=sys.stderr, flush=True)
    changes_out = []
    for k, (a, b) in enumerate(CHANGES):
        per = [r[0][k] for r in rounds]
        pause, move = _med([c["pause_s"] for c in per]), _med([c["move_s"] for c in per])
        changes_out.append({
            "from": a, "to": b, "pause_s": pause, "pause_runs": [c["pause_s"] for c in per],
            "move_s": move, "move_runs": [c["move_s"] for c in per],
            "rows": _med([c["rows"] for c in per]), "rows_runs": [c["rows"] for c in per],
            "shards": per[0]["shards"], "at_step_runs": [c["at_step"] for c in per],
            "step_s": _med([c["step_s"] for c in per]),
            "scale_to_map_s": _med([c["scale_to_map_s"] for c in per]),
        })
    restarts = [r[1] for r in rounds]
    tidal_s = changes_out[0]["pause_s"]
    restart_s = _med([r["restart_s"] for r in restarts])
    ratio = tidal_s / restart_s if tidal_s is not None and restart_s else None
    emulated = f"EMULATED accelerator time: --step-sleep {args.step_sleep:g} s per step"
    lower = ("restart_s is a LOWER bound of a stop-checkpoint-restart: the job writes no checkpoint before "
             "stopping and the restarted job reloads no tables (its servers start empty), so neither is counted")
    out = {
        "pause": {
            "tidal_s": tidal_s, "restart_s": restart_s,
            "ratio": None if ratio is None else round(ratio, 4), "target_ratio": TARGET_RATIO,
            "met": None if ratio is None else ratio <= TARGET_RATIO,
            "restart_is_lower_bound": True, "emulated": emulated,
            "changes": changes_out,
            "restart_runs": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
                             for r in restarts],
            "config": {"samples": args.pause_samples, "step_sleep_s": args.step_sleep, "ps": "1:4",
                       "restart_ps": 2, "between_steps": args.between_steps},
            "load_average": [round(x, 2) for x in loads],
            "notes": {"restart": lower,
                      "pause": "the pause each change's re-form cost, as the workers report it (GET /v1/timeline, "
                               "the longest of the workers): from the end of the last step before the re-form to "
                               "the end of the first step after it, so it includes one ordinary step (step_s)"},
        },
    }
    rows = [["change", "pause s (median)", "pause runs", "move s", "rows moved", "shards",
             "pause - move - step s", "step s", "map changed after request s"]]
    for c in changes_out:
        extra = (c["pause_s"] - c["move_s"] - (c["step_s"] or 0.0)
                 if c["pause_s"] is not None and c["move_s"] is not None else None)
        rows.append([f"{c['from']} -> {c['to']} servers", _fmt(c["pause_s"]),
                     " ".join(_fmt(x) for x in c["pause_runs"]), _fmt(c["move_s"]),
                     _fmt(c["rows"], "{:,.0f}"), str(c["shards"]), _fmt(extra), _fmt(c["step_s"]),
                     _fmt(c["scale_to_map_s"], "{:.1f}")])
    lines = [table(rows), ""]
    rrows = [["peer: stop + start --ps 2", "seconds (median)", "runs"]]
    for key, what in (("restart_s", "SIGINT -> first finalized step (restart_s)"),
                      ("stop_s", "  SIGINT -> every process exited"),
                      ("start_to_api_s", "  tidal run -> job API answers"),
                      ("api_to_first_step_s", "  job API -> first finalized step")):
        rrows.append([what, _fmt(_med([r[key] for r in restarts])), " ".join(_fmt(r[key]) for r in restarts)])
    lines += [table(rrows), ""]
    verdict = "-" if ratio is None else ("met" if ratio <= TARGET_RATIO else "MISSED")
    lines.append(f"pause of 1 -> 2 servers: tidal {_fmt(tidal_s)} s vs stop-and-restart >= {_fmt(restart_s)} s: "
                 f"ratio {_fmt(ratio, '{:.3f}')}x (target <= {TARGET_RATIO}x: {verdict})")
    lines.append(f"pause: {emulated}; {args.workers} workers, batch {args.batch_size}, {args.rounds} rounds "
                 f"(medians); load average before each round: {' '.join(f'{x:.2f}' for x in loads)}")
    lines.append(f"NOTE: {lower}")
    problems = sorted({p for r in restarts for p in r["problems"]})
    if problems:
        lines.append("job log lines that look like trouble: " + " | ".join(problems[:10]))
    return out, lines


HOT_RE = re.compile(r"hot parameter server (\d+) \(busy ([0-9.]+), peers' median ([0-9.]+)\): moving virtual "
                    r"shards \[([0-9, ]*)\] away, busiest predicted ([0-9.]+)")


def top_share(args: argparse.Namespace) -> float:
    """The share of lookups on the top 1% of the ids seen, over ``--hot-probe`` samples."""
    import numpy as np

    from examples.ctr.data import ClickDataset

    sparse = ClickDataset(args.hot_probe, hash_size=args.ps_hash_size).get_range(0, args.hot_probe)["sparse"].numpy()
    top = total = 0
    for f in range(sparse.shape[1]):
        _, counts = np.unique(sparse[:, f], return_counts=True)
        counts = np.sort(counts)[::-1]
        top += int(counts[:max(1, len(counts) // 100)].sum())
        total += int(counts.sum())
    return top / total


def hot_run(work: Path, args: argparse.Namespace, slow_us: float | None, balance: bool) -> dict[str, Any]:
    """One job of ``--hot-window`` seconds: the servers' busy shares, the planner's decision, and
    the step time before and after it (see the module's docstring)."""
    train = [SCRIPT, "--ps", "--ps-hash-size", str(args.ps_hash_size), "--samples", str(args.pause_samples),
             "--epochs", "1", "--batch-size", str(args.batch_size), "--log-every", "0",
             "--step-sleep", str(args.step_sleep)]
    argv = [TIDAL, "run", "-q", "--job-dir", str(work / "job"), *RUN_OPTS, "--workers", str(args.workers),
            "--ps", "2", *([] if balance else ["--no-ps-hot-balance"]), *train]
    extra = {"TIDAL_PS_EMULATE_SLOW": f"0:{slow_us:g}"} if slow_us else {}
    log = work / "tidal.log"
    proc = start(argv, log, bench_env(**extra))
    reaper = Reaper(proc.pid)
    reaper.start()
    client: JobClient | None = None
    trace: list[tuple[float, int, int]] = []  # (time, finalized step, shards on server 0)
    busy: dict[int, list[float]] = {0: [], 1: []}
    try:
        client = JobClient(work / "job", proc, args.pause_timeout)
        wait_status(client, proc, "3 finalized steps", args.pause_timeout, lambda s: s["finalized_step"] >= 3)
        end = time.monotonic() + args.hot_window
        while time.monotonic() < end:
            st = client.status()
            if st is None or st.get("state") != "running":
                raise RuntimeError(f"the job is {st and st.get('state')} during the hot-PS window (see {log})")
            shards0 = sum(1 for v in st["ps_shard_map"] if v == 0)
            trace.append((time.monotonic(), st["finalized_step"], shards0))
            for v in st["servers"]:
                if v["id"] in busy and v["state"] == "running":
                    busy[v["id"]].append(float(v.get("busy", 0.0)))
            time.sleep(0.1)
    finally:
        if client is not None:
            client.close()
        reaper.snapshot()
        cut = log.stat().st_size if log.exists() else 0  # what follows is the bench's own stop
        stop(proc)
        reaper.kill_leftovers()
    text = log.read_bytes()[:cut].decode(errors="replace")
    plan = HOT_RE.search(text)
    changed = next((t for t, _, n in trace if n < 32), None)

    def pace(points: list[tuple[float, int, int]]) -> float | None:
        return step_time([(t, step) for t, step, _ in points])

    if changed is None:
        before, after = pace(trace), None
    else:
        before = pace([p for p in trace if p[0] < changed - 3.0])  # the re-form's wait is no step
        after = pace([p for p in trace if p[0] > changed + 2.0])
    return {"busy": {k: _med(v) for k, v in busy.items()},
            "plan": None if plan is None else {"hot": int(plan.group(1)), "busy": float(plan.group(2)),
                                               "peers_median": float(plan.group(3)),
                                               "moved": len([x for x in plan.group(4).split(",") if x.strip()]),
                                               "predicted_busiest": float(plan.group(5))},
            "shards_on_0": trace[-1][2] if trace else None, "step_s_before": before, "step_s_after": after,
            "problems": log_problems(text)}


def measure_hot(args: argparse.Namespace, base: Path) -> tuple[dict[str, Any], list[str]]:
    """The hot-PS part: (its JSON entries, its printed lines)."""
    share = top_share(args)
    print(f"hot: {share:.0%} of lookups on the top 1% of ids", file=sys.stderr, flush=True)
    skew = hot_run(base / "hot-skew", args, None, True)
    print(f"hot: skewed ids alone: busy {skew['busy']}, plan {skew['plan']}", file=sys.stderr, flush=True)
    hot = hot_run(base / "hot-slow", args, args.hot_slow_us, True)
    print(f"hot: slow server 0: {hot['step_s_before']} -> {hot['step_s_after']} s/step, plan {hot['plan']}",
          file=sys.stderr, flush=True)
    control = hot_run(base / "hot-control", args, args.hot_slow_us, False)
    emulated = (f"EMULATED: --step-sleep {args.step_sleep:g} s per step; server 0 slowed by "
                f"{args.hot_slow_us:g} us per row pulled (TIDAL_PS_EMULATE_SLOW)")
    # before the adjust stage: the control (the same job, the planner off) all along; the planner
    # run's own steps before its move are few (it decides within seconds), shown beside it
    before, after, ctrl = control["step_s_before"], hot["step_s_after"], control["step_s_before"]
    out = {"hot": {"top1pct_share": round(share, 4), "skew_busy": skew["busy"], "skew_plan": skew["plan"],
                   "step_s_before": before, "step_s_after": after, "step_s_control": ctrl,
                   "step_s_before_in_run": hot["step_s_before"], "step_s_balanced": skew["step_s_before"],
                   "speedup": None if not before or not after else round(before / after, 3),
                   "plan": hot["plan"], "shards_on_slow_server": hot["shards_on_0"], "emulated": emulated,
                   "problems": sorted(set(skew["problems"] + hot["problems"] + control["problems"]))[:10]}}
    rows = [["hot PS", "server 0 busy", "server 1 busy", "planner", "s/step before", "s/step after"],
            [f"skewed ids ({share:.0%} of lookups on 1% of ids)", _fmt(skew["busy"][0]), _fmt(skew["busy"][1]),
             "no move" if skew["plan"] is None else f"moved {skew['plan']['moved']} shards",
             _fmt(skew["step_s_before"]), _fmt(skew["step_s_after"])],
            [f"server 0 slow ({args.hot_slow_us:g} us/row), planner on", _fmt(hot["busy"][0]), _fmt(hot["busy"][1]),
             "no move" if hot["plan"] is None else f"moved {hot['plan']['moved']} of 32 shards off 0",
             _fmt(hot["step_s_before"]), _fmt(after)],
            [f"server 0 slow ({args.hot_slow_us:g} us/row), --no-ps-hot-balance", _fmt(control["busy"][0]),
             _fmt(control["busy"][1]), "off", _fmt(ctrl), "-"]]
    lines = [table(rows), ""]
    if before and after:
        lines.append(f"hot PS: step time after the adjust stage {after:.3f} s vs before it (the same job with "
                     f"--no-ps-hot-balance) {before:.3f} s: {before / after:.2f}x faster; with no slow server "
                     f"{_fmt(skew['step_s_before'])} s")
    lines.append(f"hot PS: {emulated}; {args.workers} workers, 2 servers, batch {args.batch_size}, window "
                 f"{args.hot_window:g} s")
    return out, lines


def _rows_list(text: str) -> list[int]:
    try:
        rows = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated row counts, got {text!r}") from None
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"expected row counts >= 1, got {text!r}")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="See the module's docstring for what is measured and how.")
    p.add_argument("--only", choices=("throughput", "pause", "hot"), default=None,
                   help="run only this part (default: all)")
    p.add_argument("--hot-window", type=float, default=40.0, help="hot: seconds each hot-PS job is watched")
    p.add_argument("--hot-slow-us", type=float, default=600.0,
                   help="hot: EMULATED microseconds per row pulled added on server 0")
    p.add_argument("--hot-probe", type=int, default=200_000, help="hot: samples counted for the id skew")
    p.add_argument("--samples", type=int, default=200_000, help="throughput: training samples of the one epoch")
    p.add_argument("--batch-size", type=int, default=512, help="samples per worker per step")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each throughput side (alternated), and pause rounds (medians reported)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=2, help="parameter servers of the tidal_ps throughput side")
    p.add_argument("--ps-hash-size", type=int, default=PS_HASH_SIZE, help="ids per table on the servers")
    p.add_argument("--replicated-rows", type=_rows_list, default=[REPLICATED_ROWS, 2**14, 2**17, 2**20],
                   metavar="N,N,...", help="throughput: rows per table of the replicated peer, one run each past "
                                           f"the first (default {REPLICATED_ROWS},16384,131072,1048576); the "
                                           f"ratio headline is at {REPLICATED_ROWS}")
    p.add_argument("--pause-samples", type=int, default=1_000_000,
                   help="pause: the job's samples (it is stopped once its changes are measured)")
    p.add_argument("--step-sleep", type=float, default=0.1,
                   help="pause: EMULATED accelerator seconds per step (the example's --step-sleep)")
    p.add_argument("--between-steps", type=int, default=10,
                   help="pause: finalized steps to wait for before and after each change")
    p.add_argument("--pause-timeout", type=float, default=120.0, help="pause: seconds any one wait may take")
    p.add_argument("--timeout", type=float, default=300.0, help="throughput: seconds one job may take")
    p.add_argument("--keep", type=Path, default=None, help="keep the job directories and logs here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.rounds < 1 or args.workers < 1 or args.servers < 1 or args.samples < 20 * args.batch_size * args.workers:
        p.error("need --rounds, --workers, --servers >= 1 and --samples >= 20 steps of every worker")
    if args.between_steps < 2 or args.pause_samples < 20 * args.between_steps * args.batch_size * args.workers:
        p.error("need --between-steps >= 2 and --pause-samples >= 20 x --between-steps steps of every worker")
    cleanup_on_sigterm()
    base = args.keep or Path(tempfile.mkdtemp(prefix="tidal-ps-bench-"))
    result: dict[str, Any] = {
        "throughput": {"tidal_ps": None, "replicated": None, "torchrec": None},
        "pause": {"tidal_s": None, "restart_s": None, "changes": []},
        "hot": {"step_s_before": None, "step_s_after": None},
    }
    lines: list[str] = []
    try:
        if args.only in (None, "throughput"):
            part, text = measure_throughput(args, base)
            config = part.pop("config")
            result.update(part)
            lines += text
        else:
            config = {}
        if args.only in (None, "pause"):
            part, text = measure_pause(args, base)
            result.update(part)
            lines += ([""] if lines else []) + text
        if args.only in (None, "hot"):
            part, text = measure_hot(args, base)
            result.update(part)
            lines += ([""] if lines else []) + text
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    result["config"] = {"only": args.only or "both", "batch_size": args.batch_size, "rounds": args.rounds,
                        "workers": args.workers, "ps_hash_size": args.ps_hash_size, **config, "machine": MACHINE,
                        "load_average_end": [round(x, 2) for x in os.getloadavg()]}
    result["emulated"] = {"throughput": False if args.only in (None, "throughput") else None,
                          "pause": result["pause"].get("emulated"), "hot": result["hot"].get("emulated")}
    lines.append(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {MACHINE}")
    if args.json:  # the tables to stderr, the JSON alone on stdout
        print("\n".join(lines), file=sys.stderr)
        print(json.dumps(result))
        return 0
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
