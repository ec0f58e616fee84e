"""Data workers (tidal.data): samples/s against PyTorch's DataLoader, fused transfer, the pause
when a data worker is SIGKILLed, and the job-level tuner.

    .venv/bin/python bench/data_workers.py [--samples 400000] [--counts 0,1,2,4] [--json]   # about 8 minutes
    .venv/bin/python bench/data_workers.py --only sweep|fused|pause|tuner

The job is examples/ctr/train.py with ``--raw-features`` (examples/ctr/features.py): every batch
of 512 raw samples needs string hashing (8 fields), 28 crossed fields hashed the same way and
bucketizing before the DLRM sees it: about 24 ms of one CPU per batch against about 8 ms for the
model's step, so pre-processing, not the model, limits a trainer with one CPU. No emulated
device time anywhere.

Sweep (``--only sweep``)
------------------------

Pinning on this 2-core machine: the training process runs on CPU 0 and every data-side process
on CPU 1 (``os.sched_setaffinity`` at its start), so "equal CPUs" holds by construction: one CPU
trains, one CPU pre-processes, whatever the number of processes that share it.

* tidal K: ``tidal run --workers 1 --data-workers K`` of this file in its worker mode, which pins
  itself by its role (``TIDAL_ROLE=data`` -> CPU 1, the trainer -> CPU 0) and runs the example's
  ``main`` with a stamp per step (bench/common.py). K = 0: the trainer pre-processes its batches
  itself (the dispatcher finds no data worker).
* dataloader K: the same model, optimizer, loss and batches in a plain PyTorch loop, fed by
  ``torch.utils.data.DataLoader(num_workers=K)`` whose dataset item is one whole batch (the
  range's raw samples through the same ``FeatureTransform``), ``batch_size=None``, shuffled
  batch order, default prefetch (2 per worker); its workers pin themselves to CPU 1
  (``worker_init_fn``), the main process to CPU 0. K = 0: the main process pre-processes.

samples/s: stamps after ``--warmup`` seconds (data workers register within about 3 s of the
start; the trainer builds its own batches until they do) to the end, as bench/common.py's
``steady_rate``.

Fused transfer (``--only fused``)
---------------------------------

One sender process (a ROUTER on 127.0.0.1) answers requests for a batch of the example's
shape split into one tensor per column (8 hashed fields, 28 crosses, 4 buckets, dense, label: 42
tensors, as TensorFlow's feature columns give, which GoldMiner 5.4 measures): fused, all tensors
in one multipart message (tidal's wire); per tensor, one message each. Batches per second
received with 4 requests in flight, the batch pre-built (transfer only); the ratio is fused
over per tensor.

Pause (``--only pause``)
------------------------

``tidal run --workers 1 --data-workers 2`` (unpinned), one data worker SIGKILLed ``--kill-after``
seconds into training: the trainer's largest gap between two steps within 5 s after the kill,
against its median step before it; the ledger is audited (every sample of every epoch exactly
once) and the batches re-dispatched are read from ``/v1/status``.

Tuner (``--only tuner``)
------------------------

``tidal run --workers 1 --data-workers 0:4``, pinned as the sweep: from the first step, the time
until GoldMiner's job-level tuner settles (the status's ``data_decisions``), the count it settles
on, and samples/s from 3 s after that to the end; against the best fixed count of the sweep (run
first when ``--only tuner`` is given alone, from ``--sweep-json`` otherwise).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    MACHINE,
    PYTHON,
    TIDAL,
    StampWriter,
    bench_env,
    load_stamps,
    run_to_end,
    start,
    steady_rate,
    stop,
    table,
)

THIS = str(Path(__file__).resolve())
TRAINER_CPU, DATA_CPU = 0, 1
EXAMPLE_ARGS = ["--raw-features", "--crosses", "28", "--batch-size", "512", "--epochs", "1", "--log-every", "0"]


# ---------------------------------------------------------------------------- worker modes
def pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > cpu:
        os.sched_setaffinity(0, {cpu})


def pinned_worker(argv: list[str]) -> None:
    """The example (stamped) in a process pinned by its role: data workers to DATA_CPU."""
    from bench.common import tidal_worker

    pin(DATA_CPU if os.environ.get("TIDAL_ROLE") == "data" else TRAINER_CPU)
    tidal_worker(argv)


def dataloader_peer(workers: int, samples: int, batch: int, stamp_dir: str, seed: int = 0) -> None:
    """The example's model and batches in a plain loop fed by torch's DataLoader."""
    import torch
    from torch.utils.data import DataLoader

    from examples.ctr.data import ClickDataset
    from examples.ctr.features import FeatureTransform, RawClicks
    from examples.ctr.model import DLRM
    from examples.ctr.train import MODEL_SIZES

    pin(TRAINER_CPU)
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    transform = FeatureTransform(hash_size=1000, crosses=28)
    raw = RawClicks(ClickDataset(samples, seed=seed, hash_size=1000))

    class Batches(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return -(-samples // batch)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return transform(raw.get_range(i * batch, min((i + 1) * batch, samples)))

    def init_worker(_: int) -> None:
        pin(DATA_CPU)
        torch.set_num_threads(1)

    loader = DataLoader(Batches(), batch_size=None, shuffle=True, num_workers=workers,
                        worker_init_fn=init_worker if workers else None,
                        generator=torch.Generator().manual_seed(seed))
    model = DLRM(**MODEL_SIZES["small"], hash_size=1000, num_sparse=transform.fields, crosses=True)  # type: ignore[arg-type]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    stamps = StampWriter(stamp_dir)
    for step, b in enumerate(loader):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(b["dense"], b["sparse"], b["crosses"]), b["label"]).backward()
        optimizer.step()
        stamps.stamp(1, len(b["label"]), step)
    stamps.close()


# ---------------------------------------------------------------------------- sweep
def tidal_run(work: Path, data_workers: str, samples: int, *, pinned: bool = True,
              extra: list[str] | None = None) -> tuple[list[str], Path]:
    script = [THIS, "--pinned-worker"] if pinned else [str(ROOT / "bench" / "common.py")]
    argv = [TIDAL, "run", "--workers", "1", "--planner", "fixed", "--history", "none", "--job-dir", str(work / "job"),
            "--ledger", str(work / "ledger"), "-q", "--data-workers", data_workers, *(extra or []),
            *script, *EXAMPLE_ARGS, "--samples", str(samples), "--stamp-dir", str(work / "stamps")]
    return argv, work / "stamps"


def sweep(tmp: Path, counts: list[int], samples: int, warmup: float) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {"tidal": {}, "dataloader": {}}
    for k in counts:
        work = tmp / f"tidal-{k}"
        argv, stamps = tidal_run(work, str(k), samples)
        run_to_end(argv, work / "tidal.log", bench_env(), timeout=600)
        out["tidal"][str(k)] = round(steady_rate(stamps, warmup)[0], 1)
        work = tmp / f"dataloader-{k}"
        run_to_end([PYTHON, THIS, "--dataloader-peer", str(k), "--samples", str(samples),
                    "--stamp-dir", str(work / "stamps")], work / "peer.log", bench_env(), timeout=600)
        out["dataloader"][str(k)] = round(steady_rate(work / "stamps", warmup)[0], 1)
        print(f"  {k} data workers: tidal {out['tidal'][str(k)]:,.0f} samples/s, "
              f"DataLoader {out['dataloader'][str(k)]:,.0f}", flush=True)
    return out


# ---------------------------------------------------------------------------- fused transfer
def columns_batch(batch: int = 512) -> dict[str, Any]:
    """A batch of the example's content, one tensor per column (42 tensors)."""
    from examples.ctr.data import ClickDataset
    from examples.ctr.features import FeatureTransform, RawClicks

    b = FeatureTransform(crosses=28)(RawClicks(ClickDataset(batch)).get_range(0, batch))
    cols = {f"sparse{i}": b["sparse"][:, i].contiguous() for i in range(b["sparse"].shape[1])}
    cols.update({f"cross{i}": b["crosses"][:, i].contiguous() for i in range(b["crosses"].shape[1])})
    cols.update({"dense": b["dense"], "label": b["label"]})
    return cols


