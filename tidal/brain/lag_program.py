"""The accumulated lag (Kale Eq. 11) priced against workers over hours of forecast.

Kale sizes each planning bin by Eq. 10 (the fewest workers whose throughput passes the forecast):
its workers run 95-98% busy and every scaling action's pause becomes lag. A job that wants a few
minutes of lag for few spare workers needs a planner that sees a whole ramp, up and down, and
pays each action's pause where it falls. ``solve`` is that planner's program: a dynamic program
over the next ``horizon`` intervals whose states are (workers, samples waiting), minimizing

    sum over intervals of  w(t) * dt  +  price * lag(t) * dt           (worker-minutes)

where ``lag(t)`` is the age of the oldest waiting sample at the end of interval t (first in,
first out over the arrivals so far and the forecast), Eq. 11's integrand, plus what still waits
at the horizon (the worker-minutes to train it). Each interval the job keeps its count or starts
an action to any count; an action's intervals (``action_phases``) train at the old count until
its pause, nothing during it, then at the new count, and are paid at ``max(old, new)`` until the
hand-over and at the new count after it. The samples waiting are a continuous state: the value
between grid points is interpolated linearly, so no rounding flatters a count that falls
slowly behind.

The program's answer is a ``Policy``: for every interval of the horizon in which an action
started would end within it, and every state, whether to keep the count or the count to move
to. A planner solves once per forecast and reads the policy at the state it is in until the
next one (the program is closed-loop over its horizon; its forecast, not its state, goes
stale).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SLO_PENALTY", "ActionPhase", "Policy", "action_phases", "count_range", "oldest_age", "solve"]

SLO_PENALTY = 60.0  # worker-minutes per minute that ends past the SLO: an hour of a worker
LAG_WIDTH_INTERVALS = 12  # samples waiting the program considers: up to this many peak intervals of arrivals


@dataclass(frozen=True)
class ActionPhase:
    """One interval of a scaling action: the share of it trained, by the new workers or the old,
    and the share of it paid at the count held before the hand-over."""

    train: float
    new: bool  # trained by the new count; else by the old count
    before: float  # share paid at the count before the hand-over (the old, or max(old, new) with overlap)


def action_phases(prep_s: float, pause_s: float, interval_s: float,
                  before_share: Callable[[float, float], float]) -> list[ActionPhase]:
    """The intervals after a decision that starts an action of ``prep_s`` (the old workers still
    train) then ``pause_s`` (nothing trains): it ends in the first interval whose end is at or
    past both, trained and paid there at the new count. ``before_share(since_s, span_s)``: the
    share of ``span_s`` seconds from ``since_s`` after the decision that falls before the
    hand-over."""
    dt = interval_s
    length = max(1, math.ceil((prep_s + pause_s) / dt - 1e-9))
    out = []
    for i in range(1, length + 1):
        lo, hi = (i - 1) * dt, i * dt
        paused = max(0.0, min(hi, prep_s + pause_s) - max(lo, prep_s))
        before = 0.0 if i == length else before_share(lo, dt)
        out.append(ActionPhase(train=(dt - paused) / dt, new=i == length, before=before))
    return out


def oldest_age(cum: np.ndarray, arrivals: np.ndarray, consumed: np.ndarray, now: float | np.ndarray,
               dt: float) -> np.ndarray:
    """The age at ``now`` of the next sample to train once ``consumed`` samples of ``arrivals``
    (per interval of ``dt`` seconds, ``cum`` their cumulative sum from 0) have been trained,
    arrivals spread evenly within each interval; many ``consumed`` at once."""
    j = np.clip(np.searchsorted(cum, consumed, side="right") - 1, 0, len(arrivals) - 1)
    per = arrivals[j]
    frac = np.divide(consumed - cum[j], per, out=np.zeros_like(consumed), where=per > 0)
    return np.maximum(0.0, now - (j + frac) * dt)


@dataclass
class Policy:
    """``solve``'s answer: per interval ``k`` from the solve (while an action started then ends
    within the horizon), per count row and grid column of samples waiting, the value of keeping
    the count (``keep``), of the best action (``move``) and its count's row (``to``)."""

    counts: np.ndarray
    unit: float  # samples per grid column
    keep: np.ndarray  # (k, counts, columns)
    move: np.ndarray
    to: np.ndarray

    def covers(self, k: int, workers: int) -> bool:
        return 0 <= k < len(self.keep) and int(self.counts[0]) <= workers <= int(self.counts[-1])

    def decide(self, k: int, workers: int, backlog: float) -> int:
        """The count to hold (``workers``: keep) ``k`` intervals after the solve, with
        ``backlog`` samples waiting: the values of keeping and of the best action interpolated
        between grid columns, the action's count that of the nearer column where it has one."""
        r = workers - int(self.counts[0])
        width = self.keep.shape[-1]
        x = min(max(backlog / self.unit, 0.0), width - 1.0)
        lo = int(x)
        hi, share = min(lo + 1, width - 1), x - lo
        keep = self.keep[k, r, lo] * (1 - share) + self.keep[k, r, hi] * share
        move = self.move[k, r, lo] * (1 - share) + self.move[k, r, hi] * share
        if not move < keep - 1e-6:
            return workers
        near, far = (lo, hi) if share < 0.5 else (hi, lo)
        j = int(self.to[k, r, near]) if self.to[k, r, near] >= 0 else int(self.to[k, r, far])
        return workers if j < 0 else int(self.counts[j])


