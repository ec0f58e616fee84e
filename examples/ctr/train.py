"""Train a small DLRM-style click model on synthetic data, elastically, with tidal.

    tidal run --workers 1:4 examples/ctr/train.py --samples 200000 --epochs 2
    python examples/ctr/train.py --samples 20000        # one local worker, no master

The data come from a known logistic model (examples/ctr/data.py), so the AUC has a known
ceiling: the script prints both. ``--slow-worker W --slowdown F`` makes worker W F times slower
per sample (a straggler, for tests and demos).

Emulated accelerator time (``--device-ms-per-step M --device-us-per-sample U``): after each
batch's backward, before ``job.step()``, the worker sleeps ``M/1000 + U*samples/1e6`` seconds,
its CPU idle, as a process waiting on a GPU kernel would be. On a machine with few cores, extra
worker processes add no compute, so throughput cannot grow with workers and a planner has nothing
real to discover; with emulated device time it grows with the workers up to a knee set by the
CPU work that remains. It is an emulation for experiments on small machines: results that use it
must say so (the script prints the setting, and passes it to ``job.finish`` with the metrics).
Plain ``python`` runs sleep the same way, so tidal-vs-plain comparisons stay fair.

``--step-sleep S`` is an alias in seconds: it adds ``1000*S`` to ``--device-ms-per-step``
(``--step-sleep 0.05`` is ``--device-ms-per-step 50``). It stays because tests and benches pace
their jobs with it, and bench/ddp_ctr.py, which parses these same arguments, sleeps it too.
There is one sleep per batch: the straggler's extra compute plus the emulated device time, the
latter also ``--slowdown`` times longer on the slow worker (its "device" is slower too).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tidal.worker
from examples.ctr.data import ClickDataset, roc_auc
from examples.ctr.features import FeatureTransform, RawClickModel, RawClicks
from examples.ctr.model import DLRM
from examples.ctr.stream import ClickRecords
from tidal.ps.api import TableSpec
from tidal.ps.embedding import ServerEmbeddings


def non_negative_float(text: str) -> float:
    """An argparse type: a finite float >= 0 (the error names the option, on one line)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=200_000, help="training samples per epoch")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=512, help="samples per worker per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-samples", type=int, default=20_000)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    p.add_argument("--log-every", type=int, default=100, help="print progress every N steps (rank 0)")
    p.add_argument("--slow-worker", type=int, default=-1, help="worker id to slow down (straggler)")
    p.add_argument("--slowdown", type=float, default=1.0, help="how many times slower the slow worker is")
    p.add_argument("--step-sleep", type=non_negative_float, default=0.0,
                   help="extra seconds per step (tests): an alias, adds 1000x this to --device-ms-per-step")
    p.add_argument("--device-ms-per-step", type=non_negative_float, default=0.0, metavar="MS",
                   help="EMULATED accelerator time: sleep MS milliseconds per step (CPU idle), as if a GPU "
                        "ran the step; for experiments on small machines, results using it must say so")
    p.add_argument("--device-us-per-sample", type=non_negative_float, default=0.0, metavar="US",
                   help="EMULATED accelerator time: also sleep US microseconds per sample of the step's "
                        "batch (see --device-ms-per-step)")
    p.add_argument("--hang-worker", type=int, default=-1,
                   help="worker id whose main thread hangs at --hang-at-step (tests; heartbeats go on)")
    p.add_argument("--hang-at-step", type=int, default=10)
    p.add_argument("--logical-workers", type=int, default=None,
                   help="train N logical workers, bitwise the same on any number of processes")
    p.add_argument("--checkpoint-dir", default=None, help="write the final checkpoint here")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu",
                   help="where the model trains (auto: cuda when available); tidal picks the workers' "
                        "process-group backend from it")
    p.add_argument("--stream", default=None, metavar="URL",
                   help="train on a stream of click records (tidal produce) instead of --samples of the dataset; "
                        "default: the job's `tidal run --stream`")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small",
                   help="small: the CPU-sized DLRM; large: wider MLPs and embeddings, so that a GPU step "
                        "is not bound by kernel launches")
    p.add_argument("--ps", action="store_true",
                   help="hold the embedding tables on the job's parameter servers (tidal run --ps N): one table "
                        "of --ps-hash-size ids per sparse field, rows created when first trained")
    p.add_argument("--ps-hash-size", type=int, default=2**24, metavar="N",
                   help="with --ps: ids per table (raw categories hash into N buckets; default 2^24, too large "
                        "to replicate in every worker)")
    p.add_argument("--table-rows", type=int, default=1000, metavar="N",
                   help="without --ps: rows of each replicated embedding table (raw categories hash into N "
                        "buckets; every worker holds every table and all-reduces its dense gradient)")
    p.add_argument("--ps-optimizer", choices=["adam", "adagrad", "sgd"], default="adam",
                   help="with --ps: the tables' optimizer, run on the servers (lr: --lr)")
    p.add_argument("--raw-features", action="store_true",
                   help="train on raw samples (examples.ctr.features): the batches need real CPU work first "
                        "(string hashing, crosses, bucketizing), done by the job's data workers (tidal run "
                        "--data-workers N) or, without them, by the worker itself")
    p.add_argument("--auto-partition", action="store_true",
                   help="with --raw-features: one model from raw samples (examples.ctr.features.RawClickModel) and "
                        "job.loader(preprocess='auto'): tidal cuts the pre-processing off its forward with torch.fx")
    p.add_argument("--crosses", type=int, default=28, metavar="K",
                   help="with --raw-features: crossed fields (pairs, then triples of the 8 raw fields; 0-84)")
    p.add_argument("--ps-async", action="store_true",
                   help="with --ps: async mode (Kale Eq. 8): each worker's sparse gradients are applied on "
                        "arrival, without waiting for the others (at least once under failures; see "
                        "tidal.ps.embedding); default: sync, exactly once and the same model on any layout")
    args = p.parse_args(argv)
    for name in ("table_rows", "ps_hash_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.raw_features and (args.ps or args.stream):
        p.error("--raw-features trains on the dataset with the model's own tables (not with --ps or --stream)")
    if args.auto_partition and not args.raw_features:
        p.error("--auto-partition needs --raw-features")
    if not 0 <= args.crosses <= 84:
        p.error("--crosses must be in [0, 84]")
    args.device_ms_per_step += args.step_sleep * 1e3  # the alias; args.step_sleep stays for its readers
    return args


# DLRM widths per --model-size: embedding dimension, bottom MLP, top MLP
MODEL_SIZES: dict[str, dict[str, object]] = {
    "small": {"emb_dim": 16, "bottom": (32,), "top": (64, 32)},
    "large": {"emb_dim": 128, "bottom": (512, 256), "top": (2048, 2048, 1024)},
}


def emulated_device_seconds(args: argparse.Namespace, samples: int) -> float:
    """Seconds one step of ``samples`` samples waits on the emulated accelerator (0 when not set)."""
    return args.device_ms_per_step / 1e3 + args.device_us_per_sample * samples / 1e6


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available to this process")
    return torch.device(name)


def server_tables(args: argparse.Namespace, job: tidal.worker.Job) -> ServerEmbeddings | None:
    """``--ps``: one table per sparse field on the job's parameter servers (None without it)."""
    if not args.ps:
        return None
    dim, fields = int(MODEL_SIZES[args.model_size]["emb_dim"]), 8  # type: ignore[call-overload]
    return ServerEmbeddings(job, [TableSpec(f"field{f}", dim=dim, num_ids=args.ps_hash_size, optimizer=args.ps_optimizer,
                                            lr=args.lr, seed=args.seed) for f in range(fields)],
                            synchronous=not args.ps_async)


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: to_device(v, device) if isinstance(v, dict) else v.to(device, non_blocking=True)
            for k, v in batch.items()}