def fused_sender(port_file: str, fused: bool) -> None:
    import zmq

    from tidal.api import frames

    cols = columns_batch()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    Path(port_file).write_text(str(port))
    while True:
        ident, head = sock.recv_multipart()
        if head == b"stop":
            break
        step = int(head)
        if fused:
            sock.send_multipart([ident, *frames.encode(cols, step=step)], copy=False)
        else:
            for key, t in cols.items():
                sock.send_multipart([ident, *frames.encode({key: t}, step=step, meta={"of": len(cols)})], copy=False)
    sock.close(0)
    ctx.term()


def fused_ratio(tmp: Path, batches: int = 3000, window: int = 4) -> dict[str, float]:
    import subprocess

    import zmq

    from tidal.api import frames

    out = {}
    for mode in ("fused", "per_tensor"):
        port_file = tmp / f"{mode}.port"
        proc = subprocess.Popen([PYTHON, THIS, "--fused-sender", str(port_file), "--mode", mode], env=bench_env())
        while not port_file.exists():
            time.sleep(0.05)
        time.sleep(0.1)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port_file.read_text()}")
        sent = done = 0
        parts: dict[int, int] = {}
        t0 = time.perf_counter()
        while done < batches:
            while sent < batches and sent - done < window:
                sock.send(str(sent).encode())
                sent += 1
            msg = frames.decode(sock.recv_multipart(copy=False))
            assert msg.step is not None
            if mode == "fused":
                done += 1
            else:
                parts[msg.step] = parts.get(msg.step, 0) + 1
                if parts[msg.step] == (msg.meta or {})["of"]:
                    done += 1
                    del parts[msg.step]
        out[mode] = round(batches / (time.perf_counter() - t0), 1)
        sock.send(b"stop")
        proc.wait(10)
        sock.close(0)
        ctx.term()
        print(f"  {mode}: {out[mode]:,.0f} batches/s", flush=True)
    out["ratio"] = round(out["fused"] / out["per_tensor"], 2)
    return out


