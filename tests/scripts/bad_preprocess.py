"""A job whose ``preprocess`` goes wrong on some samples (tests/test_data_workers_job.py).

``--mode raises``: it raises on the batch holding sample ``--at``; ``--mode dtype``: from that
batch on it returns float64 where the earlier batches had float32. Either way the job must fail
with a message that names the samples, whether a data worker or the trainer ran it.
"""

from __future__ import annotations

import argparse

import torch

import tidal.worker


class Lines:
    def __len__(self) -> int:
        return 4096

    def get_range(self, start: int, end: int) -> dict[str, torch.Tensor]:
        x = torch.arange(start, end, dtype=torch.float32)[:, None]
        return {"x": x, "y": 2 * x}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["raises", "dtype"], required=True)
    p.add_argument("--at", type=int, default=2000)
    args = p.parse_args()

    def preprocess(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        first, last = int(raw["x"][0]), int(raw["x"][-1])
        if first <= args.at <= last:
            if args.mode == "raises":
                raise ValueError(f"record {args.at} has no label")
            return {"x": raw["x"].double() / 1000, "y": raw["y"].double() / 1000}
        return {"x": raw["x"] / 1000, "y": raw["y"] / 1000}

    job = tidal.worker.init()
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    job.state(model, opt)
    for batch in job.loader(Lines(), batch_size=64, shuffle=False, preprocess=preprocess):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(batch["x"].float()), batch["y"].float()).backward()
        job.step()
    job.close()


if __name__ == "__main__":
    main()
