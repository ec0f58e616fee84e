"""Throughput models against real measurements (Pollux) and the papers' own equations.

Real: ``../shared/traces/pollux-throughput/APP/{placements,scalability}.csv`` hold measured step
times of data-parallel jobs. Each row becomes ``workers`` = GPUs (placement ``22`` = 2 nodes x
2 GPUs), global batch ``batch_size`` = local batch x GPUs, ``throughput`` = batch_size /
step_time. These are all-reduce jobs without parameter servers: for DLRover-RM (which needs
``ps`` and CPU counts) the nodes stand in for ``p`` (the cross-node synchronisation fan-out) and
CPUs are set to 1; Kale's and Optimus' fixed worker/PS ratio forms are used.

Synthetic: data generated from each paper's equation with its published coefficients (Kale
Table 1, sync A10 and T4 with M = 16,384, async A10 and T4; DLRover-RM section 7's alphas) at
w = 1..32 with 3% log-normal noise (DLRover-RM: a grid of w, p, CPUs).

Every model is fitted on a random 75% and its MAPE measured on the held-out 25% (seed 0..4,
mean). ``.venv/bin/python bench/throughput_models.py``
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from tidal.brain import models
from tidal.brain.api import FitError, ThroughputConfig, ThroughputSample

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / ".." / "shared" / "traces" / "pollux-throughput"
NAMES = ["kale-sync", "kale-async", "dlrover-rm", "optimus", "ernest"]
SEEDS = range(5)


def pollux(app: str) -> list[ThroughputSample]:
    out = []
    with open(TRACES / app / "placements.csv", newline="") as f:
        for r in csv.DictReader(f):
            gpus, nodes = sum(int(c) for c in r["placement"]), len(r["placement"])
            out.append(_sample(gpus, nodes, float(r["local_bsz"]), float(r["step_time"])))
    with open(TRACES / app / "scalability.csv", newline="") as f:
        for r in csv.DictReader(f):
            out.append(_sample(int(r["num_replicas"]), int(r["num_nodes"]), float(r["local_bsz"]), float(r["step_time"])))
    return out


def _sample(gpus: int, nodes: int, local: float, step: float) -> ThroughputSample:
    cfg = ThroughputConfig(workers=gpus, ps=nodes, worker_cpu=1.0, ps_cpu=1.0, batch_size=local * gpus)
    return ThroughputSample(cfg, local * gpus / step)


def synthetic(truth: models.LinearisedModel, configs: list[ThroughputConfig], seed: int = 0) -> list[ThroughputSample]:
    rng = np.random.default_rng(seed)
    return [ThroughputSample(c, truth.predict(c) * math.exp(rng.normal(0, 0.03))) for c in configs]


def datasets() -> dict[str, list[ThroughputSample]]:
    m = 16384.0
    ws = [ThroughputConfig(w, batch_size=m) for w in range(1, 33)]
    data = {
        "kale sync A10 (Tab.1)": synthetic(models.KaleSyncModel([0.00035, 2.5726, 0.9824, 0.02786]), ws),
        "kale sync T4 (Tab.1)": synthetic(models.KaleSyncModel([0.00253, 11.1614, 11.6335, 1.88e-14]), ws),
        "kale async A10 (Tab.1)": synthetic(models.KaleAsyncModel([0.000224, 0.000566, 1.41e-21]), ws),
        "kale async T4 (Tab.1)": synthetic(models.KaleAsyncModel([0.0002297, 0.001421, 1.12e-18]), ws),
        "dlrover-rm (Sec.7 alphas)": synthetic(
            models.DLRoverRMModel([3.48e-3, 2.36e-2, 0.68e-2, 2.45e-3, 2.45e-1]),
            [ThroughputConfig(w, ps=p, worker_cpu=c, ps_cpu=pc, batch_size=512.0 * w)
             for w in (1, 2, 4, 8, 16, 32) for p in (1, 2, 4, 8) for c in (2, 4, 8) for pc in (2, 8)],
        ),
    }
    if TRACES.exists():
        for app in ("cifar10", "imagenet", "bert"):
            data[f"pollux {app} (real)"] = pollux(app)
    else:
        print(f"(real traces not found at {TRACES}: synthetic data only)")
    return data


def main() -> None:
    rows = []
    for label, samples in datasets().items():
        cells = []
        for name in NAMES:
            errs = []
            for seed in SEEDS:
                try:
                    errs.append(models.fit_and_report(name, samples, 0.25, seed)[1].mape)
                except FitError:
                    break
            cells.append(float(np.mean(errs)) if errs else float("nan"))
        rows.append((label, len(samples), cells))
    print(f"{'data':28s} {'rows':>5s} " + " ".join(f"{n:>11s}" for n in NAMES))
    for label, n, cells in rows:
        print(f"{label:28s} {n:5d} " + " ".join(f"{c:10.2f}%" for c in cells))


if __name__ == "__main__":
    main()
