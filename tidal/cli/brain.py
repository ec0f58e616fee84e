"""``tidal fit`` and ``tidal plan``: throughput models and the Kale planner from the command line."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import typer

from tidal.api import ConfigError
from tidal.cli import app, fail

plan_app = typer.Typer(help="Plan resources with a planner of tidal.brain.", no_args_is_help=True)
app.add_typer(plan_app, name="plan")


def _read_csv(path: Path) -> list[dict[str, str]]:
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise fail(f"cannot read {path}: {exc.strerror or exc}") from None
    except (csv.Error, UnicodeDecodeError) as exc:
        raise fail(f"{path} is not a readable CSV: {exc}") from None
    return rows


@app.command("fit")
def fit(
    name: str = typer.Argument(..., help="model: kale-sync, kale-async, dlrover-rm, optimus, ernest"),
    csv_path: Path = typer.Argument(..., metavar="CSV", help="columns workers, throughput [, ps, worker_cpu, ps_cpu, batch_size]"),
    test_fraction: float = typer.Option(0.25, "--test-fraction", help="share of rows held out to measure the error"),
    seed: int = typer.Option(0, "--seed", help="seed of the train/test split"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Fit a throughput model (samples/s) by non-negative least squares; report held-out error."""
    from tidal.brain import models

    try:
        model = models.get(name)
        rows = _read_csv(csv_path)
        if not rows:
            raise fail(f"{csv_path} has no data rows")
        samples = models.samples_from_rows(rows, model)
        if not 0.0 <= test_fraction < 1.0:
            raise fail(f"--test-fraction must be in [0, 1), got {test_fraction}")
        fitted, report = models.fit_and_report(name, samples, test_fraction, seed)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps({
            "model": report.model,
            "params": report.params,
            "mape": report.mape,
            "rmse": report.rmse,
            "n_train": report.n_train,
            "n_test": report.n_test,
        }))
        return
    where = "held-out" if report.held_out else "in-sample (no rows held out)"
    typer.echo(f"model {report.model} ({getattr(fitted, 'form', '') or 'single form'}), "
               f"{report.n_train} rows fitted, {report.n_test} held out")
    for k, v in report.params.items():
        typer.echo(f"  {k:12s} {v:.6g}")
    typer.echo(f"{where}: MAPE {report.mape:.2f}%  RMSE {report.rmse:.4g} samples/s  RMSLE {report.rmsle:.4f}")


@plan_app.command("kale")
def plan_kale(
    model_name: str = typer.Option("kale-sync", "--model", help="throughput model name"),
    params: str = typer.Option(..., "--params", help='JSON list or object of coefficients, e.g. "[0.00035, 2.5726, 0.9824, 0.02786]"'),
    batch_size: float = typer.Option(..., "--batch-size", help="global batch size M"),
    traffic: float = typer.Option(..., "--traffic", help="L, samples/s to keep up with"),
    max_workers: int = typer.Option(64, "--max-workers", help="largest worker count allowed"),
    ps_per_worker: float = typer.Option(0.0, "--ps-per-worker", help="PS per worker, for models that need p"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Kale Eq. 10: the smallest worker count whose predicted throughput exceeds the traffic."""
    from tidal.brain import models
    from tidal.brain.kale import minimal_workers

    try:
        values = json.loads(params)
    except json.JSONDecodeError as exc:
        raise fail(f"--params is not JSON: {exc.msg}") from None
    if not isinstance(values, list | dict):
        raise fail("--params must be a JSON list or object")
    if not (math.isfinite(traffic) and traffic >= 0) or not (math.isfinite(batch_size) and batch_size > 0):
        raise fail("--traffic must be >= 0 and --batch-size > 0")
    try:
        model = models.get(model_name)
        model.set_params(values)
        choice = minimal_workers(model, traffic, max_workers, batch_size=batch_size, ps_per_worker=ps_per_worker)
    except (ConfigError, TypeError, ValueError) as exc:
        raise fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps({"workers": choice.workers, "throughput": choice.throughput, "feasible": choice.feasible}))
        return
    if choice.feasible:
        typer.echo(f"workers {choice.workers}  predicted throughput {choice.throughput:.1f} samples/s > {traffic:g}")
    else:
        typer.echo(
            f"no worker count up to {max_workers} reaches {traffic:g} samples/s; the most the model predicts is "
            f"{choice.throughput:.1f} samples/s at workers {choice.workers}"
        )
