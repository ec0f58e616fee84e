"""Forecasters on synthetic seasonal series (small, fast) and selection by backtest."""

from __future__ import annotations

import numpy as np
import pytest

from tidal.brain import forecast
from tidal.brain.api import FitError, NotFittedError

P = 24


def series(days: int, seed: int = 0, noise: float = 0.03, trend: float = 0.0) -> np.ndarray:
    t = np.arange(days * P)
    base = 100 * (1 + trend * t / P) * (1.5 + np.sin(2 * np.pi * t / P))
    return base * np.exp(np.random.default_rng(seed).normal(0, noise, len(t)))


def test_seasonal_naive_exact_on_periodic():
    s = 10 + np.sin(2 * np.pi * np.arange(5 * P) / P)
    fc = forecast.get("seasonal-naive", period=P)
    fc.fit(s[: 4 * P])
    assert np.allclose(fc.predict(P), s[4 * P : 5 * P])
    fc.update(s[4 * P : 4 * P + 3])
    assert np.allclose(fc.predict(2), s[4 * P + 3 : 4 * P + 5])


@pytest.mark.parametrize("name", ["holt-winters", "mstl", "dlinear", "fedformer"])
def test_models_beat_naive_on_trending_seasonal_series(name):
    s = series(20, trend=0.05, noise=0.1)
    kw = {"periods": (P,)} if name == "mstl" else {}
    if name in ("dlinear", "fedformer"):
        kw = {"lookback": 2 * P, "max_horizon": 6, "epochs": 30, "kernel": 5}
    model = forecast.backtest(forecast.get(name, period=P, **kw), s, 16 * P, 6, step=3)
    naive = forecast.backtest(forecast.get("seasonal-naive", period=P), s, 16 * P, 6, step=3)
    assert model.forecasts.shape == (model.n_origins, 6) and np.all(model.forecasts >= 0)
    assert model.mape < naive.mape, (name, model.mape, naive.mape)


def test_errors_and_selection():
    with pytest.raises(FitError):
        forecast.get("holt-winters", period=P).fit(np.ones(P))
    with pytest.raises(NotFittedError):
        forecast.get("mstl", period=P).predict(3)
    s = series(12, trend=0.05)
    best, scores = forecast.select(["seasonal-naive", "holt-winters"], s, horizon=3, validation=2 * P, period=P)
    assert best == min(scores, key=lambda k: scores[k]) and set(scores) == {"seasonal-naive", "holt-winters"}
    assert best == "holt-winters"
