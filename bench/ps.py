"""Parameter servers (tidal.ps): samples/s and memory of the example with its embedding tables on
parameter servers, against the same model with replicated tables and tidal's all-reduce.

    .venv/bin/python bench/ps.py [--samples 200000] [--batch-size 512] [--rounds 2] [--json]   # about 1 minute

Both sides are ``tidal run`` jobs of examples/ctr/train.py (unchanged, no stamping wrapper),
2 workers fixed (``--workers 2 --planner fixed --history none``), one epoch of ``--samples``:

* tidal_ps: ``tidal run --ps 2 ... examples/ctr/train.py --ps --ps-hash-size 16777216``: 8
  tables (one per sparse field) of 2^24 ids x 16 float32 each on 2 parameter-server processes,
  rows created when first trained, Adam on the servers; the dense MLPs all-reduced between the
  workers;
* replicated: ``tidal run ... examples/ctr/train.py`` without ``--ps``: every worker holds the
  8 ``nn.Embedding`` tables and their Adam state, and all-reduces their (dense) gradient with the
  MLPs'. The example has no hash-size option for this path and is not changed for the bench, so
  the tables have the example's default 1,000 rows: at 2^24 rows they would not fit (8 x 2^24 x 16
  float32 = 8 GiB of weights, 24 GiB with Adam's two moments, 32 GiB with the dense gradient, in
  every worker: the bench prints the arithmetic next to the machine's RAM). The replicated
  figure is therefore the best case of replication (tiny tables), not a peer at equal size;
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
machine's cores. The elastic part (pause on a worker's loss, tidal vs a restart) is not measured
yet: the JSON carries ``"pause": {"tidal_s": null, "restart_s": null}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
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
SAMPLE_EVERY = 0.2  # seconds between RSS samples
STATUS_EVERY = 1.0  # seconds between status polls (the servers report their rows every second)
MIB = 1 << 20
PAUSE_NOTE = "elasticity (pause on a worker's loss, tidal vs a restart) is not measured yet"


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


def run_job(work: Path, ps: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One ``tidal run`` of the example to its end: its samples/s and peak RSS per role."""
    train = [SCRIPT, "--samples", str(args.samples), "--epochs", "1", "--batch-size", str(args.batch_size),
             "--log-every", "0"]
    opts = [*RUN_OPTS, "--workers", str(args.workers)]
    if ps:
        opts += ["--ps", str(args.servers)]
        train += ["--ps", "--ps-hash-size", str(args.ps_hash_size)]
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
    return {"samples_per_s": args.samples / train_s, "train_s": train_s, "steps": int(_summary_metric(text, "steps")),
            "auc": _summary_metric(text, "auc"), "wall_s": wall,
            "worker_mb": monitor.peak_mb("worker"), "server_mb": monitor.peak_mb("server"),
            "rows": monitor.rows if ps else FIELDS * REPLICATED_ROWS, "server_bytes": monitor.bytes,
            "cpu_s": {role: round(monitor.cpu(role), 2) for role in ("worker", "server", "master")}}


def torchrec_status() -> str | None:
    """None when torchrec imports; otherwise why it is not measured."""
    probe = subprocess.run([sys.executable, "-c", "import torchrec"], capture_output=True, text=True, timeout=120,
                           cwd=ROOT)
    if probe.returncode == 0:
        return None
    return "not installed (it does not install with torch 2.13 CPU here)"


