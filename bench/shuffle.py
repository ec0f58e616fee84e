"""Global shuffling (Kale 3.5, issue 18): tail lag and queue spread with and without it.

    .venv/bin/python bench/shuffle.py [--workers 4] [--partitions 4] [--skew 2] [--rate 2400]
                                      [--seconds 30] [--shuffle 32:128] [--only with|without] [--json]

A redis-server on 127.0.0.1; records of the example (examples/ctr/stream.py) produced live at
``--rate`` records/s for ``--seconds`` s into ``--partitions`` partitions, partition p taking the
share ``(p + 1) ** -skew`` (skew 2 on 4 partitions: 70% on partition 0, Kale 2.3's uneven
partitions). The same job trains them twice, without and with ``--global-shuffle``: ``--workers``
workers fixed (``--planner fixed``), the example with EMULATED device time (``--step-sleep``: a
step costs at least that long whatever it trains), so that the worker owning partition 0 cannot
keep up with it alone while the workers together can: by default one worker trains at most
128 / 0.1 s = 1,280 records/s, partition 0 receives 70% of 2,400 = 1,680/s, and the four
workers can train 5,120/s. Each run ends ``--stop-when-drained 5`` s
after the stream is drained.

Reported per run:
- record lag: for every record, the time from its arrival (its Redis id) to the step that trained
  it (the stamps bench/common.py writes at each applied step; the ledger says which step trained
  which ids). p50, p99 and the largest, in seconds;
- reported lag: the job's lag as the master reports it (``tidal status``: the oldest record any
  worker said waits, as it measured just after a step's take), every 0.5 s while records are
  produced, from 4 s after the first (the start is not steady), averaged: what the live bench's
  accumulated lag integrates;
- queue spread: every 0.5 s the records waiting for each worker (``tidal status``: its
  partitions' backlog plus its local queue), max minus min over the workers, time-averaged;
- forwarded records, and the audit: `tidal audit --stream` against the stream (every record
  exactly once).

Target (issue 18): p99 lag with shuffling at most 0.5x without, and both audits PASSED.
"""

from __future__ import annotations

import argparse
import bisect
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import numpy as np

from bench.common import (
    ROOT,
    TIDAL,
    bench_env,
    cleanup_on_sigterm,
    load_stamps,
    start,
    stop,
    table,
    tidal_argv,
)
from examples.ctr.stream import ClickRecords
from tests.redis_server import RedisServer
from tidal.api.streams import pack_id, parse_id
from tidal.data.produce import partition_shares, produce
from tidal.data.streams import open_source

REPORTED_AFTER_S = 4.0  # the reported lag is averaged from then on: the first round's start is not steady


def run(work: Path, url: str, args: argparse.Namespace, shuffle: str | None) -> dict[str, Any]:
    """One job on a freshly produced stream: its lags, queue spread, forwarding and audit."""
    source = open_source(url)
    shares = partition_shares(args.partitions, args.skew)
    records = ClickRecords()
    seeds = set()  # one record per partition before the job starts: its first round reads them all
    for p in range(args.partitions):
        seeds.update(source.append(p, records.encode(p, 1)))
    producer = threading.Thread(target=produce, args=(source, np.array([args.rate]), args.seconds, shares,
                                                      records.encode), kwargs={"first_index": args.partitions},
                                daemon=True)
    run_opts = ["--planner", "fixed", "--history", "none", "--stream", url, "--stop-when-drained", "5",
                "--ledger", str(work / "ledger")] + (["--global-shuffle", shuffle] if shuffle else [])
    train = ["--batch-size", str(args.batch_size), "--step-sleep", str(args.step_sleep), "--log-every", "0"]
    argv = tidal_argv(f"{args.workers}:{args.workers}", work / "job", work / "stamps", train, run_opts)
    proc = start(argv, work / "tidal.log", bench_env())
    spreads: list[float] = []
    reported: list[float] = []  # the job's lag as the master reports it (sampled after the workers' takes)
    forwarded = 0
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the workers ready before the first record arrives
            st = _status(work / "job")
            if st and st.get("round", -1) >= 0 and not st.get("reforming"):
                break
            time.sleep(0.5)
        producer.start()
        produced_at = time.monotonic()
        while proc.poll() is None:
            st = _status(work / "job")
            if st:
                waiting = [w["stream_backlog"] for w in st["workers"] if w["state"] == "active"
                           and w.get("stream_backlog", -1) >= 0]
                if len(waiting) == args.workers and producer.is_alive():
                    spreads.append(max(waiting) - min(waiting))
                    if st.get("stream_lag") and time.monotonic() >= produced_at + REPORTED_AFTER_S:
                        reported.append(st["stream_lag"]["lag_s"])
                forwarded = max(forwarded, sum(w.get("stream_forwarded_out", 0) for w in st["workers"]))
            time.sleep(0.5)
            if time.monotonic() > deadline + args.seconds + 600:
                raise RuntimeError(f"the job in {work} did not end (see {work / 'tidal.log'})")
        if proc.returncode != 0:
            raise RuntimeError(f"the job in {work} exited {proc.returncode}: "
                               f"{(work / 'tidal.log').read_text(errors='replace')[-2000:]}")
    finally:
        stop(proc)
        if producer.ident is not None:  # started
            producer.join()
    audit = subprocess.run([TIDAL, "audit", str(work / "ledger"), "--stream", url], capture_output=True, text=True,
                           timeout=600)
    lags = _record_lags(source, work / "ledger", work / "stamps", seeds)
    source.close()
    return {
        "lag_p50_s": round(float(np.percentile(lags, 50)), 3), "lag_p99_s": round(float(np.percentile(lags, 99)), 3),
        "lag_max_s": round(float(lags.max()), 3), "records": int(lags.size),
        "queue_spread": round(statistics.fmean(spreads), 1) if spreads else float("nan"),
        "reported_lag_s": round(statistics.fmean(reported), 4) if reported else float("nan"),
        "forwarded": forwarded, "audit": audit.stdout.splitlines()[0] if audit.stdout else audit.stderr.strip(),
    }


