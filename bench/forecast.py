"""Forecasting benchmark on the WorldCup98 trace (Kale section 3.2; issue 3).

The per-minute request counts are averaged into 10-minute bins (requests/minute). Models are
fitted on everything before the last two weeks and rolled over those two weeks with one
forecast origin per bin: at each origin a model forecasts the next 10 minutes (1 bin) and the
next hour (6 bins), then is given the bin that came. Statistical models are refitted once a
day on the data seen so far (as a live planner would); torch models are trained once.
Selection: each model's rolling MAPE on the last week *before* the test part (validation);
the lowest wins and its test error is reported as "selected".

    .venv/bin/python bench/forecast.py [--trace PATH] [--models a,b] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from tidal.brain import forecast

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / ".." / "shared" / "traces" / "worldcup98-requests-per-minute.csv"
BIN = 10  # minutes per bin
PERIOD = 24 * 60 // BIN
HORIZONS = {"10min": 1, "1h": 6}
REFIT_EVERY = PERIOD  # statistical models: once a day
TORCH = {"dlinear", "fedformer"}


def load_bins(path: Path) -> np.ndarray:
    import csv

    with open(path, newline="") as f:
        counts = np.array([float(r["count"]) for r in csv.DictReader(f)])
    n = len(counts) // BIN * BIN
    return counts[:n].reshape(-1, BIN).mean(axis=1)


def run(series: np.ndarray, name: str, train_end: int, end: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for label, h in HORIZONS.items():
        t0 = time.perf_counter()
        fc = forecast.get(name, period=PERIOD)
        refit = None if name in TORCH else REFIT_EVERY
        res = forecast.backtest(fc, series[:end], train_end, h, step=1, refit_every=refit)
        out[label] = {"mape": res.mape, "mape_last": res.mape_last, "origins": res.n_origins,
                      "seconds": time.perf_counter() - t0}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--models", default="seasonal-naive,holt-winters,mstl,dlinear,fedformer")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    series = load_bins(args.trace)
    test = 14 * PERIOD
    test_start = len(series) - test
    val_start = test_start - 7 * PERIOD
    names = args.models.split(",")
    print(f"{len(series)} bins of {BIN} min; validation {val_start}..{test_start}, test {test_start}..{len(series)}")
    validation = {n: run(series, n, val_start, test_start) for n in names}
    results = {n: run(series, n, test_start, len(series)) for n in names}
    selected = {label: min(names, key=lambda n: validation[n][label]["mape"]) for label in HORIZONS}
    print(f"{'model':16s} " + " ".join(f"{'val ' + k:>10s} {'test ' + k:>10s} {'@h ' + k:>9s} {'s':>5s}" for k in HORIZONS))
    for n in names:
        cells = []
        for k in HORIZONS:
            r, v = results[n][k], validation[n][k]
            cells.append(f"{v['mape']:10.2f} {r['mape']:10.2f} {r['mape_last']:9.2f} {r['seconds']:5.1f}")
        print(f"{n:16s} " + " ".join(cells))
    for k in HORIZONS:
        s = selected[k]
        ratio = results[s][k]["mape"] / results["seasonal-naive"][k]["mape"] if "seasonal-naive" in results else float("nan")
        print(f"selected at {k}: {s}: test MAPE {results[s][k]['mape']:.2f}%, {ratio:.2f}x seasonal-naive")
    if args.json:
        args.json.write_text(json.dumps({"validation": validation, "test": results, "selected": selected}, indent=2))


if __name__ == "__main__":
    main()
