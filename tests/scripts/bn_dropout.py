"""A model with BatchNorm (buffers) and Dropout (randomness) trained with logical workers.

Used by tests/test_determinism.py: with 4 logical workers the checkpoint must not depend on how
many processes ran them, which exercises the buffers-follow-EST-0 rule and the per-EST streams.
"""

from __future__ import annotations

import argparse

import torch

import tidal.worker


class Blobs:
    """Two Gaussian blobs in 8 dimensions, generated from the index (no randomness at run time)."""

    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, 8, generator=g)
        self.y = (self.x[:, 0] + 0.5 * self.x[:, 1] > 0).float()
        self.x += self.y[:, None] * 0.5

    def __len__(self) -> int:
        return len(self.y)

    def get_range(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[start:end], self.y[start:end]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--logical-workers", type=int, default=4)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    job = tidal.worker.init(logical_workers=args.logical_workers, checkpoint_dir=args.checkpoint_dir)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    job.state(model, optimizer)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for x, y in job.loader(Blobs(4096), batch_size=64, epochs=2, seed=3):
        optimizer.zero_grad()
        loss_fn(model(x).squeeze(1), y).backward()
        if args.step_sleep:
            import time

            time.sleep(args.step_sleep)
        job.step()
    job.close()


if __name__ == "__main__":
    main()