def _status(job_dir: Path) -> dict[str, Any] | None:
    """The master's status document (None while it is not up)."""
    try:
        info = json.loads((job_dir / "job.json").read_text())
        resp = httpx.get(info["url"] + "/v1/status", headers={"Authorization": f"Bearer {info['token']}"}, timeout=5)
        return resp.json() if resp.status_code == 200 else None
    except (OSError, ValueError, KeyError, httpx.HTTPError):
        return None


def _record_lags(source: Any, ledger: Path, stamps_dir: Path, seeds: set[str]) -> np.ndarray:
    """Seconds from each record's arrival to the (first) stamp of the step that trained it (the
    ``seeds``, written before the job started, left out)."""
    trained_at: dict[int, float] = {}
    for s in load_stamps(stamps_dir):
        trained_at.setdefault(s.step, s.t)
    ranges: dict[int, list[tuple[int, int, int]]] = {}
    for line in ledger.read_text().splitlines():
        row = json.loads(line)
        if "partition" in row:
            for first, last in row["ids"]:
                ranges.setdefault(row["partition"], []).append((pack_id(first), pack_id(last), row["step"]))
    lags = []
    for p, rs in ranges.items():
        rs.sort()
        firsts = [r[0] for r in rs]
        for rec in source.range(p, "0-0", f"{2**62}-0"):
            packed = pack_id(rec.id)
            i = bisect.bisect_right(firsts, packed) - 1
            first, last, step = rs[i]
            assert first <= packed <= last and step in trained_at, (rec.id, rs[i])
            if rec.id not in seeds:
                lags.append(trained_at[step] - parse_id(rec.id)[0] / 1000.0)
    return np.array(lags)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--skew", type=float, default=2.0, help="partition p gets (p+1)**-skew (2: 70%% on the first of 4)")
    p.add_argument("--rate", type=float, default=2400.0, help="records per second, all partitions")
    p.add_argument("--seconds", type=float, default=30.0, help="how long records are produced")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--step-sleep", type=float, default=0.1, help="EMULATED device seconds per step")
    p.add_argument("--shuffle", default="32:128",
                   help="--global-shuffle LOWER:UPPER of the shuffled run (UPPER at a step's batch: what a "
                        "saturated worker keeps past one batch waits a step more)")
    p.add_argument("--only", choices=["with", "without"], default=None,
                   help="run the job only with (or without) global shuffling: no ratio")
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep", type=Path, default=None, help="keep logs, stamps and ledgers here")
    args = p.parse_args()
    cleanup_on_sigterm()
    work = args.keep or Path(tempfile.mkdtemp(prefix="tidal-shuffle-"))
    results = {}
    try:
        for name, shuffle in [("without", None), ("with", args.shuffle)]:
            if args.only not in (None, name):
                continue
            server = RedisServer(work / name / "redis")
            server.start()
            try:
                print(f"{name} shuffling: producing {args.rate:g} records/s for {args.seconds:g} s ...",
                      file=sys.stderr, flush=True)
                results[name] = run(work / name, server.url("clicks"), args, shuffle)
                print(f"  {results[name]}", file=sys.stderr, flush=True)
            finally:
                server.stop()
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    ratio = results["with"]["lag_p99_s"] / results["without"]["lag_p99_s"] if len(results) == 2 else None
    if args.json:
        print(json.dumps({**results, "p99_ratio": None if ratio is None else round(ratio, 3)}))
        return
    rows = [["run", "p50 lag s", "p99 lag s", "max lag s", "reported lag s (mean)", "queue spread (records)",
             "forwarded", "records", "audit"]]
    for name, r in results.items():
        rows.append([name, f"{r['lag_p50_s']:.3f}", f"{r['lag_p99_s']:.3f}", f"{r['lag_max_s']:.3f}",
                     f"{r['reported_lag_s']:.4f}", f"{r['queue_spread']:.0f}", str(r["forwarded"]), str(r["records"]),
                     r["audit"].split(":")[0]])
    print(table(rows))
    if ratio is not None:
        print(f"\np99 lag with / without shuffling: {ratio:.2f}x (target <= 0.5x: {'met' if ratio <= 0.5 else 'MISSED'})")
    print(f"workers {args.workers}, partitions {args.partitions}, skew {args.skew:g} "
          f"({partition_shares(args.partitions, args.skew)[0]:.0%} on partition 0), {args.rate:g} records/s for "
          f"{args.seconds:g} s, batch {args.batch_size}, EMULATED device time {args.step_sleep * 1e3:g} ms/step; "
          f"{ROOT}")


if __name__ == "__main__":
    main()