def predict(model: DLRM, tables: ServerEmbeddings | None, dense: torch.Tensor, sparse: torch.Tensor,
            crosses: torch.Tensor | None = None) -> torch.Tensor:
    """The logits: the model's own tables, or the rows pulled from the parameter servers."""
    if tables is None:
        return model(dense, sparse, crosses)
    vectors = tables({f"field{f}": sparse[:, f] for f in range(model.num_sparse)})
    return model.interact(dense, [vectors[f"field{f}"] for f in range(model.num_sparse)])


def evaluate(model: torch.nn.Module, tables: ServerEmbeddings | None, data: ClickDataset, device: torch.device,
             transform: FeatureTransform | None = None) -> float:
    model.eval()
    with torch.no_grad():
        if isinstance(model, RawClickModel):  # the whole forward, from raw samples
            batch = RawClicks(data).get_range(0, len(data))
            scores = model(to_device(batch, device)).cpu().numpy()
        else:
            batch = data.get_range(0, len(data)) if transform is None else \
                transform(RawClicks(data).get_range(0, len(data)))
            crosses = batch["crosses"].to(device) if "crosses" in batch else None
            scores = predict(model, tables, batch["dense"].to(device), batch["sparse"].to(device),  # type: ignore[arg-type]
                             crosses).cpu().numpy()
    model.train()
    return roc_auc(batch["label"].numpy(), scores)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    job = tidal.worker.init(logical_workers=args.logical_workers, checkpoint_dir=args.checkpoint_dir)
    torch.manual_seed(args.seed)
    hashing = {"hash_size": args.ps_hash_size if args.ps else args.table_rows}
    train = ClickDataset(args.samples, seed=args.seed, **hashing)
    device = pick_device(args.device)
    transform = FeatureTransform(hash_size=args.table_rows, crosses=args.crosses) if args.raw_features else None
    fields = {"num_sparse": transform.fields, "crosses": args.crosses > 0} if transform is not None else {}
    model: torch.nn.Module = DLRM(**MODEL_SIZES[args.model_size], hash_size=args.table_rows,  # type: ignore[arg-type]
                                  tables=not args.ps, **fields).to(device)
    if args.auto_partition:
        assert transform is not None
        model = RawClickModel(transform, model)
    tables = server_tables(args, job)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    state = job.state(model, optimizer)
    if tables is not None:
        tables.attach(state)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    slow = args.slowdown if job.worker_id == args.slow_worker else 1.0
    emulated = args.device_ms_per_step > 0 or args.device_us_per_sample > 0
    if emulated and job.rank == 0:
        print(f"EMULATED accelerator time: {args.device_ms_per_step:g} ms/step + {args.device_us_per_sample:g} "
              "us/sample of sleep per step (not real compute)", flush=True)

    stream = args.stream or os.environ.get("TIDAL_STREAM_URL")
    if stream:  # online training: records of `tidal produce`, the same samples as the dataset's
        records = ClickRecords(args.seed, hash_size=args.table_rows)
        loader = job.loader(stream=stream, batch_size=args.batch_size, decode=records.decode)
    else:
        loader = job.loader(train if transform is None else RawClicks(train), batch_size=args.batch_size,
                            epochs=args.epochs, seed=args.seed,
                            preprocess="auto" if args.auto_partition else transform, fallback=transform)
    t0, seen, logged = time.monotonic(), 0, -1
    for batch in loader:
        started = time.monotonic()
        batch = to_device(batch, device)
        optimizer.zero_grad(set_to_none=True)
        logits = model(batch) if args.auto_partition else \
            predict(model, tables, batch["dense"], batch["sparse"], batch.get("crosses"))  # type: ignore[arg-type]
        loss = loss_fn(logits, batch["label"])
        loss.backward()
        # one sleep: the straggler's extra compute, then the (emulated) device time of the batch
        pause = (slow - 1.0) * (time.monotonic() - started) + slow * emulated_device_seconds(args, len(batch["label"]))
        if pause > 0:
            time.sleep(pause)
        if job.worker_id == args.hang_worker and job.applied_step + 1 >= args.hang_at_step:
            threading.Event().wait()  # a deadlock in the script: only its main thread stops
        if job.step():
            seen += len(batch["label"])
            step = job.applied_step
            if job.rank == 0 and args.log_every and step % args.log_every == 0 and step != logged:
                logged = step
                rate = seen / max(time.monotonic() - t0, 1e-9)
                print(f"step {step} epoch {state.epoch} loss {loss.item():.4f} "
                      f"workers {job.world_size} {rate:.0f} samples/s (this worker)", flush=True)

    train_seconds = time.monotonic() - t0
    if job.rank == 0:
        held_out = ClickDataset(args.eval_samples, seed=args.seed, offset=args.samples, **hashing)
        auc = evaluate(model, tables, held_out, device, transform)
        ceiling = held_out.oracle_auc()
        print(f"final AUC {auc:.4f} (ceiling of the known model {ceiling:.4f}) after step {job.applied_step}, "
              f"{train_seconds:.2f} s of training", flush=True)
        emulation = ({"device_ms_per_step": args.device_ms_per_step,
                      "device_us_per_sample": args.device_us_per_sample} if emulated else {})
        job.finish(auc=auc, oracle_auc=ceiling, steps=job.applied_step + 1, train_seconds=train_seconds,
                   **emulation)
    job.close()
    if tables is not None:
        tables.close()


if __name__ == "__main__":
    main()
