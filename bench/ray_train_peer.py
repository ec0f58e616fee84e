"""examples/ctr/train.py under Ray Train: the Ray Train peer of tidal in the lost-machine benchmark.

    .venv/bin/python bench/ray_train_peer.py --address 127.0.0.1:PORT --stamp-dir DIR --storage DIR2 \\
        [--workers 2] [--min-workers 1] [--max-failures 3] [--checkpoint-every 20] \\
        -- --samples N --batch-size B --step-sleep S --epochs E ...

This process is the Ray Train *driver*: it connects to a running Ray cluster at ``--address``
(every address 127.0.0.1) and runs one ``ray.train.torch.TorchTrainer`` (Ray Train V2) to its end.
The arguments after ``--`` are examples/ctr/train.py's, parsed by its own parser, as
bench/ddp_ctr.py parses them.

Ray Train's best configuration for a lost machine: ``ScalingConfig(num_workers=(min, max))`` is
elastic (supported by the Ray Train V2 of Ray 2.60 installed here): when a worker fails, the
controller tears the worker group down and starts a new one with as many workers (between
``--min-workers`` and ``--workers``, one CPU each) as the remaining machines can hold; each
worker group counts as one failure against ``FailureConfig(max_failures)``. The workers are
placed ``SPREAD`` (``--placement-strategy``) so that, as in the torchrun run of bench/ddp_ctr.py
with one process per agent, each machine holds one worker when it has room for only one.
Ray Train starts the workers' gloo process group itself (``MASTER_ADDR`` is rank 0's node
address, 127.0.0.1 here; ``GLOO_SOCKET_IFNAME=lo``); ``prepare_model`` wraps the model in DDP.

The training function trains the job of bench/ddp_ctr.py (``--accumulate 1``), line for line:
the example's ``ClickDataset`` and ``DLRM`` (``MODEL_SIZES[--model-size]``), Adam, BCE loss,
``--batch-size`` samples per worker per step, ``--threads`` intra-op threads, one sleep of the
example's emulated device time (``--step-sleep``, ``--device-ms-per-step``...) per step, and the
same split of the data: a ``DistributedSampler`` over *batch indices* (contiguous ``get_range``
batches), by rank, reshuffled per epoch. Options of the example that bench/ddp_ctr.py does not
implement either (``--ps``, ``--stream``, ``--raw-features``, ``--logical-workers``...) are
refused here rather than ignored.

Checkpoints the Ray Train way: every ``--checkpoint-every`` steps every worker calls
``ray.train.report`` (a barrier), rank 0 with a ``Checkpoint`` of model, optimizer, global step,
epoch and batches done (written to a temporary directory, persisted by Ray Train under
``--storage``); a new worker group starts from ``ray.train.get_checkpoint()``, so the steps since
the last checkpoint are redone (they show as repeated step numbers in the stamps), and after a
change of world size each rank skips its share of the epoch's batches already done, as
bench/ddp_ctr.py does after a torchrun restart.

Measurement, as bench/common.py and bench/ddp_ctr.py do it: right after each ``optimizer.step()``
every worker appends ``wall_time world_size local_samples step`` to ``--stamp-dir/<pid>.txt``
(``StampWriter``: ``time.time()``, line-buffered; ``step`` the global step). At its start every
worker process also writes its Ray node id to ``--stamp-dir/<pid>.node``, so a benchmark can tell
which machine to remove to kill a given worker.

What Ray Train does that a benchmark should know (seen with Ray 2.60 on a local multi-node cluster):

* The controller runs on the driver's node (``ray.init`` attaches to the head node here; the peer
  logs it to stderr): never remove that node.
* Ray Train's own settings are environment variables of this driver, which it passes on to its
  controller: ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` (the controller polls its workers every 2 s),
  ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` (60 s). They are left at Ray's defaults here.
* A worker's ``report`` goes through a one-slot queue that the controller empties when it polls:
  a worker that reports more often than every poll interval blocks in ``report`` until the next
  poll. Pick ``--checkpoint-every`` so that checkpoints are at least that far apart, or measured
  throughput includes that wait. A checkpoint counts (is restored after a failure) only once a
  poll has collected it, so the last one before a failure may be lost and older steps redone.
* After a lost machine the elastic policy sizes the new worker group from the cluster's
  resources as the GCS sees them; until the GCS declares the node dead (missed heartbeats,
  about 30 s with Ray's defaults) it still counts the lost machine, tries ``--workers`` workers,
  and waits ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` before trying again.

At the end the driver prints one JSON line, ``{"ok": ..., "error": ..., "wall_s": ...}`` (wall_s:
``TorchTrainer.fit`` alone, connecting to the cluster excluded), and exits 0 only if the training
finished.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# Before ray is imported: keep Ray on the addresses it is given (127.0.0.1), and use Ray Train V2.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_TRAIN_V2_ENABLED"] = "1"

ROOT = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, ROOT)

# the workers' environment (as bench/common.py's bench_env gives the tidal and torchrun workers)
WORKER_ENV = {
    "RAY_TRAIN_V2_ENABLED": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": ROOT,
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
}

# examples/ctr/train.py options (and their defaults) that bench/ddp_ctr.py does not implement either
UNSUPPORTED = {"ps": False, "stream": None, "raw_features": False, "logical_workers": None,
               "slow_worker": -1, "hang_worker": -1, "checkpoint_dir": None}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(the peer's arguments, examples/ctr/train.py's arguments: everything after ``--``)."""
    from examples.ctr.train import parse_args as example_args

    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True, help="the Ray cluster's GCS address, 127.0.0.1:PORT")
    p.add_argument("--stamp-dir", required=True, help="where the workers write <pid>.txt and <pid>.node")
    p.add_argument("--storage", required=True, help="RunConfig(storage_path): where checkpoints are persisted")
    p.add_argument("--name", default=None, help="RunConfig(name) (default: a new name per run, so that "
                                                "Ray Train never resumes an earlier run of the same name)")
    p.add_argument("--workers", type=int, default=2, help="workers (the elastic maximum)")
    p.add_argument("--min-workers", type=int, default=1, help="the elastic minimum")
    p.add_argument("--max-failures", type=int, default=3, help="FailureConfig(max_failures)")
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints")
    p.add_argument("--placement-strategy", default="SPREAD", choices=["SPREAD", "PACK", "STRICT_SPREAD"],
                   help="ScalingConfig(placement_strategy) of the workers' placement group")
    peer = p.parse_args(ours)
    if not 1 <= peer.min_workers <= peer.workers:
        p.error("need 1 <= --min-workers <= --workers")
    if peer.checkpoint_every < 1:
        p.error("--checkpoint-every must be >= 1")
    train = example_args(rest)
    used = [k for k, default in UNSUPPORTED.items() if getattr(train, k) != default]
    if used or train.device == "cuda":
        p.error(f"training options not implemented by this peer (nor by bench/ddp_ctr.py): {used or ['--device']}")
    return peer, train


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: bench/ddp_ctr.py's loop (``--accumulate 1``), Ray Train's checkpoints.

    Everything of the repository is imported here, not at module level: this function is pickled
    by value (it lives in ``__main__``) and the worker imports what it names when unpickling it."""
    sys.path.insert(0, config["root"])
    import tempfile

    import ray
    import ray.train
    import ray.train.torch
    import torch
    from torch.utils.data.distributed import DistributedSampler

    from bench.common import StampWriter
    from examples.ctr.data import ClickDataset
    from examples.ctr.model import DLRM
    from examples.ctr.train import MODEL_SIZES, emulated_device_seconds

    args: argparse.Namespace = config["args"]
    every: int = config["checkpoint_every"]
    stamp_dir = Path(config["stamp_dir"])
    stamp_dir.mkdir(parents=True, exist_ok=True)
    (stamp_dir / f"{os.getpid()}.node").write_text(ray.get_runtime_context().get_node_id() + "\n")
    stamps = StampWriter(str(stamp_dir))

    torch.set_num_threads(args.threads)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(args.seed)
    train = ClickDataset(args.samples, seed=args.seed)
    model = DLRM(**MODEL_SIZES[args.model_size])  # type: ignore[arg-type]
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    step, epoch, skip = -1, 0, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            ck = torch.load(os.path.join(d, "state.pt"), weights_only=True, map_location="cpu")
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        step, epoch, skip = int(ck["step"]), int(ck["epoch"]), int(ck["batches_done"])
    ddp = ray.train.torch.prepare_model(model)  # DDP over the gloo group Ray Train set up
    loss_fn = torch.nn.BCEWithLogitsLoss()
    n_batches = (len(train) + args.batch_size - 1) // args.batch_size
    sampler = DistributedSampler(range(n_batches), num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    while epoch < args.epochs:
        sampler.set_epoch(epoch)
        # after a restart, skip the batches of this epoch the checkpoint already has (global
        # batches, so the skip is right whatever the new world size is)
        order = list(sampler)[skip // world:]
        for i, b in enumerate(order):
            s, e = b * args.batch_size, min((b + 1) * args.batch_size, len(train))
            optimizer.zero_grad(set_to_none=True)
            batch = train.get_range(s, e)
            loss = loss_fn(ddp(batch["dense"], batch["sparse"]), batch["label"])
            loss.backward()
            pause = emulated_device_seconds(args, e - s)  # the emulated accelerator time, as ddp_ctr.py
            if pause > 0:
                time.sleep(pause)
            optimizer.step()
            step += 1
            stamps.stamp(world, e - s, step)
            if step % every == 0:
                metrics = {"step": step, "epoch": epoch, "loss": float(loss.item()), "world": world}
                if rank == 0:
                    with tempfile.TemporaryDirectory() as d:
                        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                    "step": step, "epoch": epoch, "batches_done": skip + (i + 1) * world},
                                   os.path.join(d, "state.pt"))
                        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
                else:
                    ray.train.report(metrics)
        epoch, skip = epoch + 1, 0
    stamps.close()


def run(peer: argparse.Namespace, args: argparse.Namespace, timing: dict[str, float]) -> None:
    """Connect to the cluster and run the trainer to its end (raises if the training failed);
    ``timing["wall_s"]``: the seconds ``fit`` ran."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    ray.init(address=peer.address, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": WORKER_ENV})
    # Ray Train's controller runs on the driver's node: a benchmark must not remove that one
    print(f"ray_train_peer: driver on node {ray.get_runtime_context().get_node_id()}", file=sys.stderr, flush=True)
    try:
        name = peer.name or f"ray_train_peer_{time.strftime('%Y%m%d_%H%M%S')}_{os.getpid()}"
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"root": ROOT, "args": args, "checkpoint_every": peer.checkpoint_every,
                               "stamp_dir": str(Path(peer.stamp_dir).resolve())},
            scaling_config=ray.train.ScalingConfig(num_workers=(peer.min_workers, peer.workers), use_gpu=False,
                                                   resources_per_worker={"CPU": 1},
                                                   placement_strategy=peer.placement_strategy),
            run_config=ray.train.RunConfig(storage_path=str(Path(peer.storage).resolve()), name=name,
                                           failure_config=ray.train.FailureConfig(max_failures=peer.max_failures),
                                           checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2)),
        )
        t0 = time.monotonic()
        try:
            result = trainer.fit()
        finally:
            timing["wall_s"] = round(time.monotonic() - t0, 3)
        if result.error is not None:
            raise result.error
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    peer, args = parse_args(argv)
    timing = {"wall_s": float("nan")}
    ok, error = True, ""
    # Ray writes to the driver's stdout too (a dead node's raylet log lines, for one): send all of it
    # to stderr, so that the result line is the only thing on stdout
    sys.stdout.flush()
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        run(peer, args, timing)
    except Exception as exc:
        ok, error = False, f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
    finally:
        sys.stdout.flush()
    result_out.write(json.dumps({"ok": ok, "error": error, "wall_s": timing["wall_s"]}) + "\n")
    result_out.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
