"""Read path: samples/s one worker can read from Redis and train with, against the same worker
reading a dataset in memory: target at least 0.9x.

    .venv/bin/python bench/stream_read.py [--samples N] [--dataset-samples D] [--partitions 1] [--rounds 3] [--json]

One worker (``tidal run --workers 1:1 --planner fixed --history none``) trains the example
(examples/ctr/train.py through bench/common.py, which stamps every applied step; the same
``--batch-size`` and ``--model-size`` on both sides) on click samples:

* dataset: ``--samples D --epochs 1``, the in-memory ``ClickDataset`` (batches built by
  ``get_range``, generated from the index range: its rate does not depend on D). D defaults to
  2,000,000 (about 15 s here), more than N: the dataset side trains ~125,000 samples/s, so N
  samples would be over in a second, too short for a steady window;
* stream: N samples as records (``examples/ctr/stream.py`` ``ClickRecords``) produced
  beforehand into a real ``redis-server`` on a free port of 127.0.0.1 (``--partitions`` partitions,
  round-robin in blocks of 1,000; production is not timed), then ``tidal run --stream
  redis://127.0.0.1:PORT/NAME --stop-when-drained 1`` with the same training arguments. Every
  run gets a fresh stream (a new name on the same server), so every run reads all N records.
  ``--trim`` adds ``--trim-after-commit`` (the worker deletes committed records). The worker
  reads ahead in its reader process (tidal.worker.stream_reader, the default);
* stream-thread: the same, reading ahead in a thread of the training process instead
  (``TIDAL_STREAM_READER=thread``, what the loader did before the reader process).

Throughput is the steady samples/s from the stamps (bench/common.py ``steady_rate``: from
``--warmup`` s after the first stamped step to 0.5 s before the last one; the last stamp is the
last step that trained records, so the drained tail, where the worker only polls until the
master ends the job, is never counted). Runs alternate the three ``--rounds`` times (a slow
phase of the machine hits both); medians and the ratio stream/dataset are reported.

No accelerator time is emulated: pure CPU, the real model on the same 2 cores as the master and
the redis-server, so any CPU the read path costs is taken from training.

Below the main table, where a step's time goes, measured in this process (median of repeats):
one ``source.read(p, after, B)`` (XRANGE through tidal's RedisStreamSource), the same XRANGE
with a bare redis-py client that keeps hiredis' reply as it is (what ``read`` adds is building the
records), ``ClickRecords.decode`` of the B records, ``ClickDataset.get_range``
of B samples, one training step of the model on B samples (forward, backward, Adam), and
``source.lag`` half-way through an N-record partition, which the stream loader calls once a
round (in a thread) to count the backlog. Then both loops in this process, alternated in blocks of 20
steps (``interleaved``): steps on ``get_range`` batches against steps whose next batch a thread
reads and decodes meanwhile, as the thread reader does. On shared cores this ratio is steadier
than the jobs' (a slow phase of the machine hits both loops within seconds), though it leaves out
what both jobs share (the master, the step's reduction).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    bench_env,
    cleanup_on_sigterm,
    load_average,
    load_stamps,
    median,
    one_epoch_args,
    start,
    steady_rate,
    stop,
    table,
    tidal_argv,
)
from examples.ctr.data import ClickDataset
from examples.ctr.stream import ClickRecords
from tests.redis_server import RedisServer
from tidal.data.api import FIRST, StreamSource
from tidal.data.streams import open_source
from tidal.worker.stream_reader import READER_ENV

RUN_OPTS = ["--planner", "fixed", "--history", "none"]
KINDS = ("dataset", "stream", "stream-thread")
PRODUCE_BLOCK = 1000  # records per append, and per partition in turn


def produce(url: str, samples: int, partitions: int) -> list[int]:
    """Samples ``[0, samples)`` as records, blocks of 1,000 dealt to the partitions in turn;
    the count per partition."""
    source = open_source(url)
    records = ClickRecords()
    counts = [0] * partitions
    try:
        for i, at in enumerate(range(0, samples, PRODUCE_BLOCK)):
            n = min(PRODUCE_BLOCK, samples - at)
            source.append(i % partitions, records.encode(at, n))
            counts[i % partitions] += n
    finally:
        source.close()
    return counts


def run_job(work: Path, train: list[str], run_opts: list[str], timeout: float, env: dict[str, str]) -> float:
    """Run one ``tidal run --workers 1:1`` job to its end (its process group killed if it runs
    past ``timeout``); its wall time."""
    argv = tidal_argv("1:1", work / "job", work / "stamps", train, run_opts)
    t0 = time.monotonic()
    proc = start(argv, work / "tidal.log", {**bench_env(), **env})
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the job in {work} ran past {timeout:g} s (see {work / 'tidal.log'})") from None
    finally:
        stop(proc)  # the whole group: no worker outlives a failed or timed-out run
    if rc != 0:
        tail = (work / "tidal.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the job in {work} exited {rc}:\n{tail}")
    return time.monotonic() - t0


def measured(work: Path, warmup: float, expected: int) -> float:
    rate, procs = steady_rate(work / "stamps", warmup)
    stamps = load_stamps(work / "stamps")
    trained = sum(s.samples for s in stamps)
    if procs != 1 or trained != expected:
        raise RuntimeError(f"{work}: {procs} worker processes trained {trained} samples, expected 1 and {expected}")
    window = sum(1 for s in stamps if stamps[0].t + warmup < s.t <= stamps[-1].t - 0.5)
    if window < 10:
        raise RuntimeError(f"{work}: only {window} steps in the steady window; give the run more samples")
    return rate


def timed(fn: Callable[[], Any], repeat: int) -> float:
    """Median seconds of ``repeat`` calls of ``fn`` (after one call to warm it)."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def micro(server: RedisServer, samples: int, batch: int, model_size: str) -> dict[str, float]:
    """Seconds per batch of each piece of a step (see the module's docstring)."""
    import redis
    import torch

    from examples.ctr.model import DLRM
    from examples.ctr.train import MODEL_SIZES

    url = server.url("micro")
    produce(url, samples, 1)
    source = open_source(url)
    bare = redis.Redis(host="127.0.0.1", port=server.port, protocol=2, decode_responses=False)
    bare.set_response_callback("XRANGE", lambda reply, **options: reply)  # as RedisStreamSource does
    records = ClickRecords()
    try:
        ids = [r.id for r in source.read(0, "0-0", 2 * batch + 1)]
        after = ids[batch]  # a read from the middle of the stream, as the loader's
        middle = source.read(0, "0-0", samples // 2)[-1].id
        fields = [r.fields for r in source.read(0, after, batch)]
        data = records.dataset(samples)
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = DLRM(**MODEL_SIZES[model_size])  # type: ignore[arg-type]
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        b = data.get_range(batch, 2 * batch)

        def train_on(b: dict[str, torch.Tensor]) -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(b["dense"], b["sparse"]), b["label"]).backward()
            opt.step()

        def train_step() -> None:
            train_on(b)

        dataset_step, stream_step = interleaved(source, records, data, train_on, batch)
        return {
            "interleaved_dataset": dataset_step,
            "interleaved_stream": stream_step,
            "read": timed(lambda: source.read(0, after, batch), 50),
            "xrange_bare": timed(lambda: bare.xrange("micro:0", f"({after}", "+", count=batch), 50),
            "decode": timed(lambda: records.decode(fields), 50),
            "get_range": timed(lambda: data.get_range(batch, 2 * batch), 50),
            "train_step": timed(train_step, 50),
            "lag_half": timed(lambda: source.lag(0, middle), 3),
        }
    finally:
        bare.close()
        source.close()


