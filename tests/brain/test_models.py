"""Throughput models: recovery of known coefficients, the paper's example, input errors."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from tidal.brain import models
from tidal.brain.api import FitError, NotFittedError, ThroughputConfig, ThroughputSample

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
M = 16384.0


def _samples(model: models.LinearisedModel, configs: list[ThroughputConfig], noise: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [ThroughputSample(c, model.predict(c) * math.exp(rng.normal(0, noise))) for c in configs]


CASES = [
    ("kale-sync", models.KaleSyncModel([0.00035, 2.5726, 0.9824, 0.02786]),
     [ThroughputConfig(w, batch_size=M) for w in range(1, 33)]),
    ("kale-sync", models.KaleSyncModel([0.001, 2.0, 0.5, 0.01, 1.0, 0.02, 0.01]),
     [ThroughputConfig(w, ps=p, batch_size=M) for w in range(1, 17) for p in (1, 2, 4, 8)]),
    ("kale-async", models.KaleAsyncModel([0.000224, 0.000566, 1e-6]),
     [ThroughputConfig(w) for w in range(1, 33)]),
    ("kale-async", models.KaleAsyncModel([0.0002, 0.0005, 1e-5, 2e-6]),
     [ThroughputConfig(w, ps=p) for w in range(1, 17) for p in (1, 2, 4, 8)]),
    ("optimus", models.OptimusModel([1e-4, 0.05, 0.002]), [ThroughputConfig(w, batch_size=M) for w in range(1, 33)]),
    ("ernest", models.ErnestModel([0.05, 1e-4, 0.02, 0.003]), [ThroughputConfig(w, batch_size=M) for w in range(1, 33)]),
    ("dlrover-rm", models.DLRoverRMModel([3.48e-3, 2.36e-2, 0.68e-2, 2.45e-4, 0.1]),
     [ThroughputConfig(w, ps=p, worker_cpu=c, ps_cpu=pc, batch_size=512.0 * w)
      for w in (1, 2, 4, 8, 16) for p in (1, 2, 4) for c in (2, 4, 8) for pc in (2, 8)]),
]


@pytest.mark.parametrize(("name", "truth", "configs"), CASES)
def test_fit_recovers_generating_model(name, truth, configs):
    samples = _samples(truth, configs, noise=0.01)
    model, report = models.fit_and_report(name, samples, test_fraction=0.25, seed=1)
    assert report.held_out and report.n_test == round(len(samples) * 0.25)
    assert report.mape < 3.0, report
    assert all(v >= 0 for v in model.params.values())
    assert set(model.params) == set(truth.params)


def test_noise_free_fit_is_exact():
    truth = models.KaleSyncModel([0.00035, 2.5726, 0.9824, 0.02786])
    samples = _samples(truth, [ThroughputConfig(w, batch_size=M) for w in range(1, 20)], noise=0.0)
    fitted = models.get("kale-sync").fit(samples)
    for k, v in truth.params.items():
        assert fitted.params[k] == pytest.approx(v, rel=1e-6)


def test_paper_example_throughput():
    m = models.KaleSyncModel([0.00035, 2.5726, 0.9824, 0.02786])
    assert m.predict(ThroughputConfig(10, batch_size=M)) == pytest.approx(30007.3, rel=1e-3)
    assert m.predict(ThroughputConfig(9, batch_size=M)) < 30000 < m.predict(ThroughputConfig(10, batch_size=M))
    # the paper's fitted F is not monotonic: it peaks near w = 10
    f = [m.predict(ThroughputConfig(w, batch_size=M)) for w in range(1, 30)]
    assert int(np.argmax(f)) + 1 == 10


def test_kale_models_differ_from_baselines_on_kale_data():
    truth = models.KaleSyncModel([0.00035, 2.5726, 0.9824, 0.02786])
    samples = _samples(truth, [ThroughputConfig(w, batch_size=M) for w in range(1, 33)], noise=0.02, seed=3)
    kale = models.fit_and_report("kale-sync", samples, 0.3, 0)[1].mape
    ernest = models.fit_and_report("ernest", samples, 0.3, 0)[1].mape
    assert kale < ernest


def test_rows_errors():
    m = models.get("dlrover-rm")
    with pytest.raises(FitError, match="ps, worker_cpu, ps_cpu, batch_size"):
        models.samples_from_rows([{"workers": "1", "throughput": "2"}], m)
    with pytest.raises(FitError, match="line 3"):
        models.samples_from_rows([{"workers": "1", "throughput": "2"}, {"workers": "x", "throughput": "2"}],
                                 models.get("kale-sync"))
    with pytest.raises(FitError, match="need at least 4"):
        models.get("kale-sync").fit([ThroughputSample(ThroughputConfig(w), 10.0 * w) for w in (1, 2, 3)])
    with pytest.raises(FitError):
        models.get("ernest").fit([ThroughputSample(ThroughputConfig(w), -1.0) for w in range(1, 9)])
    with pytest.raises(NotFittedError):
        models.get("optimus").predict(ThroughputConfig(2))


def test_split_is_seeded():
    s = [ThroughputSample(ThroughputConfig(w), float(w)) for w in range(1, 41)]
    a, b = models.split(s, 0.25, 7), models.split(s, 0.25, 7)
    assert a == b and len(a[1]) == 10
    assert models.split(s, 0.25, 8)[1] != a[1]


def _pollux(app: str) -> list[ThroughputSample]:
    path = TRACES / "pollux-throughput" / app / "placements.csv"
    if not path.exists():
        pytest.skip(f"real traces not found at {TRACES} (../shared/traces)")
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            gpus = sum(int(ch) for ch in r["placement"])
            local = float(r["local_bsz"])
            out.append(ThroughputSample(ThroughputConfig(gpus, batch_size=local * gpus), local * gpus / float(r["step_time"])))
    return out


def test_real_pollux_measurements_fit_reasonably():
    """Real step times (Pollux cifar10): every model fits, held-out error is bounded."""
    samples = _pollux("cifar10")
    for name in ("kale-sync", "optimus", "ernest"):
        _, report = models.fit_and_report(name, samples, 0.25, 0)
        assert report.n_test > 100
        assert math.isfinite(report.mape) and report.mape < 60.0, (name, report.mape)
