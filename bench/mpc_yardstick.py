"""What knowing the traffic is worth (issue 22): kale, and a planner that optimizes over its
forecast, each given a perfect forecast and a causal one.

    .venv/bin/python bench/mpc_yardstick.py [--split tune] [--traces volume-like,volume-like-1]
        [--migrations restart] [--caps 300,450,525,600] [--penalty 50] [--horizon-s 7200] [--procs 2]
    .venv/bin/python bench/mpc_yardstick.py --traces wc98-w1,diurnal-p3 --migrations seamless
        --lag-prices 10,15,25 [--forecasts seasonal,perfect] [--horizon-s 3600] [--grid 8] [--days 1]

Where kale misses its worker-hour target, ``bench/brain_robustness.py`` prints what a schedule
that knew the traffic needs (``tidal.sim.paid_bound.lag_priced_worker_hours``). This asks where
the gap lies: in what kale does with what it knows, or in what it cannot know. Rows per trace:

* ``kale``: as ``tidal sim online`` runs it;
* ``kale, perfect forecast``: the same planner given each planning bin's true mean arrival rate
  (``PerfectBins``) from the first interval on, never off track;
* ``mpc, cap C s``: ``ForecastMPC`` with the traffic's mean over the last hour as its forecast,
  flat (causal);
* ``mpc, perfect, cap C s``: the same given the true arrivals and throughput noise ahead.

With ``--lag-prices`` the rows are kale and ``LagPricedMPC`` at each price and forecast instead:
the strict reading of the lag target (0.35x hpa's accumulated lag on every trace, also where hpa
keeps the SLO) asks for a few minutes of lag for few spare workers, and the question is whether a
program that prices the lag over a forecast reaches that corner where kale's settings do not.

``ForecastMPC`` is a receding-horizon rule, not a planner: it is given the job's true throughput
model. After each interval (no action under way) it solves a dynamic program over the next
``horizon_s``: states are (workers, samples waiting on a grid of half a worker-interval); each
interval it keeps its count or starts an action to any count (the action's intervals train
nothing and are paid at the larger count); the cost is worker-intervals, plus ``penalty``
worker-intervals for each interval that ends with a sample older than the cap (FIFO over the
arrivals so far and the forecast), plus what still waits at the horizon (in worker-intervals to
train it). It takes the first decision. The cap trades lag for workers, as kale's margins do.

Prints worker-hours over the LP bound, SLO violation, accumulated lag over hpa's and actions. A
5-minute trace takes a few seconds a row; a week of minutes is slow (a longer program each
minute) and not what this is for.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from brain_robustness import chosen_runs, policy_rows, print_policy_rows, seconds_within_slo, traces

from tidal.api import JobObservation, ResourcePlan
from tidal.brain import forecast as forecasting
from tidal.brain.lag_program import count_range, solve
from tidal.sim import online as sim
from tidal.sim.paid_bound import action_phases

MEAN_WINDOW_S = 3600.0  # the causal forecast: the mean arrival rate of the last hour, flat
GRID = 2.0  # grid steps of samples waiting per worker-interval
DAY_S = 86400.0
SMOOTH = 15  # intervals of yesterday's traffic averaged in the seasonal forecast


class PerfectBins:
    """A forecaster that knows the future: ``bins`` are the true mean rates of every planning bin
    of the run (history included); it forecasts from the bin after the last one it was given."""

    name = "perfect"

    def __init__(self, bins: np.ndarray) -> None:
        self.bins = bins
        self.seen = 0

    def fit(self, series: Any) -> None:
        self.seen = len(series)

    def update(self, values: Any) -> None:
        self.seen += len(values)

    def predict(self, horizon: int) -> np.ndarray:
        ahead = self.bins[self.seen : self.seen + horizon]
        if len(ahead) < horizon:  # past the end of the run: its last bin, held
            ahead = np.concatenate([ahead, np.full(horizon - len(ahead), self.bins[-1])])
        return ahead


class RecedingHorizon:
    """What the yardstick's programs share: the arrivals as observed, and a decision (``_decide``:
    the first of a program over what lies ahead) after each interval with no action under way."""

    name = "mpc"
    arrivals: list[float]
    target: int | None = None

    def plan(self, obs: JobObservation) -> ResourcePlan:
        stream = obs.stream
        assert stream is not None
        self.arrivals.extend(map(float, stream.arrivals))
        if self.target is None:
            self.target = obs.current_workers
        if obs.ready and self.arrivals:
            self.target = self._decide(obs.current_workers, stream.backlog, obs.max_workers)
        return ResourcePlan(workers=self.target, reason=self.name)

    def _decide(self, w0: int, backlog: float, most: int) -> int:
        raise NotImplementedError


class ForecastMPC(RecedingHorizon):
    """The yardstick's receding-horizon rule (module docstring). ``throughput[w]``: w workers'
    true samples/s; ``truth`` and ``noise``: the run's arrivals and throughput noise per interval,
    given for the perfect variant (None: the causal forecast)."""

    def __init__(self, throughput: list[float], dt: float, action_intervals: int, cap_s: float, horizon: int,
                 penalty: float, truth: np.ndarray | None = None, noise: np.ndarray | None = None) -> None:
        self.throughput = np.asarray(throughput, dtype=float)
        self.dt, self.action, self.cap_s, self.horizon, self.penalty = dt, action_intervals, cap_s, horizon, penalty
        self.truth, self.noise = truth, noise
        self.arrivals = []  # per interval of the window, as observed

    def _ahead(self) -> tuple[np.ndarray, np.ndarray]:
        """Arrivals and throughput noise per interval over the horizon."""
        h, now = self.horizon, len(self.arrivals)
        if self.truth is not None and self.noise is not None:
            a, n = self.truth[now : now + h], self.noise[now : now + h]
            pad = h - len(a)
            return np.concatenate([a, np.full(pad, a[-1] if len(a) else self.arrivals[-1])]), np.concatenate([n, np.ones(pad)])
        k = max(1, round(MEAN_WINDOW_S / self.dt))
        recent = self.arrivals[-k:]
        return np.full(h, sum(recent) / len(recent)), np.ones(h)

    def _decide(self, w0: int, backlog: float, most: int) -> int:
        ahead, noise = self._ahead()
        h, a_int, dt = self.horizon, self.action, self.dt
        counts = np.arange(1, min(most, max(w0 + 2, int(np.searchsorted(self.throughput, 1.5 * ahead.max() / dt)) + 2)) + 1)
        unit = self.throughput[1] * dt / GRID  # samples per grid step
        # the most that may wait at the end of each interval ahead: what arrived within the cap before it
        k = self.cap_s / dt
        series = np.concatenate([np.asarray(self.arrivals[-math.ceil(k) - 1 :]), ahead])
        cum = np.concatenate([[0.0], np.cumsum(series)])
        ends = len(series) - h + np.arange(1, h + 1)
        cap = np.floor((cum[ends] - np.interp(ends - k, np.arange(len(cum)), cum)) / unit).astype(int)
        width = int(max(cap.max(), backlog / unit) + 2)
        steps = np.arange(width)
        arrive = ahead / unit
        train = self.throughput[counts][:, None] * noise[None, :] * dt / unit  # (counts, h)
        rows = np.arange(len(counts))
        value = np.empty((h + 1, len(counts), width))
        value[h] = steps[None, :] / GRID  # what still waits, in worker-intervals to train it
        keep = moves = np.empty(0)
        for t in range(h - 1, -1, -1):
            nxt = np.maximum(0, np.floor(steps[None, :] + arrive[t] - train[:, t : t + 1])).astype(int)
            keep = counts[:, None] + value[t + 1][rows[:, None], np.minimum(nxt, width - 1)] + self.penalty * (nxt > cap[t])
            value[t] = keep
            if t + a_int <= h:  # always at t = 0: the horizon is longer than an action
                grown = np.floor(np.cumsum(arrive[t : t + a_int])).astype(int)
                over = ((steps[None, :] + grown[:, None]) > cap[t : t + a_int, None]).sum(axis=0)
                after = value[t + a_int][:, np.minimum(steps + grown[-1], width - 1)] + self.penalty * over[None, :]
                paid = np.maximum(counts[:, None], counts[None, :]) * a_int  # (old, new)
                moves = paid[:, :, None] + after[None, :, :]
                moves[rows, rows, :] = np.inf  # to the same count is no action
                value[t] = np.minimum(keep, moves.min(axis=1))
        if w0 > counts[-1]:
            return w0
        # the first decision, read from the program's first interval at the state now
        b = min(int(backlog / unit), width - 1)
        act = moves[w0 - 1, :, b]
        j = int(np.argmin(act))
        return int(counts[j]) if act[j] < keep[w0 - 1, b] - 1e-9 else w0


class LagPricedMPC(RecedingHorizon):
    """A receding-horizon program that prices the accumulated lag (Kale Eq. 11) rather than capping
    a sample's age: after each interval with no action under way it minimizes, over the next
    ``horizon`` intervals, worker-intervals plus ``price`` per lag-minute, and takes the first
    decision. Like ``ForecastMPC`` it is given the job's true throughput model; unlike it, an
    action's intervals are the simulator's (``tidal.sim.paid_bound.action_phases``: a seamless move
    trains at the old count while the joiners start, pauses, then trains at the new count; paid at
    ``max(old, new)`` until the hand-over), and the samples waiting are a continuous state, the
    value between grid points (``grid`` a mean interval's arrivals) interpolated linearly, so no
    rounding flatters a count that falls slowly behind.

    Forecasts: ``seasonal`` (causal): yesterday's arrivals at the same intervals, averaged over
    ``SMOOTH`` intervals, times the last hour's mean over yesterday's at that hour (clipped to
    [0.5, 2]); the last hour's mean, flat, until a day of arrivals is held. ``perfect``: the true
    arrivals and throughput noise ahead.
    """

    name = "mpc-lag"

    def __init__(self, cfg: sim.SimConfig, throughput: list[float], price: float, horizon: int,
                 history: np.ndarray, forecast: str, grid: int = 8, truth: np.ndarray | None = None,
                 noise: np.ndarray | None = None) -> None:
        out, into = action_phases(cfg, scale_out=True), action_phases(cfg, scale_out=False)
        if out != into:
            raise ValueError("LagPricedMPC needs a migration that costs the same both ways")
        if forecast not in ("seasonal", "perfect") or (forecast == "perfect" and (truth is None or noise is None)):
            raise ValueError(f"forecast must be 'seasonal', or 'perfect' with the truth, got {forecast!r}")
        self.dt, self.throughput = cfg.interval_s, np.asarray(throughput, dtype=float)
        self.price, self.horizon, self.forecast, self.grid = price, horizon, forecast, grid
        self.truth, self.noise = truth, noise
        self.arrivals = [float(x) for x in history]  # per interval: the history, then what was observed
        self.seen_history = len(self.arrivals)
        self.phases = out
        self.overlap = sim.MIGRATIONS[cfg.migration].both_before_handover
        self.hour = max(1, round(3600.0 / self.dt))
        self.day = max(1, round(DAY_S / self.dt))

    def _ahead(self) -> tuple[np.ndarray, np.ndarray]:
        """Arrivals and throughput noise per interval over the horizon."""
        h, past = self.horizon, np.asarray(self.arrivals)
        if self.forecast == "perfect":
            assert self.truth is not None and self.noise is not None
            now = len(past) - self.seen_history
            a, n = self.truth[now : now + h], self.noise[now : now + h]
            pad = h - len(a)
            return np.concatenate([a, np.full(pad, past[-1])]), np.concatenate([n, np.ones(pad)])
        hour, day, now = self.hour, self.day, len(past)
        if now < day + hour:
            return np.full(h, past[-hour:].mean()), np.ones(h)
        yesterday = np.convolve(past[now - day - hour : now - day + h + SMOOTH], np.ones(SMOOTH) / SMOOTH, mode="same")
        level = float(np.clip(past[-hour:].mean() / max(yesterday[:hour].mean(), 1e-9), 0.5, 2.0))
        return yesterday[hour : hour + h] * level, np.ones(h)

    def _decide(self, w0: int, backlog: float, most: int) -> int:
        ahead, noise = self._ahead()
        lo, hi = count_range(self.throughput, self.dt, w0, ahead, most)
        if not lo <= w0 <= hi:
            return w0
        policy = solve(self.throughput, self.dt, self.phases, self.overlap, self.price * self.dt / 60.0,
                       np.asarray(self.arrivals[-self.hour :]), ahead, backlog, lo, hi, self.grid, noise)
        return policy.decide(0, w0, backlog)


def run(trace: str, migration: str, split: str, caps: list[float], penalty: float, horizon_s: float,
        lag_prices: list[float], forecasts: list[str], grid: int, days: float | None = None) -> list[dict[str, Any]]:
    window, history, interval = traces(split)[trace]()
    if days is not None:  # score the window's first days only (its history unchanged)
        window = window[: max(1, round(days * DAY_S / interval))]
    cfg = sim.SimConfig(migration=migration, interval_s=interval)
    scaled = sim.scale_to_peak(window, cfg)
    factor = float(scaled.max() / window.max())
    mig = sim.MIGRATIONS[migration]
    throughput = [sim.true_throughput(cfg, w) for w in range(cfg.peak_workers + 1)]
    noise = sim.throughput_noise(cfg, len(scaled))
    action = math.ceil((mig.prep_s + mig.pause_s) / interval)
    horizon = max(action + 1, round(horizon_s / interval))
    if lag_prices:  # the strict lag reading: kale, hpa and the lag-priced program
        top = [sim.true_throughput(cfg, w) for w in range(2 * cfg.peak_workers + 1)]
        priced: dict[str, Any] = {"kale": sim.planner_factory("kale", cfg, mig), "hpa": sim.planner_factory("hpa", cfg, mig)}
        for fc in forecasts:
            for price in lag_prices:
                priced[f"mpc-lag, {fc}, {price:g} per lag-min"] = lambda fc=fc, price=price: LagPricedMPC(
                    cfg, top, price, horizon, history * factor, fc, grid, truth=scaled, noise=noise)
        res = sim.simulate(scaled, priced, cfg, history=history * factor)
        return policy_rows(trace, migration, res, sim.oracle_worker_hours(scaled, cfg))
    # kale's planning bins over the whole run, history first, as KalePlanner forms them
    per_bin = max(1, round(sim.planner_factory("kale", cfg, mig)().plan_interval_s / interval))
    series = np.concatenate([history * factor, scaled])
    whole = len(series) // per_bin * per_bin
    bins = series[:whole].reshape(-1, per_bin).mean(axis=1) / interval
    forecasting.register(f"perfect:{trace}", lambda **_: PerfectBins(bins))
    policies: dict[str, Any] = {
        "kale": sim.planner_factory("kale", cfg, mig),
        "kale, perfect forecast": sim.planner_factory("kale", cfg, mig, forecaster=f"perfect:{trace}",
                                                      min_history_bins=1, track_error=None),
        "hpa": sim.planner_factory("hpa", cfg, mig),
    }
    for cap in caps:
        policies[f"mpc, cap {cap:g} s"] = lambda cap=cap: ForecastMPC(throughput, interval, action, cap, horizon, penalty)
        policies[f"mpc, perfect, cap {cap:g} s"] = lambda cap=cap: ForecastMPC(
            throughput, interval, action, cap, horizon, penalty, truth=scaled, noise=noise)
    res = sim.simulate(scaled, policies, cfg, history=history * factor)
    bound = sim.oracle_worker_hours(scaled, cfg)
    return policy_rows(trace, migration, res, bound)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", default="tune", choices=["eval", "tune"])
    ap.add_argument("--traces", default=",".join(["volume-like"] + [f"volume-like-{k}" for k in range(1, 6)]),
                    help="comma-separated (brain_robustness.traces)")
    ap.add_argument("--migrations", default="restart")
    ap.add_argument("--caps", default="300,450,525,600", help="seconds a sample may wait before the penalty, each below the SLO")
    ap.add_argument("--penalty", type=float, default=50.0, help="worker-intervals per interval past the cap")
    ap.add_argument("--horizon-s", type=float, default=7200.0, help="how far ahead the program looks")
    ap.add_argument("--lag-prices", default="",
                    help="comma-separated worker-intervals per lag-minute: run LagPricedMPC at each instead of the caps")
    ap.add_argument("--forecasts", default="seasonal", help="LagPricedMPC's forecasts: seasonal (causal), perfect")
    ap.add_argument("--grid", type=int, default=8, help="LagPricedMPC's grid steps per mean interval of arrivals")
    ap.add_argument("--days", type=float, default=None,
                    help="score only the first DAYS of each window (default: all of it); a week of minutes at a "
                         "horizon of hours takes about 20 min a program")
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    runs = chosen_runs(args.split, args.traces, args.migrations)
    caps = seconds_within_slo(args.caps, "--caps")
    if not args.penalty > 0 or not args.horizon_s > 0:
        sys.exit("--penalty and --horizon-s must be positive")
    try:
        lag_prices = [float(v) for v in args.lag_prices.split(",") if v]
    except ValueError:
        sys.exit(f"--lag-prices: comma-separated numbers, got {args.lag_prices!r}")
    forecasts = [v for v in args.forecasts.split(",") if v]
    if args.days is not None and not args.days > 0:
        sys.exit(f"--days must be positive, got {args.days:g}")
    if any(not v > 0 for v in lag_prices) or not forecasts or set(forecasts) - {"seasonal", "perfect"} or args.grid < 1:
        sys.exit("--lag-prices must be positive, --forecasts seasonal and/or perfect, --grid at least 1")
    with ProcessPoolExecutor(max_workers=args.procs) as pool:
        jobs = [pool.submit(run, t, m, args.split, caps, args.penalty, args.horizon_s, lag_prices, forecasts, args.grid,
                            args.days) for t, m in runs]
        print_policy_rows(job.result for job in jobs)


if __name__ == "__main__":
    main()
