"""A lower bound of an online job's worker-hours when every scaling action is paid.

``tidal.sim.online.oracle_worker_hours`` (the bound ``sim online`` prints) rescales for free
every interval and uses fractions of a worker. Under restart migration (10 minutes with nothing
trained per action) no policy comes near it on bursty traffic: each burst costs two actions.
This bound pays them: it is the fewest worker-hours of *any count schedule* the simulator can
run (``tidal.sim.online.simulate``), given a perfect forecast of the arrivals and of the
throughput noise, where each action costs what the simulator charges:

* a decision at the end of an interval starts an action only when none is under way;
* the action's intervals (``Migration.cost``: prep then pause, a scale-in's may be shorter than
  a scale-out's; rounded up to whole intervals)
  are paid as ``Migration.held`` says: until the hand-over at the old count (at ``max(old, new)``
  where the new pods start beside the old), then at the new; the one it ends in at the new count;
* in them the old workers train until the pause, the new ones after it (restart: nothing for
  10 minutes; seamless: the old ones for a minute, then 2 s of the third minute's successor).

It is exact dynamic programming over (workers, samples waiting), with the samples waiting kept
on a grid of ``1 / GRID`` of one worker's interval and rounded *down* after every interval. Fewer
samples waiting never hurt (a schedule feasible from more is feasible from fewer), so rounding
down only lowers the result: it stays a bound, looser by at most one grid step an interval while
samples wait (0.1 worker at the default grid).

SLO violations (``violations`` > 0: at most that share of the intervals may end with the lag
over 20 minutes, i.e. more waiting than arrived in the last 20 minutes) are priced by a
Lagrange multiplier: for every ``lam`` >= 0, ``min over schedules of (cost + lam * violating
intervals) - lam * K`` is at most the cost of any schedule with at most K violations. The bound
is the largest such value found by a search over ``lam`` (any ``lam`` gives a bound; the search
only tightens it). Each interval keeps the columns up to its SLO limit and one over it, which
holds every state over the limit: exact when none may be, one more relaxation when some may.

``lag_priced_worker_hours`` prices the accumulated lag (Kale Eq. 11) the same way instead: the
fewest worker-hours of any schedule whose lag stays within a budget, for the trade-off between
Kale's lag and worker-hour targets (``bench/online_live.py``). Each interval's lag is the one
``simulate`` reports, bounded from below: the oldest waiting sample (fewer waiting are never
older), or the wait that no schedule avoids in that interval (the pipeline's ``latency_s``, and
under global shuffling the busiest worker's full queue, which depends on the count); what arrived
within ``latency_s`` is never trained in the interval, as in ``simulate``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from tidal.api import ConfigError
from tidal.brain.lag_program import ActionPhase, oldest_age
from tidal.brain.lag_program import action_phases as phases_of_action
from tidal.sim.online import (
    MIGRATIONS,
    SimConfig,
    _shuffle_wait,
    slo_allowance,
    throughput_noise,
    true_throughput,
)

__all__ = ["GRID", "ActionPhase", "action_phases", "lag_priced_worker_hours", "oldest_age", "paid_moves_worker_hours"]

GRID = 10  # grid steps per worker-interval of samples waiting


def action_phases(cfg: SimConfig, scale_out: bool) -> list[ActionPhase]:
    """The intervals after a decision to grow the job (``scale_out``) or to shrink it until the
    next decision may start an action (``simulate``'s bookkeeping: the action ends in the first
    interval whose end is at or past prep + pause, paid at the new count)."""
    mig = MIGRATIONS[cfg.migration]
    prep, pause = mig.cost(scale_out)
    return phases_of_action(prep, pause, cfg.interval_s, mig.before_share)


def paid_moves_worker_hours(arrivals: np.ndarray, cfg: SimConfig, *, violations: float = 0.0,
                            min_workers: int = 1, grid: int = GRID) -> float:
    """The fewest worker-hours of any schedule of ``simulate`` on ``arrivals`` (already scaled)
    whose lag passes the SLO in at most a share ``violations`` of the intervals, each scaling
    action paid as ``cfg.migration`` says; ``inf`` if no schedule keeps it (module docstring).

    Raises:
        ConfigError: an unknown migration, or a negative ``violations``.
    """
    if cfg.migration not in MIGRATIONS:
        raise ConfigError(f"migration must be one of {', '.join(MIGRATIONS)}, got {cfg.migration!r}")
    if not 0 <= violations < 1:
        raise ConfigError(f"violations must be in [0, 1), got {violations:g}")
    a = np.asarray(arrivals, dtype=float)
    if len(a) == 0:
        return 0.0
    solver = _Solver(a, cfg, min_workers, grid)
    strict = solver.run(math.inf)
    k = int(violations * len(a))
    if k == 0 or strict <= solver.floor:
        return solver.hours(strict)
    # max over lam of D(lam) - lam * K; D is concave, so D(lam) - lam * K is unimodal in log(lam)
    best = _golden_max(lambda x: solver.run(math.exp(x)) - math.exp(x) * k,
                       math.log(1e-3), math.log(max(1.0, 4.0 * solver.top * len(a))), 8)
    return solver.hours(max(best, solver.run(0.0), solver.floor))


def lag_priced_worker_hours(arrivals: np.ndarray, cfg: SimConfig, lag_budget_min: float, *,
                            grid: int = GRID, prices: int = 12) -> float:
    """A lower bound of the worker-hours of any schedule of ``simulate`` on ``arrivals`` (already
    scaled) whose accumulated lag (Kale Eq. 11, lag-minutes) is at most ``lag_budget_min``, each
    scaling action paid as ``cfg.migration`` says; no SLO is imposed beyond that budget.

    Lagrangian duality: for a price ``mu`` >= 0 per lag-minute, ``D(mu)``, the least of
    worker-intervals plus ``mu`` times the lag over every schedule, is at most the worker-intervals
    plus ``mu * lag_budget_min`` of any schedule within the budget, so ``D(mu) - mu *
    lag_budget_min`` bounds their worker-intervals from below for every ``mu``. ``D`` is the dynamic
    program of ``paid_moves_worker_hours`` with each interval's lag priced (``_Solver.lag_min``: the
    oldest waiting sample with the samples waiting rounded down, or the wait of the pipeline and of
    the shuffle queues, both as ``simulate`` counts them), a relaxation of the simulator throughout,
    so ``D`` is at most the true least and the bound holds. ``D(mu) - mu * budget`` is concave in
    ``mu``: a scan of ``prices`` prices on a log scale, then a golden-section search around the best,
    only tightens it (any price gives a bound). The duality gap (schedules are whole counts) can leave
    the bound below the cheapest schedule within the budget. ``inf`` when the budget is below the
    lag that every schedule has (the pipeline's, and the shuffle queues' at every count).

    Raises:
        ConfigError: an unknown migration, or a negative budget.
    """
    if cfg.migration not in MIGRATIONS:
        raise ConfigError(f"migration must be one of {', '.join(MIGRATIONS)}, got {cfg.migration!r}")
    if not lag_budget_min >= 0:
        raise ConfigError(f"the lag budget must be at least 0 lag-minutes, got {lag_budget_min:g}")
    a = np.asarray(arrivals, dtype=float)
    if len(a) == 0:
        return 0.0
    solver = _Solver(a, cfg, 1, grid)

    def dual(log_mu: float) -> float:
        mu = math.exp(log_mu)
        return solver.run(0.0, mu) - mu * lag_budget_min

    floor = float(solver.queue_wait.min(axis=0).sum()) * cfg.interval_s / 3600.0  # lag no schedule avoids
    if lag_budget_min < floor:
        return math.inf
    logs = np.linspace(math.log(1e-3), math.log(1e6), prices)
    values = [dual(x) for x in logs]
    best = int(np.argmax(values))
    around = _golden_max(dual, logs[max(0, best - 1)], logs[min(len(logs) - 1, best + 1)], 12)
    # mu = 0: the actions paid, the lag free
    return solver.hours(max(values[best], around, solver.run(0.0), solver.floor))


def _golden_max(f: Callable[[float], float], lo: float, hi: float, steps: int) -> float:
    """The largest value of ``f`` seen by a golden-section search of ``steps`` steps for the maximum
    of a unimodal ``f`` on ``[lo, hi]`` (a dual bound: every value seen is a bound, the search only
    tightens it)."""
    golden = (math.sqrt(5) - 1) / 2
    x1, x2 = hi - golden * (hi - lo), lo + golden * (hi - lo)
    f1, f2 = f(x1), f(x2)
    best = max(f1, f2)
    for _ in range(steps):
        if f1 < f2:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + golden * (hi - lo)
            f2 = f(x2)
        else:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - golden * (hi - lo)
            f1 = f(x1)
        best = max(best, f1, f2)
    return best


class _Solver:
    """The dynamic program of one run: ``run(lam)`` is the least cost in worker-intervals plus
    ``lam`` per interval over the SLO (``inf``: none may be)."""

    def __init__(self, a: np.ndarray, cfg: SimConfig, min_workers: int, grid: int) -> None:
        n, dt = len(a), cfg.interval_s
        self.n, self.dt, self.top = n, dt, cfg.peak_workers
        self.counts = np.arange(max(1, min(min_workers, self.top)), self.top + 1)
        f = np.array([true_throughput(cfg, int(w)) for w in self.counts])
        self.step = true_throughput(cfg, 1) * dt / grid  # samples per grid step
        noise = throughput_noise(cfg, n)
        self.cap = f[:, None] * noise[None, :] * dt / self.step  # (counts, n) in grid steps
        self.a = a / self.step
        # an interval ends over the SLO when more waits than arrived in its last 20 minutes; with
        # the samples waiting rounded down, index b is over only if b steps are (never a false one)
        self.limit = np.floor(slo_allowance(a, dt) / self.step + 1e-9).astype(np.int64)
        # the actions' intervals: one list for both directions when they cost the same, else the
        # scale-outs' (to a count above the old) and the scale-ins' (below it)
        out, into = action_phases(cfg, scale_out=True), action_phases(cfg, scale_out=False)
        self.overlap = MIGRATIONS[cfg.migration].both_before_handover  # a scale-out holds the new count before it
        self.actions: list[tuple[list[ActionPhase], str]] = [(out, "both")] if out == into else [(out, "out"), (into, "in")]
        self.floor = float(self.counts[0] * n)  # no schedule pays less than the fewest workers throughout
        self.mu = 0.0  # the price of a lag-minute in the run under way (``run``)
        self._oldest: dict[int, np.ndarray] = {}  # interval -> age of the oldest waiting sample, per column
        self.cum = np.concatenate([[0.0], np.cumsum(a)])
        self.arrivals = a
        # samples that can be trained by each interval's end: those arrived latency_s before it
        ends = (np.arange(n) + 1) * dt
        reachable = np.interp(ends - cfg.latency_s, np.arange(n + 1) * dt, self.cum, left=0.0)
        # grid steps that arrived in each interval's last latency_s (rounded down): never trained in it
        self.unreachable = np.floor((self.cum[1:] - reachable) / self.step + 1e-9).astype(np.int64)
        self.queue_wait = _queue_wait(a, cfg, self.counts, f[:, None] * noise[None, :], reachable)  # (counts, n) s

    def lag_min(self, t: int, columns: np.ndarray) -> np.ndarray:
        """Lag-minutes that interval t adds (``simulate``: its lag in minutes times its length in
        minutes) for each count (rows) ending it with ``columns`` grid steps waiting: the age of the
        oldest of them, FIFO, or the wait the count's shuffle queues and the pipeline put on every
        record, whichever is more. The samples waiting are rounded down, so this is at most the
        simulator's (fewer waiting are never older)."""
        oldest = self._oldest.get(t)
        if oldest is None:  # the same for every price: computed once a run of prices
            every = np.arange(self.width(t))
            consumed = np.maximum(self.cum[t + 1] - every * self.step, 0.0)
            oldest = np.where(every > 0, oldest_age(self.cum, self.arrivals, consumed, (t + 1) * self.dt, self.dt), 0.0)
            self._oldest[t] = oldest
        lag_s = np.maximum(oldest[columns][None, :], self.queue_wait[:, t][:, None])
        return lag_s * self.dt / 3600.0

    def hours(self, cost: float) -> float:
        return cost * self.dt / 3600.0

    def run(self, lam: float, mu: float = 0.0) -> float:
        """The least cost in worker-intervals, plus ``lam`` per interval over the SLO and ``mu`` per
        lag-minute (the simulator's accumulated lag, Kale Eq. 11)."""
        self.mu = mu
        n, counts = self.n, self.counts
        inf = math.inf
        cur = np.zeros((len(counts), self.width(-1)))  # any count at the start (the launch costs no action)
        landing: dict[int, np.ndarray] = {}
        tail = inf  # schedules still in an action when the run ends
        for t in range(n):
            if t in landing:
                np.minimum(cur, landing.pop(t), out=cur)
            for phases, direction in self.actions:
                if float(cur.min()) == inf:  # no schedule is still within the SLO here
                    break
                landing_at = t + len(phases)
                if landing_at > n:  # an action started now would still be under way at the end
                    tail = min(tail, self._unfinished(cur, t, lam, phases))
                    continue
                moved = self._move(cur, t, lam, phases, direction)
                if landing_at in landing:
                    np.minimum(landing[landing_at], moved, out=landing[landing_at])
                else:
                    landing[landing_at] = moved
            cur = self._interval(cur, t, self.cap[:, t], lam) + counts[:, None]
        return min(float(cur.min()), tail)

    def _interval(self, v: np.ndarray, t: int, cap: np.ndarray, lam: float) -> np.ndarray:
        """Every row of ``v`` one interval on: arrivals ``a[t]``, row i trains ``cap[i]`` grid steps."""
        shift = np.floor(self.a[t] - cap + 1e-9).astype(np.int64)
        out = _shift_rows(v, shift, self.width(t))
        least = min(int(self.unreachable[t]), out.shape[1] - 1)
        if least > 0:  # what arrived within the pipeline's latency waits whatever the capacity
            out[:, least] = out[:, : least + 1].min(axis=1)
            out[:, :least] = math.inf
        if self.mu:
            out += self.mu * self.lag_min(t, np.arange(out.shape[1]))
        if lam == math.inf:
            out[:, -1] = math.inf  # the last column, alone over the SLO
        elif lam > 0:
            out[:, -1] += lam
        return out

    def width(self, t: int) -> int:
        """Columns of the state at the end of interval t: up to the SLO's limit, and one over it
        (which holds every state over it: exact when none may be, a relaxation otherwise)."""
        return int(self.limit[t]) + 2 if t >= 0 else 1

    def _idle(self, v: np.ndarray, t: int, count: int, lam: float) -> np.ndarray:
        """Every row of ``v`` ``count`` intervals on from interval t with nothing trained (a pause):
        one shift by all their arrivals, each column charged for the intervals it ends over the SLO."""
        steps = np.floor(self.a[t : t + count] + 1e-9).astype(np.int64)
        ahead = np.cumsum(steps)  # rounded down each interval, as _interval does
        if self.mu:  # each interval's lag, column b being b + ahead[j] steps by the end of interval t + j
            for j in range(count):
                columns = np.minimum(np.arange(v.shape[1]) + ahead[j], self.width(t + j) - 1)
                v = v + self.mu * self.lag_min(t + j, columns)
        # column b ends interval t + j over the SLO when b + ahead[j] > limit[t + j]
        edges = np.sort(self.limit[t : t + count] - ahead)
        over = np.searchsorted(edges, np.arange(v.shape[1]), side="left")  # edges below each column
        if lam == math.inf:
            v = np.where(over[None, :] > 0, math.inf, v)
        elif lam > 0:
            v = v + lam * over[None, :]
        return _shift_rows(v, np.full(v.shape[0], int(ahead[-1])), self.width(t + count - 1))

    def _old_part(self, v: np.ndarray, t: int, phases: list[ActionPhase], lam: float) -> np.ndarray:
        """Every row of ``v`` (the old count) through an action's intervals before it ends."""
        i = t
        while phases:
            run = next((k for k, p in enumerate(phases) if p.train), len(phases))
            if run:
                v, i, phases = self._idle(v, i, run, lam), i + run, phases[run:]
            else:
                v = self._interval(v, i, self.cap[:, i] * phases[0].train, lam)
                i, phases = i + 1, phases[1:]
        return v

    def _unfinished(self, v: np.ndarray, t: int, lam: float, phases: list[ActionPhase]) -> float:
        """The least cost of an action of ``phases`` started at the end of interval t - 1 and still
        under way when the run ends: its intervals so far, each paid at least at the old count before
        the hand-over and at the fewest workers after it."""
        left = self.n - t
        before = sum(p.before for p in phases[:left])
        v = self._old_part(v, t, phases[:left], lam) + before * self.counts[:, None] + (left - before) * self.counts[0]
        return float(v.min())

    def _move(self, v: np.ndarray, t: int, lam: float, phases: list[ActionPhase], direction: str) -> np.ndarray:
        """From ``v`` at the end of interval t - 1: the cost, when the action ends, of a scaling
        action of ``phases`` to each count (rows: the new count) from a count at or below it
        (``direction`` "out"), above it ("in"), or any ("both")."""
        counts = self.counts[:, None].astype(float)
        before = sum(p.before for p in phases)  # intervals paid at the count before the hand-over
        after = len(phases) - before  # and at the new count
        old_trained = sum(not p.new for p in phases)
        v = self._old_part(v, t, phases[:old_trained], lam)  # rows: the old count
        phases, i = phases[old_trained:], t + old_trained
        # before the hand-over a scale-in holds its old count w, a scale-out max(w, w') = w' if the
        # new pods start beside the old (overlap), else w: split at w <= w'
        if direction == "in":
            out = np.full_like(v, math.inf)
        elif self.overlap:
            out = np.minimum.accumulate(v, axis=0) + before * counts  # old w <= new w'
        else:
            out = np.minimum.accumulate(v + before * counts, axis=0)
        if direction != "out":
            above = v + before * counts  # old w > new w': its own count
            above = np.minimum.accumulate(above[::-1], axis=0)[::-1]
            np.minimum(out[:-1], above[1:], out=out[:-1])
        for phase in phases:  # the new workers' part: rows are the new count
            if phase.train:
                out = self._interval(out, i, self.cap[:, i] * phase.train, lam)
            else:
                out = self._idle(out, i, 1, lam)
            i += 1
        return out + after * counts


