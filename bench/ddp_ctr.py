"""examples/ctr/train.py as a plain torchrun + DDP script: the peer of tidal in the runtime benchmarks.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc-per-node 1 \\
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-conf last_call_timeout=1 \\
        --local-addr 127.0.0.1 --max-restarts 10 bench/ddp_ctr.py --samples N --stamp-dir DIR

Same model (DLRM), data (ClickDataset, contiguous ``get_range`` batches), per-worker batch size,
Adam, BCE loss, gloo and one intra-op thread as the tidal run. The data are split with a
``DistributedSampler`` over *batch indices* (index ranges ``[b * B, (b + 1) * B)``), so each
rank reads contiguous ranges exactly like tidal's shards, and batch generation costs the same.

Elasticity the torchrun way: on any membership change or worker failure torchrun stops every
worker and starts them again; the script then resumes from the checkpoint that rank 0 writes
every ``--ckpt-every`` steps (model, optimizer, step, epoch; written to a temporary file and
renamed). Steps redone after a restart are *not* counted as pause: the stamp of the first step
applied after the restart ends the pause, whatever step number it has (favours torchrun).

One line per applied step goes to ``--stamp-dir/<pid>.txt`` (bench/common.py ``StampWriter``).

Two more uses, as the plain-PyTorch peer of logical workers (bench/est.py part 2):
``--accumulate A`` applies one optimizer step per A micro-batches of ``--batch-size`` (gradient
accumulation, DDP's ``no_sync`` on all but the last; each micro-batch's loss scaled by its share
of the step's samples, so the gradient is that of the mean loss over the A batches), and run
with plain ``python`` (no ``RANK`` in the environment) it is one process without
``torch.distributed`` or DDP at all.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import StampWriter, split_args
from examples.ctr.data import ClickDataset
from examples.ctr.model import DLRM
from examples.ctr.train import MODEL_SIZES, emulated_device_seconds, pick_device
from examples.ctr.train import parse_args as example_args


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(bench arguments, examples/ctr/train.py's arguments): the training arguments are the example's."""
    bench, rest = split_args(argv, [("--ckpt", {"default": None, "help": "checkpoint file (resume from it if present)"}),
                                    ("--ckpt-every", {"type": int, "default": 50}),
                                    ("--accumulate", {"type": int, "default": 1,
                                                      "help": "micro-batches per optimizer step"})])
    if bench.accumulate < 1:
        raise SystemExit(f"--accumulate must be >= 1, got {bench.accumulate}")
    return bench, example_args(rest)


def main(argv: list[str] | None = None) -> None:
    bench, args = parse_args(argv)
    torch.set_num_threads(args.threads)
    stamps = StampWriter(bench.stamp_dir)
    distributed = "RANK" in os.environ  # under torchrun; plain python: one process, no DDP
    device = pick_device(args.device)
    if device.type == "cuda" and distributed:  # one GPU per local rank, as torchrun users do
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(args.seed)
    train = ClickDataset(args.samples, seed=args.seed)
    model = DLRM(**MODEL_SIZES[args.model_size]).to(device)  # type: ignore[arg-type]
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    step, epoch, skip = -1, 0, 0
    if bench.ckpt and os.path.exists(bench.ckpt):
        ck = torch.load(bench.ckpt, weights_only=True, map_location=device)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        step, epoch, skip = int(ck["step"]), int(ck["epoch"]), int(ck["batches_done"])
    ddp = (DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
           if distributed else model)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    n_batches = (len(train) + args.batch_size - 1) // args.batch_size
    sampler = DistributedSampler(range(n_batches), num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    while epoch < args.epochs:
        sampler.set_epoch(epoch)
        # after a restart, skip the batches of this epoch the checkpoint already has (global
        # batches, so the skip is right whatever the new world size is)
        order = list(sampler)[skip // world:]
        acc = bench.accumulate
        for i in range(0, len(order), acc):
            ranges = [(b * args.batch_size, min((b + 1) * args.batch_size, len(train))) for b in order[i:i + acc]]
            samples = sum(e - s for s, e in ranges)
            optimizer.zero_grad(set_to_none=True)
            for j, (s, e) in enumerate(ranges):
                batch = {k: v.to(device, non_blocking=True) for k, v in train.get_range(s, e).items()}
                sync = ddp.no_sync() if distributed and j < len(ranges) - 1 else contextlib.nullcontext()
                with sync:
                    loss = loss_fn(ddp(batch["dense"], batch["sparse"]), batch["label"])
                    (loss * ((e - s) / samples) if len(ranges) > 1 else loss).backward()
                # the emulated accelerator time of each batch, as the example sleeps it under tidal
                # (per logical worker's batch there); --step-sleep is folded into it at parse time
                pause = emulated_device_seconds(args, e - s)
                if pause > 0:
                    time.sleep(pause)
            optimizer.step()
            step += 1
            stamps.stamp(world, samples, step)
            if bench.ckpt and rank == 0 and step % bench.ckpt_every == 0:
                tmp = bench.ckpt + ".tmp"
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                            "epoch": epoch, "batches_done": skip + (i + len(ranges)) * world}, tmp)
                os.replace(tmp, bench.ckpt)
        epoch, skip = epoch + 1, 0
    stamps.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