def count_range(throughput: Sequence[float] | np.ndarray, interval_s: float, workers: int, ahead: np.ndarray,
                most: int) -> tuple[int, int]:
    """The counts worth a program's states: from one below the fewest that train 0.8x the least
    interval ahead (or ``workers``, if fewer) to one above those that train 1.3x the most (or
    ``workers``, if more), within ``most`` and the counts ``throughput`` covers."""
    f = np.asarray(throughput, dtype=float) * interval_s
    most = min(most, len(f) - 1)
    lo = max(1, min(workers, int(np.searchsorted(f, 0.8 * float(np.min(ahead))))) - 1)
    hi = min(most, max(workers, int(np.searchsorted(f, 1.3 * float(np.max(ahead)))) + 1) + 1)
    return lo, hi


def solve(throughput: Sequence[float] | np.ndarray, interval_s: float, phases: Sequence[ActionPhase],
          overlap: bool, price: float, past: np.ndarray, ahead: np.ndarray, backlog: float, lo: int, hi: int,
          grid: int = 8, noise: np.ndarray | None = None, slo_s: float | None = None,
          slo_penalty: float = SLO_PENALTY) -> Policy:
    """The program of the module docstring for counts ``lo``..``hi``.

    ``throughput[w]``: samples/s of w workers (believed), defined up to ``hi``; ``phases``: an
    action's intervals (the same both ways), paid at ``max(old, new)`` before the hand-over where
    ``overlap`` (else at the old count); ``price``: worker-minutes per lag-minute; ``past``: the
    arrivals of the last intervals (an hour suffices: the oldest waiting sample is looked up in
    them), ``ahead``: the forecast arrivals per interval over the horizon (its length); ``backlog``:
    samples waiting now (sizes the grid); ``grid``: columns per mean interval of arrivals ahead;
    ``noise``: the throughput's factor per interval ahead (a yardstick's perfect information; None: 1);
    ``slo_s``: where given, each interval that ends with a sample older than that costs
    ``slo_penalty`` worker-minutes a minute more (the lag's price is linear in the age; an SLO is a
    threshold, and a low price alone let a restart's lag pass it).
    """
    f = np.asarray(throughput, dtype=float)
    ahead = np.asarray(ahead, dtype=float)
    h, dt = len(ahead), interval_s
    length = len(phases)
    if h <= length:
        raise ValueError(f"the horizon ({h} intervals) must be longer than an action ({length})")
    counts = np.arange(lo, hi + 1)
    rows = np.arange(len(counts))
    unit = max(float(ahead.mean()), float(f[1]) * dt) / grid
    # samples waiting the grid holds (more are clipped to its last column): 12 peak intervals, and
    # with an SLO a quarter more than the arrivals of its bound, so that its last column is past it
    held_intervals = max(LAG_WIDTH_INTERVALS, 0.0 if slo_s is None else 1.25 * slo_s / dt)
    width = math.ceil(max(held_intervals * ahead.max(), backlog + ahead.max()) / unit) + 2
    steps = np.arange(width, dtype=float)
    # lag-minutes each interval ahead adds (times the price, in worker-minutes) with x columns waiting at its end
    series = np.concatenate([np.asarray(past, dtype=float), ahead])
    cum = np.concatenate([[0.0], np.cumsum(series)])
    ends = len(series) - h + 1 + np.arange(h)[:, None]  # (h, 1): each interval's end, in intervals of the series
    ages = oldest_age(cum, series, np.maximum(cum[ends] - steps[None, :] * unit, 0.0), ends * dt, dt)
    minutes = dt / 60.0
    lag = np.where(steps[None, :] > 0, ages, 0.0) / 60.0 * minutes * price  # (h, width)
    if slo_s is not None:  # an interval that ends past the SLO costs slo_penalty worker-minutes a minute
        lag += np.where(ages > slo_s, slo_penalty * minutes, 0.0)
    arrive = ahead / unit
    trains = f[counts][:, None] * (np.ones(h) if noise is None else np.asarray(noise, dtype=float))[None, :] * dt / unit
    old_phases = [p for p in phases if not p.new]
    new_phases = [p for p in phases if p.new]
    held = np.maximum(counts[:, None], counts[None, :]) if overlap else np.repeat(counts[:, None], len(counts), 1)
    paid = np.zeros((len(counts), len(counts)))  # (old, new): worker-minutes an action's intervals hold
    for phase in phases:
        paid += (phase.before * held + (1 - phase.before) * counts[None, :]) * minutes
    n_decide = h - length + 1
    keep_t = np.empty((n_decide, len(counts), width), dtype=np.float32)
    move_t = np.empty_like(keep_t)
    to_t = np.empty((n_decide, len(counts), width), dtype=np.int16)
    value = np.empty((h + 1, len(counts), width))
    value[h] = steps[None, :] * unit / (f[counts][:, None] * dt) * minutes  # what still waits: the minutes to train it
    for t in range(h - 1, -1, -1):
        nxt = np.clip(steps[None, :] + arrive[t] - trains[:, t : t + 1], 0, width - 1)
        keep = counts[:, None] * minutes + _between(lag[t], None, nxt) + _between(value[t + 1], rows[:, None], nxt)
        value[t] = keep
        if t + length <= h:  # an action started now ends within the horizon
            x = np.broadcast_to(steps[None, :], keep.shape)
            cost = np.zeros(keep.shape)
            i = t
            for phase in old_phases:  # rows: the old count
                x = np.clip(x + arrive[i] - trains[:, i : i + 1] * phase.train, 0, width - 1)
                cost = cost + _between(lag[i], None, x)
                i += 1
            x3 = np.broadcast_to(x[:, None, :], (len(counts), len(counts), width))  # (old, new, waiting)
            cost3 = np.broadcast_to(cost[:, None, :], x3.shape)
            for phase in new_phases:
                x3 = np.clip(x3 + arrive[i] - trains[None, :, i : i + 1] * phase.train, 0, width - 1)
                cost3 = cost3 + _between(lag[i], None, x3)
                i += 1
            moves = cost3 + _between(value[t + length], rows[None, :, None], x3) + paid[:, :, None]
            moves[rows, rows, :] = math.inf  # to the same count is no action
            best = moves.argmin(axis=1)
            best_value = np.take_along_axis(moves, best[:, None, :], axis=1)[:, 0, :]
            keep_t[t], move_t[t], to_t[t] = keep, best_value, np.where(best_value < keep, best, -1)
            value[t] = np.minimum(keep, best_value)
    return Policy(counts=counts, unit=unit, keep=keep_t, move=move_t, to=to_t)


def _between(table: np.ndarray, rows: np.ndarray | None, x: np.ndarray) -> np.ndarray:
    """``table`` (one row, or rows picked by ``rows``) at the continuous columns ``x``, linearly."""
    lo = np.floor(x).astype(np.int64)
    hi = np.minimum(lo + 1, table.shape[-1] - 1)
    share = x - lo
    if rows is None:
        return table[lo] * (1 - share) + table[hi] * share
    return table[rows, lo] * (1 - share) + table[rows, hi] * share