# ---------------------------------------------------------------------------- pause
def status_of(job_dir: Path) -> dict[str, Any] | None:
    import httpx

    try:
        info = json.loads((job_dir / "job.json").read_text())
        return httpx.get(info["url"] + "/v1/status", headers={"Authorization": f"Bearer {info['token']}"},
                         timeout=5).json()  # type: ignore[no-any-return]
    except (OSError, ValueError, httpx.HTTPError):
        return None


def watch(job_dir: Path, box: dict[str, Any], stopped: threading.Event) -> None:
    """Keep the newest status (the job's master ends with the job)."""
    while not stopped.is_set():
        st = status_of(job_dir)
        if st is not None:
            box["st"] = st
            if "settled" not in box and any("settled" in d or "falling back" in d for d in st.get("data_decisions", [])):
                box["settled"] = time.time()
        time.sleep(0.25)


def pause(tmp: Path, samples: int, kill_after: float) -> dict[str, Any]:
    from tidal.master.audit import audit_ledger

    work = tmp / "pause"
    argv, stamps = tidal_run(work, "2", samples, pinned=False)
    proc = start(argv, work / "tidal.log", bench_env())
    box: dict[str, Any] = {}
    stopped = threading.Event()
    threading.Thread(target=watch, args=(work / "job", box, stopped), daemon=True).start()
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            st = box.get("st")
            first = load_stamps(stamps)[:1] if stamps.exists() else []
            if st and first and time.time() - first[0].t >= kill_after and \
                    sum(d["state"] == "running" for d in st["data_workers"]) == 2:
                break
            time.sleep(0.2)
        else:
            raise RuntimeError("the job did not get to two serving data workers")
        victim = next(d for d in box["st"]["data_workers"] if d["state"] == "running")
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        proc.wait(600)
    finally:
        stopped.set()
        stop(proc)
    steps = sorted(s.t for s in load_stamps(stamps))
    before = [b - a for a, b in itertools.pairwise(steps) if b < killed_at]
    after = [b - a for a, b in itertools.pairwise(steps) if killed_at <= b <= killed_at + 5]
    audit = audit_ledger((work / "ledger").read_text().splitlines(), samples, 1)
    st = box.get("st") or {}
    return {"median_step_s": round(statistics.median(before[-200:]), 4), "largest_gap_s": round(max(after), 4),
            "exactly_once": audit.ok, "audit": audit.summary(),
            "redispatched": (st.get("data_queue") or {}).get("redispatched", -1)}


# ---------------------------------------------------------------------------- tuner
def tuner(tmp: Path, samples: int, high: int) -> dict[str, Any]:
    work = tmp / "tuner"
    argv, stamps = tidal_run(work, f"0:{high}", samples)
    proc = start(argv, work / "tidal.log", bench_env())
    box: dict[str, Any] = {}
    stopped = threading.Event()
    threading.Thread(target=watch, args=(work / "job", box, stopped), daemon=True).start()
    try:
        proc.wait(900)
    finally:
        stopped.set()
        stop(proc)
    if "settled" not in box:
        raise RuntimeError(f"the tuner did not settle: {(box.get('st') or {}).get('data_decisions')}")
    all_stamps = load_stamps(stamps)
    settled = box["settled"]
    after = [s for s in all_stamps if s.t >= settled + 3]
    rate = sum(s.samples for s in after[1:]) / max(after[-1].t - after[0].t, 1e-9)
    decisions = (box.get("st") or {}).get("data_decisions", [])
    count = next((int(w) for d in decisions for w in [d.split("settled on ")[-1].split()[0]] if "settled on" in d),
                 0)
    return {"settle_s": round(settled - all_stamps[0].t, 1), "count": count, "samples_per_s": round(rate, 1),
            "decisions": decisions}