# ---------------------------------------------------------------------------- main
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="See the module's docstring for what is measured and how.")
    p.add_argument("--samples", type=int, default=200_000, help="training samples of the one epoch")
    p.add_argument("--batch-size", type=int, default=512, help="samples per worker per step")
    p.add_argument("--rounds", type=int, default=2, help="runs of each side, alternated (medians reported)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=2, help="parameter servers of the tidal_ps side")
    p.add_argument("--ps-hash-size", type=int, default=PS_HASH_SIZE, help="ids per table on the servers")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one job may take")
    p.add_argument("--keep", type=Path, default=None, help="keep the job directories and logs here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.rounds < 1 or args.workers < 1 or args.servers < 1 or args.samples < 20 * args.batch_size * args.workers:
        p.error("need --rounds, --workers, --servers >= 1 and --samples >= 20 steps of every worker")
    cleanup_on_sigterm()
    torchrec_why = torchrec_status()
    base = args.keep or Path(tempfile.mkdtemp(prefix="tidal-ps-bench-"))
    results: dict[str, list[dict[str, Any]]] = {"tidal_ps": [], "replicated": []}
    loads: list[float] = []
    try:
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
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)

    def med(kind: str, key: str) -> float:
        return median([r[key] for r in results[kind] if r[key] is not None])

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
    result = {
        "throughput": {"tidal_ps": round(ps_rate, 1), "replicated": round(rep_rate, 1), "torchrec": None},
        "pause": {"tidal_s": None, "restart_s": None},
        "memory_mb": memory,
        "config": {"samples": args.samples, "batch_size": args.batch_size, "rounds": args.rounds,
                   "workers": args.workers, "servers": args.servers, "ps_hash_size": args.ps_hash_size,
                   "replicated_hash_size": REPLICATED_ROWS, "tables": FIELDS, "emb_dim": EMB_DIM,
                   "ps_rows_held": ps_rows, "machine": MACHINE, "load_average": [round(x, 2) for x in loads]},
        "runs": {k: [{kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in r.items()} for r in v]
                 for k, v in results.items()},
        "notes": {"pause": PAUSE_NOTE, "torchrec": torchrec_why,
                  "replicated": f"measured at the example's default {REPLICATED_ROWS}-row tables: at "
                                f"{args.ps_hash_size} rows it does not fit ({need_mb / 1024:.1f} GiB per worker "
                                f"with Adam, RAM {ram_mb / 1024:.1f} GiB)"},
        "emulated": False,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    cap = FIELDS * args.ps_hash_size
    rows = [["config", "samples/s", "ratio vs replicated", "worker peak RSS MB", "server peak RSS MB",
             "table rows held"],
            [f"tidal_ps ({args.servers} servers, {FIELDS} x 2^{args.ps_hash_size.bit_length() - 1} ids)",
             f"{ps_rate:,.0f}", f"{ps_rate / rep_rate:.2f}x", f"{memory['tidal_ps_worker_peak']:.0f}",
             f"{memory['tidal_ps_server_peak']:.0f}", f"{ps_rows:,} on the servers (of {cap:,})"],
            [f"replicated ({FIELDS} x {REPLICATED_ROWS} rows per worker)", f"{rep_rate:,.0f}", "1.00x",
             f"{memory['replicated_worker_peak']:.0f}", "-",
             f"{FIELDS * REPLICATED_ROWS:,} in each of {args.workers} workers"],
            ["torchrec", "-", "-", "-", "-", f"{torchrec_why}" if torchrec_why else "(importable, not measured yet)"]]
    print(table(rows))
    ps_runs = ", ".join(f"{r['samples_per_s']:,.0f}" for r in results["tidal_ps"])
    rep_runs = ", ".join(f"{r['samples_per_s']:,.0f}" for r in results["replicated"])
    print(f"\nruns (samples/s): tidal_ps {ps_runs}; replicated {rep_runs}; "
          f"load average before each run: {' '.join(f'{x:.2f}' for x in loads)}")
    for kind in ("tidal_ps", "replicated"):
        cpu = {role: median([r["cpu_s"][role] for r in results[kind]]) for role in ("worker", "server", "master")}
        print(f"CPU seconds of the whole job, {kind} (median): workers {cpu['worker']:.1f}, servers "
              f"{cpu['server']:.1f}, master {cpu['master']:.1f}; training {med(kind, 'train_s'):.1f} s of wall "
              f"time on {psutil.cpu_count()} cores")
    print(f"memory per worker: with --ps {memory['tidal_ps_worker_peak']:,.0f} MB measured (independent of the "
          f"table size: a worker holds only its batch's pulled rows); replicated at {args.ps_hash_size:,} rows "
          f"would need {need_mb:,.0f} MB per worker (weights {weights_mb:,.0f} MB + Adam's two moments; "
          f"{need_grad_mb:,.0f} MB with the dense gradient) against {ram_mb:,.0f} MB of RAM in the whole "
          f"machine: does not fit")
    if torchrec_why:
        print(f"torchrec: {torchrec_why}")
    print(f"pause: not measured ({PAUSE_NOTE})")
    print(f"{args.workers} workers, batch {args.batch_size}, {args.samples:,} samples, 1 epoch, {args.rounds} "
          f"rounds (medians), no emulated device time; {MACHINE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
