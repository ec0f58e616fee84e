"""Traffic forecasting (Kale section 3.2): one interface, several models, backtest selection.

All forecasters follow ``tidal.brain.api.Forecaster``: ``fit(series)`` on a regularly sampled
history (one value per interval, e.g. mean samples/s per 10 minutes), ``update(values)`` to
append what was observed since (no refit: cheap enough to call every interval), and
``predict(horizon)`` for the next values. Registry by name: ``forecast.get("mstl", period=144)``.

Traffic is multiplicative (a match doubles the load whatever the hour), so every model except
seasonal-naive works on ``log(1 + x)`` and forecasts are transformed back; errors are judged by
MAPE, which is relative too.

* ``seasonal-naive``: the value one period ago (the baseline every other model must beat).
* ``holt-winters``: additive damped-trend Holt-Winters on the log series (statsmodels
  ``ExponentialSmoothing``), its smoothing recursion continued in ``update``.
* ``mstl``: MSTL decomposition (statsmodels) into daily and weekly seasonal parts plus trend;
  the seasonal parts repeat their last cycle, the seasonally adjusted series is forecast by
  a damped Holt model.
* ``dlinear``: DLinear (Zeng et al., AAAI'23): moving-average decomposition, one linear map
  per component from the lookback window to the horizon (torch).
* ``fedformer``: a compact FEDformer-style model (Zhou et al., ICML'22) as Kale section 3.2
  uses it: series decomposition, an encoder whose token mixing is a frequency-enhanced block
  (FFT, a fixed random subset of modes, learned complex weights, inverse FFT), a decoder that
  maps the seasonal encoding and the trend to the horizon. Small (d_model 16, 32 modes) so it
  trains on 2 CPU cores in well under a minute.

``backtest`` measures a forecaster by rolling origins; ``select`` picks the one with the
lowest backtest MAPE. Torch models seed their own generator: the same data gives the same fit.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tidal.api import ConfigError
from tidal.brain.api import FitError, Forecaster, NotFittedError

__all__ = [
    "BacktestResult",
    "DLinearForecaster",
    "FEDformerForecaster",
    "HoltWintersForecaster",
    "MSTLForecaster",
    "SeasonalNaiveForecaster",
    "backtest",
    "get",
    "names",
    "register",
    "select",
]


def _as_array(series: Sequence[float] | np.ndarray) -> np.ndarray:
    a = np.asarray(series, dtype=float).ravel()
    if not np.all(np.isfinite(a)):
        raise FitError("series has non-finite values")
    return np.maximum(a, 0.0)


class SeasonalNaiveForecaster:
    """``y[t + h] = y[t + h - k * period]`` with the smallest k that reaches observed data."""

    name = "seasonal-naive"

    def __init__(self, period: int = 144) -> None:
        self.period = int(period)
        self._tail: np.ndarray | None = None

    def fit(self, series: Sequence[float] | np.ndarray) -> None:
        a = _as_array(series)
        if len(a) < self.period:
            raise FitError(f"seasonal-naive needs at least one period ({self.period}) of history, got {len(a)}")
        self._tail = a[-self.period :].copy()

    def update(self, values: Sequence[float] | np.ndarray) -> None:
        if self._tail is None:
            raise NotFittedError("seasonal-naive: not fitted")
        self._tail = np.concatenate([self._tail, _as_array(values)])[-self.period :]

    def predict(self, horizon: int) -> np.ndarray:
        if self._tail is None:
            raise NotFittedError("seasonal-naive: not fitted")
        idx = np.arange(horizon) % self.period
        return self._tail[idx].copy()


class HoltWintersForecaster:
    """Additive Holt-Winters with a damped trend on ``log1p`` values.

    Recursion (Hyndman & Athanasopoulos, *Forecasting: Principles and Practice*, 8.3 with
    damping): level ``l_t = a (y_t - s_{t-m}) + (1 - a)(l_{t-1} + phi b_{t-1})``, trend
    ``b_t = b (l_t - l_{t-1}) + (1 - b) phi b_{t-1}``, season ``s_t = g (y_t - l_{t-1} - phi
    b_{t-1}) + (1 - g) s_{t-m}``; forecast ``l + (phi + ... + phi^h) b + s_{t+h-m}``. statsmodels
    estimates ``a, b, g, phi`` and the initial states on the last ``fit_periods`` periods;
    ``update`` runs the same recursion with the estimates fixed.
    """

    name = "holt-winters"

    def __init__(self, period: int = 144, fit_periods: int = 14) -> None:
        self.period = int(period)
        self.fit_periods = fit_periods
        self._state: tuple[float, float, np.ndarray] | None = None
        self._coef: tuple[float, float, float, float] = (0.5, 0.0, 0.1, 0.9)

    def fit(self, series: Sequence[float] | np.ndarray) -> None:
        from statsmodels.tsa.holtwinters import ExponentialSmoothing

        a = _as_array(series)
        if len(a) < 2 * self.period + 2:
            raise FitError(f"holt-winters needs two periods ({2 * self.period}) of history, got {len(a)}")
        y = np.log1p(a[-self.fit_periods * self.period :])
        model = ExponentialSmoothing(
            y, trend="add", damped_trend=True, seasonal="add", seasonal_periods=self.period,
            initialization_method="estimated",
        )
        with warnings.catch_warnings():  # convergence chatter: the fit is still usable
            warnings.simplefilter("ignore")
            res = model.fit()
        p = res.params
        self._coef = (
            float(p["smoothing_level"]),
            float(p["smoothing_trend"]),
            float(p["smoothing_seasonal"]),
            float(p["damping_trend"]),
        )
        season = np.asarray(res.season, dtype=float)[-self.period :]
        self._state = (float(res.level[-1]), float(res.trend[-1]), season.copy())

    def update(self, values: Sequence[float] | np.ndarray) -> None:
        if self._state is None:
            raise NotFittedError("holt-winters: not fitted")
        a, b, g, phi = self._coef
        level, trend, season = self._state
        season = season.copy()
        for y in np.log1p(_as_array(values)):
            s_old = season[0]
            new_level = a * (y - s_old) + (1 - a) * (level + phi * trend)
            trend = b * (new_level - level) + (1 - b) * phi * trend
            new_s = g * (y - level - phi * trend) + (1 - g) * s_old
            level = new_level
            season = np.append(season[1:], new_s)
        self._state = (level, trend, season)

    def predict(self, horizon: int) -> np.ndarray:
        if self._state is None:
            raise NotFittedError("holt-winters: not fitted")
        _, _, _, phi = self._coef
        level, trend, season = self._state
        h = np.arange(1, horizon + 1)
        damp = np.cumsum(phi**h)
        y = level + damp * trend + season[(h - 1) % self.period]
        return np.maximum(np.expm1(y), 0.0)


class MSTLForecaster:
    """MSTL (statsmodels) seasonal parts + a damped Holt model of the adjusted series.

    ``log1p(y) = trend + sum_k seasonal_k + remainder``. Each seasonal part is forecast by
    its last cycle (phase-aligned); ``trend + remainder`` (the seasonally adjusted series) by
    Holt's damped trend: ``l_t = a x_t + (1 - a)(l_{t-1} + phi b_{t-1})``, ``b_t = b (l_t -
    l_{t-1}) + (1 - b) phi b_{t-1}``. ``update`` adjusts new values with the stored seasonal
    profiles and continues the Holt recursion.
    """

    name = "mstl"

    def __init__(self, period: int = 144, periods: Sequence[int] | None = None, fit_periods: int = 21) -> None:
        self.period = int(period)
        self.periods = tuple(periods) if periods is not None else (self.period, 7 * self.period)
        self.fit_periods = fit_periods
        self._profiles: list[np.ndarray] = []
        self._phase = 0  # index (since fit start) of the next value
        self._holt: tuple[float, float] | None = None
        self._coef = (0.5, 0.1, 0.9)

    def fit(self, series: Sequence[float] | np.ndarray) -> None:
        from statsmodels.tsa.holtwinters import ExponentialSmoothing
        from statsmodels.tsa.seasonal import MSTL

        a = _as_array(series)
        y = np.log1p(a[-self.fit_periods * self.period :])
        periods = [p for p in self.periods if 2 * p <= len(y)]
        if not periods:
            raise FitError(f"mstl needs two periods ({2 * min(self.periods)}) of history, got {len(y)}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = MSTL(y, periods=periods).fit()
        seasonal = np.asarray(res.seasonal, dtype=float).reshape(len(y), -1)
        self._profiles = []
        n = len(y)
        for k, p in enumerate(periods):
            # profile[j] is the seasonal value at phase j, phase = index mod p (index from 0 = fit start)
            last = seasonal[n - p :, k]
            prof = np.empty(p)
            prof[(np.arange(n - p, n)) % p] = last
            self._profiles.append(prof)
        self._periods_used = periods
        adjusted = y - seasonal.sum(axis=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hw = ExponentialSmoothing(
                adjusted, trend="add", damped_trend=True, initialization_method="estimated"
            ).fit()
        p = hw.params
        self._coef = (float(p["smoothing_level"]), float(p["smoothing_trend"]), float(p["damping_trend"]))
        self._holt = (float(hw.level[-1]), float(hw.trend[-1]))
        self._phase = n

    def _season(self, idx: np.ndarray) -> np.ndarray:
        total = np.zeros(len(idx))
        for prof, p in zip(self._profiles, self._periods_used, strict=True):
            total += prof[idx % p]
        return total

    def update(self, values: Sequence[float] | np.ndarray) -> None:
        if self._holt is None:
            raise NotFittedError("mstl: not fitted")
        a, b, phi = self._coef
        level, trend = self._holt
        v = np.log1p(_as_array(values))
        adj = v - self._season(np.arange(self._phase, self._phase + len(v)))
        for x in adj:
            new_level = a * x + (1 - a) * (level + phi * trend)
            trend = b * (new_level - level) + (1 - b) * phi * trend
            level = new_level
        self._holt = (level, trend)
        self._phase += len(v)

    def predict(self, horizon: int) -> np.ndarray:
        if self._holt is None:
            raise NotFittedError("mstl: not fitted")
        _, _, phi = self._coef
        level, trend = self._holt
        h = np.arange(1, horizon + 1)
        y = level + np.cumsum(phi**h) * trend + self._season(self._phase + h - 1)
        return np.maximum(np.expm1(y), 0.0)


# --------------------------------------------------------------------------------------------
# torch models
# --------------------------------------------------------------------------------------------


class _WindowModel:
    """Shared machinery of the torch forecasters: log + window-mean normalisation, training.

    A window of ``lookback`` log values is centred on its own mean (so the model learns shape,
    not level: RevIN-style), the model outputs ``max_horizon`` centred values, the mean is
    added back. Trained with Adam on MSE over windows cut from the history, fixed seed.
    """

    name = "window"

    def __init__(
        self,
        period: int = 144,
        lookback: int | None = None,
        max_horizon: int = 12,
        epochs: int = 8,
        batch_size: int = 128,
        lr: float = 3e-3,
        seed: int = 0,
        max_windows: int = 6000,
    ) -> None:
        self.period = int(period)
        self.lookback = int(lookback) if lookback is not None else 2 * self.period
        self.max_horizon = max_horizon
        self.epochs = epochs
        self.batch_size = batch_size
        self.lr = lr
        self.seed = seed
        self.max_windows = max_windows
        self._context: np.ndarray | None = None
        self._net: object | None = None

    def _build(self) -> object:
        raise NotImplementedError

    def fit(self, series: Sequence[float] | np.ndarray) -> None:
        import torch

        y = np.log1p(_as_array(series))
        need = self.lookback + self.max_horizon
        if len(y) < need + 8:
            raise FitError(f"{self.name} needs at least {need + 8} values of history, got {len(y)}")
        gen = torch.Generator().manual_seed(self.seed)
        torch.manual_seed(self.seed)
        net = self._build()
        assert isinstance(net, torch.nn.Module)
        starts = np.arange(0, len(y) - need + 1)
        if len(starts) > self.max_windows:  # the most recent windows: the regime that matters
            starts = starts[-self.max_windows :]
        windows = np.stack([y[s : s + need] for s in starts])
        x = torch.tensor(windows[:, : self.lookback], dtype=torch.float32)
        t = torch.tensor(windows[:, self.lookback :], dtype=torch.float32)
        mean = x.mean(dim=1, keepdim=True)
        x, t = x - mean, t - mean
        phase = torch.tensor((starts % self.period), dtype=torch.float32)
        opt = torch.optim.Adam(net.parameters(), lr=self.lr)
        n = len(x)
        net.train()
        for _ in range(self.epochs):
            perm = torch.randperm(n, generator=gen)
            for i in range(0, n, self.batch_size):
                idx = perm[i : i + self.batch_size]
                loss = torch.mean((net(x[idx], phase[idx]) - t[idx]) ** 2)
                opt.zero_grad()
                loss.backward()
                opt.step()
        net.eval()
        self._net = net
        self._context = y[-self.lookback :].copy()
        self._index = len(y)  # index of the next value since fit start: gives the phase

    def update(self, values: Sequence[float] | np.ndarray) -> None:
        if self._context is None:
            raise NotFittedError(f"{self.name}: not fitted")
        v = np.log1p(_as_array(values))
        self._context = np.concatenate([self._context, v])[-self.lookback :]
        self._index += len(v)

    def predict(self, horizon: int) -> np.ndarray:
        import torch

        if self._context is None or self._net is None:
            raise NotFittedError(f"{self.name}: not fitted")
        if horizon > self.max_horizon:
            raise ConfigError(f"{self.name} was built for horizons up to {self.max_horizon}, asked {horizon}")
        net = self._net
        assert isinstance(net, torch.nn.Module)
        x = torch.tensor(self._context[None, :], dtype=torch.float32)
        mean = x.mean(dim=1, keepdim=True)
        phase = torch.tensor([(self._index - self.lookback) % self.period], dtype=torch.float32)
        with torch.no_grad():
            out = (net(x - mean, phase) + mean)[0, :horizon].numpy()
        return np.maximum(np.expm1(out.astype(float)), 0.0)


def _moving_average(x: object, kernel: int) -> object:
    """Centred moving average along the last axis with edge replication (DLinear/FEDformer decomp)."""
    import torch

    assert isinstance(x, torch.Tensor)
    pad = (kernel - 1) // 2
    front = x[..., :1].repeat_interleave(pad, dim=-1)
    back = x[..., -1:].repeat_interleave(kernel - 1 - pad, dim=-1)
    xp = torch.cat([front, x, back], dim=-1)
    return xp.unfold(-1, kernel, 1).mean(dim=-1)


class DLinearForecaster(_WindowModel):
    """DLinear: ``x = trend + seasonal`` (moving average of ``kernel``); ``y = W_t trend + W_s seasonal``."""

    name = "dlinear"

    def __init__(self, period: int = 144, kernel: int = 25, **kw: object) -> None:
        self.kernel = kernel
        super().__init__(period=period, **kw)  # type: ignore[arg-type]

    def _build(self) -> object:
        import torch

        lookback, horizon, kernel = self.lookback, self.max_horizon, self.kernel

        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.trend = torch.nn.Linear(lookback, horizon)
                self.seasonal = torch.nn.Linear(lookback, horizon)

            def forward(self, x: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
                trend = _moving_average(x, kernel)
                assert isinstance(trend, torch.Tensor)
                return self.trend(trend) + self.seasonal(x - trend)

        return Net()


class FEDformerForecaster(_WindowModel):
    """Compact FEDformer (frequency-enhanced decomposed transformer), per Kale section 3.2.

    * decomposition: ``x = trend + seasonal`` by a moving average (FEDformer's MOEDecomp with
      one kernel);
    * embedding: the seasonal value (1 -> d_model), a learned positional embedding, and the
      time of day (sin/cos of the phase in ``period``): FEDformer's token + temporal embedding;
    * encoder layer: frequency-enhanced block (FEB-f): rFFT over time, keep a fixed random set
      of ``modes`` frequencies (always including the lowest), multiply each by a learned
      complex ``d_model x d_model`` matrix, inverse FFT; residual, decomposition (the trend it
      removes is dropped, as FEDformer's encoder does), feed-forward, residual, decomposition;
    * decoder: a linear map over time (lookback -> horizon) of the encoded seasonal part and a
      linear projection d_model -> 1, plus a linear map of the trend (FEDformer accumulates the
      trend in the decoder; a linear trend head is the compact equivalent).
    """

    name = "fedformer"

    def __init__(
        self, period: int = 144, d_model: int = 16, modes: int = 32, kernel: int = 25, **kw: object
    ) -> None:
        self.d_model = d_model
        self.modes = modes
        self.kernel = kernel
        kw.setdefault("epochs", 6)
        super().__init__(period=period, **kw)  # type: ignore[arg-type]

    def _build(self) -> object:
        import torch

        lookback, horizon, kernel, d, period = self.lookback, self.max_horizon, self.kernel, self.d_model, self.period
        n_freq = lookback // 2 + 1
        rng = np.random.default_rng(self.seed)
        k = min(self.modes, n_freq)
        chosen = np.sort(np.concatenate([[0, 1], rng.choice(np.arange(2, n_freq), size=max(k - 2, 0), replace=False)]))
        index = torch.tensor(chosen[:k], dtype=torch.long)

        def decomp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # x: (B, L, d): moving average along time
            trend = _moving_average(x.transpose(1, 2), kernel)
            assert isinstance(trend, torch.Tensor)
            trend = trend.transpose(1, 2)
            return x - trend, trend

        class FourierBlock(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                scale = 1.0 / (d * d)
                self.w_re = torch.nn.Parameter(scale * torch.rand(len(index), d, d))
                self.w_im = torch.nn.Parameter(scale * torch.rand(len(index), d, d))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                spec = torch.fft.rfft(x, dim=1)  # (B, F, d)
                sel = spec[:, index, :]  # (B, k, d)
                w = torch.complex(self.w_re, self.w_im)  # (k, d, d)
                mixed = torch.einsum("bki,kio->bko", sel, w)
                out = torch.zeros_like(spec)
                out[:, index, :] = mixed
                return torch.fft.irfft(out, n=x.shape[1], dim=1)

        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = torch.nn.Linear(3, d)
                self.pos = torch.nn.Parameter(0.02 * torch.randn(lookback, d))
                self.feb = FourierBlock()
                self.ff = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))
                self.time_head = torch.nn.Linear(lookback, horizon)
                self.out = torch.nn.Linear(d, 1)
                self.trend_head = torch.nn.Linear(lookback, horizon)

            def forward(self, x: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
                trend = _moving_average(x, kernel)
                assert isinstance(trend, torch.Tensor)
                seasonal = x - trend
                steps = phase[:, None] + torch.arange(lookback, dtype=torch.float32)[None, :]
                angle = 2 * math.pi * steps / period
                tokens = torch.stack([seasonal, torch.sin(angle), torch.cos(angle)], dim=-1)
                h = self.embed(tokens) + self.pos
                h, _ = decomp(h + self.feb(h))
                h, _ = decomp(h + self.ff(h))
                s = self.time_head(h.transpose(1, 2)).transpose(1, 2)  # (B, H, d)
                return self.out(s)[..., 0] + self.trend_head(trend)

        return Net()


# --------------------------------------------------------------------------------------------
# registry, backtest, selection
# --------------------------------------------------------------------------------------------

_REGISTRY: dict[str, Callable[..., Forecaster]] = {
    "seasonal-naive": SeasonalNaiveForecaster,
    "holt-winters": HoltWintersForecaster,
    "mstl": MSTLForecaster,
    "dlinear": DLinearForecaster,
    "fedformer": FEDformerForecaster,
}


def register(name: str, factory: Callable[..., Forecaster]) -> None:
    _REGISTRY[name] = factory


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str, **kwargs: object) -> Forecaster:
    """A fresh forecaster by name; ``kwargs`` go to its constructor (``period=144`` ...)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown forecaster {name!r}; known: {', '.join(names())}") from None
    return factory(**kwargs)


@dataclass(frozen=True)
class BacktestResult:
    """Rolling-origin errors: ``mape`` over every forecast value of every origin (percent),
    ``mape_last`` over the last step of each horizon only, ``n_origins`` forecasts made."""

    name: str
    horizon: int
    mape: float
    mape_last: float
    n_origins: int
    forecasts: np.ndarray  # (n_origins, horizon)
    actuals: np.ndarray


def backtest(
    forecaster: Forecaster,
    series: Sequence[float] | np.ndarray,
    train_end: int,
    horizon: int,
    step: int = 1,
    refit_every: int | None = None,
    refit_window: int | None = None,
) -> BacktestResult:
    """Fit on ``series[:train_end]``, then at origins ``train_end, train_end + step, ...`` forecast
    ``horizon`` values and compare with what came; ``update`` with the values in between.

    ``refit_every`` (values) refits on everything seen so far (or its last ``refit_window``).
    Zero actual values are left out of MAPE (it is undefined there).
    """
    a = _as_array(series)
    if not 0 < train_end <= len(a) - horizon:
        raise ConfigError(f"train_end must leave at least one horizon of {horizon} values to test")
    forecaster.fit(a[:train_end] if refit_window is None else a[max(0, train_end - refit_window) : train_end])
    last_fit = train_end
    preds, acts = [], []
    origin = train_end
    while origin + horizon <= len(a):
        if refit_every is not None and origin - last_fit >= refit_every:
            lo = 0 if refit_window is None else max(0, origin - refit_window)
            forecaster.fit(a[lo:origin])
            last_fit = origin
        preds.append(forecaster.predict(horizon))
        acts.append(a[origin : origin + horizon])
        nxt = origin + step
        forecaster.update(a[origin : min(nxt, len(a))])
        origin = nxt
    p, t = np.array(preds), np.array(acts)
    mask = t > 0
    mape = float(np.mean(np.abs(p[mask] - t[mask]) / t[mask]) * 100)
    last_mask = mask[:, -1]
    mape_last = float(np.mean(np.abs(p[last_mask, -1] - t[last_mask, -1]) / t[last_mask, -1]) * 100)
    return BacktestResult(forecaster.name, horizon, mape, mape_last, len(p), p, t)


def select(
    candidates: Sequence[str],
    series: Sequence[float] | np.ndarray,
    horizon: int,
    validation: int,
    step: int = 1,
    **kwargs: object,
) -> tuple[str, dict[str, float]]:
    """Pick the candidate with the lowest rolling-backtest MAPE on the last ``validation`` values.

    Each candidate is fitted on everything before the validation part and rolled through it.
    Returns the winner's name and every candidate's MAPE. A candidate that cannot fit (history
    too short) is skipped; if none fits, FitError.
    """
    a = _as_array(series)
    if validation + horizon > len(a) - 1:
        raise FitError(f"validation part ({validation}) too long for a series of {len(a)}")
    scores: dict[str, float] = {}
    for name in candidates:
        try:
            res = backtest(get(name, **kwargs), a, len(a) - validation, horizon, step=step)
        except FitError:
            continue
        scores[name] = res.mape
    if not scores:
        raise FitError("no forecaster could be fitted on this history")
    best = min(scores, key=lambda k: scores[k])
    return best, scores