def interleaved(source: StreamSource, records: ClickRecords, data: ClickDataset,
                train_on: Callable[[dict[str, Any]], None], batch: int, blocks: int = 15,
                steps: int = 20) -> tuple[float, float]:
    """Seconds per step (median over blocks) of two loops in this process, alternated in blocks of
    ``steps`` steps, so that a slow phase of shared cores hits both: the dataset's (``get_range``,
    then the step) and the stream's (the step, while a thread reads and decodes the next batch, as
    the stream loader does). No master, no reduction: the read path's cost alone, GIL included."""
    pool = ThreadPoolExecutor(max_workers=1)
    after = FIRST

    def fetch(after: str) -> tuple[str, dict[str, Any]]:
        got = source.read(0, after, batch)
        if len(got) < batch:  # the end of the stream: start over
            got = source.read(0, FIRST, batch)
        return got[-1].id, records.decode([r.fields for r in got])[0]

    per_step: dict[str, list[float]] = {"dataset": [], "stream": []}
    at = 0
    try:
        for _ in range(blocks):
            t = time.perf_counter()
            for _ in range(steps):
                train_on(data.get_range(at, at + batch))
                at = (at + batch) % (len(data) - batch)
            per_step["dataset"].append((time.perf_counter() - t) / steps)
            after, b = fetch(after)
            ahead = pool.submit(fetch, after)
            t = time.perf_counter()
            for _ in range(steps):
                train_on(b)
                after, b = ahead.result()
                ahead = pool.submit(fetch, after)
            per_step["stream"].append((time.perf_counter() - t) / steps)
            after = ahead.result()[0]
    finally:
        pool.shutdown()
    return statistics.median(per_step["dataset"]), statistics.median(per_step["stream"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=64_000,
                   help="records of each stream run (about 40 s a run here: the backlog count grows with N)")
    p.add_argument("--dataset-samples", type=int, default=2_000_000,
                   help="samples of the dataset side's one epoch (its rate does not depend on it)")
    p.add_argument("--partitions", type=int, default=1, help="partitions of the stream")
    p.add_argument("--trim", action="store_true",
                   help="stream runs with --trim-after-commit (records deleted once committed)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--model-size", choices=["small", "large"], default="small")
    p.add_argument("--rounds", type=int, default=3, help="runs of each kind, alternated")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds after the first stamped step left out")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument("--no-micro", action="store_true", help="skip the table of where a step's time goes")
    p.add_argument("--keep", type=Path, default=None, help="keep logs and stamps here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    cleanup_on_sigterm()
    if args.partitions < 1 or min(args.samples, args.dataset_samples) < 20 * args.batch_size:
        p.error("need --partitions >= 1, --samples and --dataset-samples >= 20 batches")
    size = ["--model-size", args.model_size]
    samples = {"dataset": args.dataset_samples, "stream": args.samples, "stream-thread": args.samples}
    base = args.keep or Path(tempfile.mkdtemp(prefix="stream-read-"))
    rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
    walls: dict[str, list[float]] = {kind: [] for kind in KINDS}
    loads: list[float] = []
    pieces: dict[str, float] = {}
    server = RedisServer(base / "redis")
    try:
        server.start()
        for i in range(args.rounds):
            for kind in KINDS:
                work = base / f"{kind}-{i}"
                opts = list(RUN_OPTS)
                if kind != "dataset":
                    url = server.url(f"clicks{i}")
                    produce(url, args.samples, args.partitions)
                    opts += ["--stream", url, "--stop-when-drained", "1", *(["--trim-after-commit"] if args.trim else [])]
                loads.append(load_average())
                train = [*one_epoch_args(samples[kind], args.batch_size), *size]
                reader = {"stream": "process", "stream-thread": "thread"}.get(kind)
                walls[kind].append(run_job(work, train, opts, args.timeout, {READER_ENV: reader} if reader else {}))
                rates[kind].append(measured(work, args.warmup, samples[kind]))
                print(f"{kind} {i}: {rates[kind][-1]:,.0f} samples/s, run {walls[kind][-1]:.1f} s "
                      f"(load {loads[-1]:.2f})", file=sys.stderr, flush=True)
                if kind != "dataset":  # free the server's memory for the next runs
                    server_flush(server, url, args.partitions)
        if not args.no_micro:
            pieces = micro(server, args.samples, args.batch_size, args.model_size)
    finally:
        server.stop()
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    dataset, stream, thread = median(rates["dataset"]), median(rates["stream"]), median(rates["stream-thread"])
    ratio = stream / dataset
    result = {"read_path": {"dataset_samples_per_s": dataset, "stream_samples_per_s": stream, "ratio": ratio,
                            "stream_thread_samples_per_s": thread, "thread_ratio": thread / dataset},
              "samples": samples, "partitions": args.partitions, "trim_after_commit": args.trim, "batch_size": args.batch_size,
              "model_size": args.model_size, "runs": rates, "run_seconds": walls, "load_average": loads,
              "per_batch_seconds": pieces}
    if args.json:
        print(json.dumps(result))
        return 0
    print(table([
        [f"1 worker, batch {args.batch_size}", "samples", "samples/s (median)", "runs", "run wall s"],
        ["dataset (in memory)", f"{args.dataset_samples:,}", f"{dataset:,.0f}",
         ", ".join(f"{r:,.0f}" for r in rates["dataset"]), ", ".join(f"{w:.1f}" for w in walls["dataset"])],
        [f"stream (redis, {args.partitions} partition{'s' if args.partitions > 1 else ''}"
         f"{', trim after commit' if args.trim else ''})", f"{args.samples:,}",
         f"{stream:,.0f}", ", ".join(f"{r:,.0f}" for r in rates["stream"]), ", ".join(f"{w:.1f}" for w in walls["stream"])],
        [f"  the same, read ahead in a thread ({READER_ENV}=thread)", f"{args.samples:,}", f"{thread:,.0f}",
         ", ".join(f"{r:,.0f}" for r in rates["stream-thread"]), ", ".join(f"{w:.1f}" for w in walls["stream-thread"])],
    ]))
    verdict = "met" if ratio >= 0.9 else "MISSED"
    print(f"ratio stream/dataset {ratio:.3f}x (target >= 0.9x: {verdict}; read ahead in a thread: "
          f"{thread / dataset:.3f}x); load average before each run: "
          + " ".join(f"{x:.2f}" for x in loads))
    if pieces:
        ms = {k: v * 1e3 for k, v in pieces.items()}
        print()
        print(table([
            [f"per batch of {args.batch_size} (in-process, median)", "ms"],
            ["dataset: ClickDataset.get_range", f"{ms['get_range']:.2f}"],
            ["stream: source.read (XRANGE via RedisStreamSource)", f"{ms['read']:.2f}"],
            ["  of which the bare XRANGE (hiredis' reply, no records built)", f"{ms['xrange_bare']:.2f}"],
            ["stream: ClickRecords.decode", f"{ms['decode']:.2f}"],
            [f"training step ({args.model_size} model: forward, backward, Adam)", f"{ms['train_step']:.2f}"],
            [f"stream: source.lag half-way through {args.samples:,} records (once a round)", f"{ms['lag_half']:.1f}"],
        ]))
        print(f"interleaved in this process (blocks of 20 steps, alternated): dataset {ms['interleaved_dataset']:.2f} "
              f"ms a step, stream (read and decode ahead on a thread) {ms['interleaved_stream']:.2f} ms: "
              f"{ms['interleaved_dataset'] / ms['interleaved_stream']:.2f}x")
        step_d = ms["get_range"] + ms["train_step"]
        step_s = ms["read"] + ms["decode"] + ms["train_step"]
        print(f"reading in the training thread, no backlog count: dataset {step_d:.2f} ms a step, stream "
              f"{step_s:.2f} ms (at most {step_d / step_s:.2f}x); the backlog count costs up to "
              f"{ms['lag_half'] / 1e3:.2f} s a call, once a round, in a thread")
    return 0


def server_flush(server: RedisServer, url: str, partitions: int) -> None:
    """Delete a run's stream keys (the next run produces its own)."""
    import redis

    name = url.rsplit("/", 1)[1]
    client = redis.Redis(host="127.0.0.1", port=server.port)
    try:
        client.delete(*[f"{name}:{p}" for p in range(partitions)])
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