def _queue_wait(a: np.ndarray, cfg: SimConfig, counts: np.ndarray, rate: np.ndarray,
                reachable: np.ndarray) -> np.ndarray:
    """The lag every schedule has in interval t with ``counts[i]`` workers training at ``rate[i, t]``
    samples/s, whatever waits (``simulate``): the age of the oldest sample not ``reachable`` yet
    (arrived within ``latency_s``), and under global shuffling the busiest worker's full queue
    (``_shuffle_wait``)."""
    n, dt = len(a), cfg.interval_s
    out = np.zeros((len(counts), n))
    if cfg.latency_s > 0:  # what arrived in the last latency_s cannot be trained yet: the oldest of it waits
        cum = np.concatenate([[0.0], np.cumsum(a)])
        ages = oldest_age(cum, a, reachable, (np.arange(n) + 1) * dt, dt)
        out[:] = np.where(cum[1:] - reachable > 1e-6, ages, 0.0)[None, :]
    if cfg.shuffle_upper is not None and cfg.partitions:
        for i, w in enumerate(counts):
            for t in range(n):
                out[i, t] = max(out[i, t], _shuffle_wait(a[t] / cfg.partitions, int(w), float(rate[i, t]), cfg, dt))
    return out


def _shift_rows(v: np.ndarray, shift: np.ndarray, width: int) -> np.ndarray:
    """Row i of ``v`` moved ``shift[i]`` columns right (left if negative) into ``width`` columns;
    what falls off the left end lands on column 0, past the right end on the last column (the
    least of each)."""
    size = v.shape[1]
    src = np.arange(width)[None, :] - shift[:, None]
    valid = (src >= 0) & (src < size)
    out = np.where(valid, np.take_along_axis(v, np.clip(src, 0, size - 1), axis=1), math.inf)
    left = shift < 0
    if left.any():  # column 0 takes the least of columns 0 .. -shift
        head = np.minimum.accumulate(v[left], axis=1)
        out[left, 0] = head[np.arange(head.shape[0]), np.minimum(-shift[left], size - 1)]
    # the last column takes the least of every source column at or past width - 1 - shift
    first = width - 1 - shift
    spill = first < size
    if spill.any():
        tail = np.minimum.accumulate(v[spill][:, ::-1], axis=1)[:, ::-1]  # least from each column on
        out[spill, width - 1] = np.minimum(out[spill, width - 1],
                                           tail[np.arange(tail.shape[0]), np.maximum(first[spill], 0)])
    return out