# ---------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=400_000, help="samples of each sweep run (one epoch)")
    p.add_argument("--counts", default="0,1,2,4", help="data workers / DataLoader workers to sweep")
    p.add_argument("--warmup", type=float, default=6.0, help="seconds left out at the start of each run")
    p.add_argument("--kill-after", type=float, default=8.0, help="pause: seconds of training before the kill")
    p.add_argument("--only", default="sweep,fused,pause,tuner", help="parts, comma-separated")
    p.add_argument("--sweep-json", type=Path, default=None, help="tuner: the best fixed count from this --json output")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    args = p.parse_args()
    parts = set(args.only.split(","))
    unknown = parts - {"sweep", "fused", "pause", "tuner"}
    if unknown:
        p.error(f"unknown part(s) {sorted(unknown)}")
    counts = [int(c) for c in args.counts.split(",")]
    result: dict[str, Any] = {"machine": MACHINE, "pinning": f"trainer CPU {TRAINER_CPU}, data side CPU {DATA_CPU}",
                              "emulated_device_time": False}
    with tempfile.TemporaryDirectory(prefix="tidal-bench-dw-") as tmp:
        t = Path(tmp)
        if "sweep" in parts or ("tuner" in parts and args.sweep_json is None):
            print("sweep: samples/s, trainer on CPU 0, data side on CPU 1", flush=True)
            result.update(sweep(t, counts, args.samples, args.warmup))
        if "fused" in parts:
            print("fused transfer: 42-tensor batches over ZeroMQ on 127.0.0.1", flush=True)
            result["fused"] = fused_ratio(t)
        if "pause" in parts:
            print("pause: SIGKILL of one of 2 data workers", flush=True)
            result["pause"] = pause(t, args.samples, args.kill_after)
        if "tuner" in parts:
            print(f"tuner: --data-workers 0:{max(counts)} from a cold start", flush=True)
            result["tuner"] = tuner(t, 2 * args.samples, max(counts))
    if args.sweep_json is not None:
        loaded = json.loads(args.sweep_json.read_text())
        result.setdefault("tidal", loaded["tidal"])
        result.setdefault("dataloader", loaded["dataloader"])
    report(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


def report(r: dict[str, Any]) -> None:
    print(f"\n{r['machine']}; {r['pinning']}; no emulated device time")
    if "tidal" in r:
        rows = [["K", "tidal samples/s", "DataLoader samples/s", "tidal / DataLoader"]]
        for k, v in r["tidal"].items():
            d = r["dataloader"].get(k, 0.0)
            rows.append([k, f"{v:,.0f}", f"{d:,.0f}", f"{v / d:.2f}x" if d else "-"])
        print(table(rows))
    if "fused" in r:
        f = r["fused"]
        print(f"\nfused transfer: {f['fused']:,.0f} batches/s in one message, {f['per_tensor']:,.0f} with one message "
              f"per tensor: {f['ratio']:.2f}x (GoldMiner 5.4: up to 1.25x end to end)")
    if "pause" in r:
        q = r["pause"]
        print(f"\nSIGKILL of a data worker: largest step gap {q['largest_gap_s'] * 1e3:.0f} ms within 5 s after it, "
              f"median step {q['median_step_s'] * 1e3:.0f} ms before; {q['redispatched']} batches re-dispatched; "
              f"ledger exactly once: {q['exactly_once']}")
    if "tuner" in r and "tidal" in r:
        u = r["tuner"]
        best_k, best = max(r["tidal"].items(), key=lambda kv: kv[1])
        print(f"\ntuner: settled on {u['count']} data workers {u['settle_s']:.0f} s after the first step, "
              f"{u['samples_per_s']:,.0f} samples/s; best fixed count {best_k}: {best:,.0f} "
              f"({u['samples_per_s'] / best:.2f}x, target >= 0.90x)")
        for line in u["decisions"]:
            print(f"  {line}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--pinned-worker":
        pinned_worker(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "--dataloader-peer":
        q = argparse.ArgumentParser()
        q.add_argument("--dataloader-peer", type=int)
        q.add_argument("--samples", type=int)
        q.add_argument("--stamp-dir")
        a = q.parse_args()
        dataloader_peer(a.dataloader_peer, a.samples, 512, a.stamp_dir)
    elif len(sys.argv) > 1 and sys.argv[1] == "--fused-sender":
        fused_sender(sys.argv[2], sys.argv[4] == "fused")
    else:
        main()
