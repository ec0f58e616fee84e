"""Online-training simulator: scaling policies against a sample stream (Kale section 4.4).

A job trains on a stream whose arrivals follow a trace. It has a *true* throughput model
(samples/s as a function of workers) with per-minute noise that no planner sees. Every
simulated minute each policy gets a ``JobObservation`` with what a live master would report
(its ``stream`` part: the arrivals of that minute, the throughput measured while training,
backlog, lag, utilization; ``ready`` False while a scaling action is under way and in the
interval it ends in) and answers with a ``ResourcePlan``; the very planners of ``tidal.brain``
are used.

Scaling stops training for its downtime:

* ``restart`` (Kale section 1): save the model (60 s), launch containers (30 s), pull images
  (30 s), load the model (360 s) and rebuild the stream's consumer group (120 s): 10 minutes
  with nothing trained. The job holds the old workers while they save, the new count after
  (the old pods are stopped, the new ones deployed: ``Migration.held``).
* ``seamless`` (DLRover-RM section 5.2): the new workers are launched and initialized while
  the old ones keep training (60 s), then training pauses only for the hand-over: a flash
  checkpoint through shared memory (about 1 s each way) and the consumer-group rebuild
  (120 s, as in Kale). The job holds ``max(old, new)`` workers until the leavers have saved
  (61 s), the new count after.

Partitions (``SimConfig.partitions``; Kale 2.3). By default the workers share one pool of
waiting samples, as if every worker could take any of them. A live job reads partitions: with
``partitions`` P the arrivals are spread evenly over P partitions, assigned to the w workers
round-robin as the master assigns them (worker i reads partitions i, i + w, ...), and each
worker trains at most ``f(w) / w`` samples/s, shared among its own partitions (water-filling:
evenly, none given more than it holds). When w does not divide P, the workers holding more
partitions fall behind while the others idle (8 partitions on 6 workers: two of them carry 25%
of the traffic each, 1.5x the mean), which a pooled model does not show. The lag is the oldest
waiting sample over the partitions; the utilization the workers' mean busy share over the
whole interval (time in a scaling action's pause is idle, as a live worker counts it; an
interval paused throughout reports nothing new).

Global shuffling (``SimConfig.shuffle_upper``, with ``partitions``; Kale 3.5, ``tidal run
--global-shuffle LOWER:UPPER``). A worker forwards what it reads beyond ``UPPER`` queued samples
to workers with room, so the workers train as one pool again; but a worker whose partitions bring
more than it trains (``ceil(P / w)`` of P partitions on w workers: 8 on 6 bring 25% to a worker
with a sixth of the capacity) keeps its local queue at ``UPPER`` and forwards the rest. While the
pool keeps up the lag is then at least ``latency_s`` plus the age of the head of that queue: with
``shuffle_batch`` B (the records a step takes) the age just after a step took its batch, when a
live worker reports it (``tidal.brain.kale.queue_head_age``: ``tau - (2B - UPPER) / r`` for
B <= UPPER <= 2B, a step every ``tau`` s, its partitions bringing r samples/s; at 32:160 with a
batch of 128, a quarter to a half of a step); without it the whole queue, ``UPPER / (f(w) / w)``. Live, at 96x
time compression, a queue of 384 records on a worker training 400 records/s held a record back
a second, 96 trace seconds; at 32:160, 16-22 trace seconds (bench/RESULTS.md). Steps and
arrivals are not like clockwork: with ``shuffle_spread`` (the coefficient of variation of the
records one step's interval brings) records are left over after a take below saturation too,
as Lindley's recursion leaves them (``tidal.brain.kale.leftover_mean``), and the lag grows
smoothly into the full queue's instead of jumping there at saturation. Where that model falls
short (live, with ``UPPER`` one batch it leaves no wait, yet the lag rose with the load, most at
the counts that do not divide the partitions, as forwarded records waited at their receivers),
``SimConfig.rest_lags`` gives the lag measured live at each count against the load instead
(``bench/online_live.py``, ``live_floors``).

Busy window (``SimConfig.busy_window_s``). A live worker measures its busy share over the last
second of wall time (``tidal.worker.stream_loader``): at 96x time compression 96 trace seconds,
longer than an interval. The reading just after a scaling action then mixes the pause (idle)
with the catch-up after it (busy), where an interval's own share reads the catch-up alone (a
full 1.0, which HPA's utilization rule answers with a scale-out). With ``busy_window_s`` W the
utilization handed to planners is the busy share over the last W seconds in which the workers
reported (an interval paused throughout reports nothing), the oldest interval in part.

Latency (``SimConfig.latency_s``): by default a sample can be trained in the interval it
arrives in. A live worker reads a batch ahead and trains it a step later, so a sample waits at
least a step or two even when the workers keep up; with ``latency_s`` L, only what arrived L
seconds ago can be trained, and the lag never drops below L while samples arrive.

Metrics (Kale section 4.1): SLO violation rate (share of minutes whose lag exceeds 20
minutes), accumulated lag (Eq. 11: the sum of the per-minute lag, in minutes), downtime
(minutes without training), worker-hours, scaling actions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any

import numpy as np

from tidal.api import ConfigError, JobObservation, StreamObservation
from tidal.brain import planners
from tidal.brain.api import Planner, ThroughputConfig
from tidal.brain.kale import PROGRAM_LAG_PRICE, shuffle_wait_s
from tidal.brain.models import KaleSyncModel, LinearisedModel

__all__ = [
    "JOBS",
    "MIGRATIONS",
    "Migration",
    "PolicyResult",
    "SimConfig",
    "default_true_model",
    "forecast_wait_s",
    "oracle_worker_hours",
    "planner_factory",
    "scale_to_peak",
    "simulate",
    "slo_allowance",
    "throughput_noise",
]

SLO_LAG_S = 20 * 60.0


@dataclass(frozen=True)
class Migration:
    """Cost of one scaling action: ``prep_s`` while the old workers still train, then ``pause_s``.

    A scale-in may cost less than a scale-out (``scale_in_prep_s`` / ``scale_in_pause_s``; None:
    the same): tidal's runtime starts no process to shrink, so live a scale-in's preparation is
    the leaver's goodbye (under a trace minute at 96x) where a scale-out's is the new workers'
    start (about 12 trace minutes). Restart and seamless (Kale 4.4) cost the same both ways.

    ``scale_in_settle_s``: after a scale-in's pause the survivors train at the new count, but the
    job is not ``ready`` until the leavers have exited (a live master measures nothing while a
    worker is still leaving: ``JobMaster._measure``); live, 2-3 wall seconds, about 250 trace
    seconds at 96x, in which the survivors drain the pause's backlog. Without it the first
    reading after every scale-in was that catch-up (busy 1.0), and the simulated HPA scaled out
    again at once: 165 actions on the nineteenth live run's day where the live HPA made 45.

    What the job holds during an action (its worker-hours): ``handover_s`` after the decision the
    old set gives way to the new one (the leavers are released, a restart's new pods start); before
    it the job holds the old set, and the new one beside it where ``overlap`` (its pods are launched
    while the old ones train); after it, the new set. A stop-and-restart (DLRover-RM 5.2, steps 1-3)
    stops the old workers once they have saved the model (60 s) and deploys the new count's pods
    after: a scale-in from 13 workers to 3 holds 13 for that minute and 3 for the other nine, not 13
    throughout. Seamless migration launches the joiners while the old set trains and lets the leavers
    go after the flash checkpoint's save (prep + 1 s). ``handover_s`` None: ``max(old, new)`` until the
    action ends (a migration measured live, whose steps are not known)."""

    name: str
    prep_s: float
    pause_s: float
    scale_in_prep_s: float | None = None
    scale_in_pause_s: float | None = None
    scale_in_settle_s: float = 0.0
    handover_s: float | None = None
    overlap: bool = True

    def __post_init__(self) -> None:
        if self.handover_s is not None and not 0 <= self.handover_s <= min(sum(self.cost(True)), sum(self.cost(False))):
            raise ConfigError(f"handover_s must be within every action ({self.handover_s:g} s)")

    def cost(self, scale_out: bool) -> tuple[float, float]:
        """(prep, pause) seconds of an action growing the job (``scale_out``) or shrinking it."""
        if scale_out:
            return self.prep_s, self.pause_s
        return (self.prep_s if self.scale_in_prep_s is None else self.scale_in_prep_s,
                self.pause_s if self.scale_in_pause_s is None else self.scale_in_pause_s)

    @property
    def both_before_handover(self) -> bool:
        """Whether the job holds ``max(old, new)`` before the hand-over (else the old count)."""
        return self.overlap or self.handover_s is None

    def before_share(self, since_s: float, span_s: float) -> float:
        """The share of ``span_s`` seconds from ``since_s`` after an action's decision that falls
        before the hand-over (all of it without one: the action's end is the hand-over)."""
        if self.handover_s is None:
            return 1.0
        return min(1.0, max(0.0, (self.handover_s - since_s) / span_s))

    def held(self, old: int, new: int, since_s: float, span_s: float) -> float:
        """The mean workers held over ``span_s`` seconds from ``since_s`` after an action's
        decision, an action from ``old`` workers to ``new`` that has not ended by then."""
        before = max(old, new) if self.both_before_handover else old
        share = self.before_share(since_s, span_s)
        return share * before + (1.0 - share) * new


MIGRATIONS = {
    "restart": Migration("restart", prep_s=0.0, pause_s=60.0 + 30.0 + 30.0 + 360.0 + 120.0,
                         handover_s=60.0, overlap=False),
    "seamless": Migration("seamless", prep_s=60.0, pause_s=2.0 + 120.0, handover_s=60.0 + 1.0),
}


def default_true_model() -> LinearisedModel:
    """The simulated job: Kale's sync model (Eq. 6), M = 16,384.

    The coefficients are Kale Table 1's A10 job, theta = (0.00035, 2.5726, 0.9824, theta3),
    with the per-worker overhead theta3 lowered from 0.02786 to 0.0016 so that throughput keeps
    growing (less than linearly) up to about 40 workers instead of peaking at 10: a job that
    needs 28 workers at its peak must be able to use them.
    """
    return KaleSyncModel({"theta0": 0.00035, "theta1": 2.5726, "theta2": 0.9824, "theta3": 0.0016})


def t4_true_model() -> LinearisedModel:
    """Kale Table 1's synchronous T4 job, coefficients unchanged (Eq. 6, M = 16,384).

    theta = (0.00253, 11.1614, 11.6335, 1.88e-14): no per-worker overhead, and a large
    theta2/w^2 term, so throughput grows faster than linearly up to 28 workers and beyond
    (per-worker rate 719 samples/s at w = 1, 1,407 at w = 28): far from the linear model that
    madu assumes.
    """
    return KaleSyncModel({"theta0": 0.00253, "theta1": 11.1614, "theta2": 11.6335, "theta3": 1.88e-14})


#: true throughput models the simulated job can have (``tidal sim online --job``)
JOBS: dict[str, Callable[[], LinearisedModel]] = {
    "a10-sync-long": default_true_model,
    "t4-sync": t4_true_model,
}


@dataclass
class SimConfig:
    """Parameters of one simulation (see ``tidal sim online --help``)."""

    peak_workers: int = 28
    migration: str = "restart"
    seed: int = 0
    noise: float = 0.05  # std of the log-normal per-minute throughput noise
    batch_size: float = 16384.0
    interval_s: float = 60.0
    true_model: LinearisedModel = field(default_factory=default_true_model)
    partitions: int | None = None  # None: one pool every worker takes from (see the module docstring)
    latency_s: float = 0.0  # a sample can be trained this long after it arrives at the earliest (the pipeline)
    shuffle_upper: float | None = None  # with partitions: global shuffling, a local queue of this many samples
    # records a worker's step takes from its local queue (None: a record waits the whole UPPER ahead of it)
    shuffle_batch: float | None = None
    # the coefficient of variation of the records one step's interval brings a worker (its step time and
    # the traffic within it vary): records left over after a take below saturation (kale.shuffle_wait_s)
    shuffle_spread: float = 0.0
    # a worker's reader reads its partitions this often (trace s; tidal.worker.shuffle.READ_POLL_S times the
    # time scale live): the oldest record of a chunk waited about that long unread (kale.shuffle_wait_s)
    shuffle_read_s: float = 0.0
    # with shuffle_upper: the lag a steady job keeps at each count against its load (arrivals over capacity),
    # measured live, as (load, lag s) points in increasing load; at a count it names, this replaces
    # the queue model (module docstring); latency_s still holds under it
    rest_lags: dict[int, tuple[tuple[float, float], ...]] | None = None
    # the capacity handed to planners over the throughput trained (live: a worker's rate over its busy
    # share reads a little above what it sustains with records waiting; bench/online_live.py)
    capacity_reading: float = 1.0
    # the busy share a planner reads is the mean over this much time (None: the interval's own)
    busy_window_s: float | None = None
    # kale's two knobs for a lag far below the SLO (tidal.brain.kale.KalePlanner; off: Eq. 10)
    load_headroom: float = 1.0
    lag_price: float = 0.0
    planned_lag_s: float = 300.0  # kale's (its default: a quarter of the 20-minute SLO)
    # kale time-shares whole workers through what waits where moves are cheap (KalePlanner.deadline_s);
    # False: every count from the forecast (Eq. 10), for less lag
    time_share: bool = True
    # kale plans over this many seconds with the lag priced (KalePlanner.program_horizon_s; None: Eq. 10)
    program_horizon_s: float | None = None
    program_lag_price: float = PROGRAM_LAG_PRICE  # worker-minutes per lag-minute (KalePlanner.program_lag_price)
    # the price set by the job against a shadow HPA's lag (KalePlanner.program_lag_ratio; None: fixed)
    program_lag_ratio: float | None = None


@dataclass
class PolicyResult:
    name: str
    slo_violation_rate: float
    accumulated_lag_min: float
    downtime_min: float
    worker_hours: float
    scaling_actions: int
    workers: np.ndarray  # allocated workers per minute
    lag_s: np.ndarray  # lag at the end of each minute

    def metrics(self) -> dict[str, float]:
        return {
            "slo_violation_rate": self.slo_violation_rate,
            "accumulated_lag_min": self.accumulated_lag_min,
            "downtime_min": self.downtime_min,
            "worker_hours": self.worker_hours,
            "scaling_actions": self.scaling_actions,
        }


def true_throughput(cfg: SimConfig, w: int) -> float:
    if w <= 0:
        return 0.0
    return cfg.true_model.predict(ThroughputConfig(workers=w, batch_size=cfg.batch_size))


def scale_to_peak(counts: np.ndarray, cfg: SimConfig) -> np.ndarray:
    """Arrivals per interval scaled so that the peak rate needs exactly ``peak_workers``.

    The peak rate is set halfway between F(K - 1) and F(K) of the true model, so that the
    smallest w with F(w) > peak is K (Eq. 10).
    """
    k = cfg.peak_workers
    hi, lo = true_throughput(cfg, k), true_throughput(cfg, k - 1)
    if not hi > lo:
        raise ConfigError(f"the job's throughput does not grow up to {k} workers")
    peak_rate = 0.5 * (hi + lo)
    peak = float(np.max(counts))
    if peak <= 0:
        raise ConfigError("the trace has no arrivals")
    return counts * (peak_rate * cfg.interval_s / peak)


def throughput_noise(cfg: SimConfig, n: int) -> np.ndarray:
    """The per-interval throughput noise of a run (log-normal, mean 1): the same for every policy."""
    rng = np.random.default_rng(cfg.seed)
    return np.exp(rng.normal(0.0, cfg.noise, size=n) - 0.5 * cfg.noise**2)


def slo_allowance(arrivals: np.ndarray, dt: float) -> np.ndarray:
    """The samples that may still wait at the end of each interval with the lag within the SLO:
    those arrived in its last 20 minutes (FIFO; arrivals spread evenly within an interval)."""
    n = len(arrivals)
    cum = np.concatenate([[0.0], np.cumsum(arrivals)])
    ends = (np.arange(n) + 1) * dt
    return cum[1:] - np.interp(ends - SLO_LAG_S, np.arange(n + 1) * dt, cum, left=0.0)


def oracle_worker_hours(arrivals: np.ndarray, cfg: SimConfig, *, violations: float = 0.0,
                        min_workers: int = 1) -> float:
    """A lower bound of the worker-hours of any policy, on this run, whose lag passes the SLO
    (20 minutes) in at most a share ``violations`` of the intervals; ``inf`` if none can.

    ``min_workers``: the fewest workers at any time. The simulator (like the master) keeps
    every job at 1 or more, so the bound does too; with 0 it also drops the floor, which on
    traffic that is mostly far below one worker's throughput (peak-to-mean ratios of 5-15)
    made the bound up to half what any policy of the simulator can reach.

    The policy is given everything a planner lacks: a perfect forecast of the arrivals and of
    the throughput noise, rescaling every interval for free, and fractions of a worker
    (time-sharing between counts, so the capacity of w workers is the concave hull of the true
    F through (0, 0)). What is left is a linear program, solved exactly (HiGHS):

        min sum_t w_t   s.t.   c_t <= noise_t * hull(w_t),   0 <= w_t <= peak_workers,
                               b_t = b_{t-1} + a_t - c_t,     0 <= b_t <= a(t - 20 min, t],

    with c_t the samples trained and b_t the samples waiting at the end of interval t; FIFO
    makes "lag <= 20 minutes" the same as "no more waiting than arrived in the last 20
    minutes" (arrivals spread evenly within an interval, as the simulator counts them).
    Samples may wait: a peak shorter than the SLO can be trained after it.
    ``cfg.partitions`` is ignored: a pool trains at least as much as partitions do with the same
    workers, so the bound holds for a partitioned job too.

    With ``violations`` > 0 an interval over the SLO may hold more, but no more than has
    arrived since the last interval within it, at most ``K = violations * n`` intervals
    earlier: ``b_t <= a(t - 20 min, t] + v_t * a(t - 20 min - K, t - 20 min]`` with
    ``v_t`` in [0, 1] and ``sum v_t <= K`` (the relaxation of "v_t is 0 or 1": still a bound).

    The program is solved in the hull's segments: above the floor's capacity (free, paid as the
    floor) each interval fills segment k's capacity at its own price in workers per sample, which
    rises with k (the hull is concave), so the cheapest fill is the hull's inverse and each w_t is
    read off the shares; no row per segment and interval, only the balance (a week of minutes:
    17.5 s -> 1.7 s, the same bound within 2e-7 of it; 3% violations 61 s -> 50 s). Equations are
    in worker-intervals of capacity, not samples: in samples the prices were below the solver's
    cost tolerance, and it stopped at 1.3-1.9x the optimum.
    """
    from scipy import sparse
    from scipy.optimize import linprog

    a = np.asarray(arrivals, dtype=float)
    n, dt, top = len(a), cfg.interval_s, cfg.peak_workers
    if n == 0:
        return 0.0
    cap = np.array([true_throughput(cfg, w) * dt for w in range(top + 1)])
    hull = [0]  # upper concave hull of (w, cap[w])
    for w in range(1, top + 1):
        while len(hull) >= 2 and (cap[hull[-1]] - cap[hull[-2]]) * (w - hull[-2]) <= (cap[w] - cap[hull[-2]]) * (hull[-1] - hull[-2]):
            hull.pop()
        hull.append(w)
    lo = min(min_workers, top)
    hull_cap = lambda w: float(np.interp(w, hull, cap[hull]))  # noqa: E731
    # the hull above the floor in segments (workers, capacity): each filled in turn, the first cheapest
    corners = [lo] + [h for h in hull if h > lo]
    segments = [(k1 - k0, hull_cap(k1) - hull_cap(k0)) for k0, k1 in itertools.pairwise(corners)
                if hull_cap(k1) > hull_cap(k0)]
    unit = hull_cap(top) / top  # samples: the equations in worker-intervals, for the solver's tolerances
    noise = throughput_noise(cfg, n)
    k_viol = int(violations * n)
    m = len(segments)
    # columns, each a share in [0, 1]: the floor's capacity used, each segment's used; then b_t[, v_t]
    t = np.arange(n)
    b_, v_ = (1 + m) * n + t, (2 + m) * n + t
    nv = (3 + m) * n if k_viol else (2 + m) * n
    widths = [hull_cap(lo)] + [width for _, width in segments]
    balance = sparse.csr_matrix(  # b_t - b_{t-1} + noise_t * (capacity used) = a_t
        (np.concatenate([noise * (w / unit) for w in widths] + [np.ones(n), -np.ones(n - 1)]),
         (np.concatenate([t] * (1 + m) + [t, t[1:]]),
          np.concatenate([k * n + t for k in range(1 + m)] + [b_, b_[:-1]]))),
        shape=(n, nv))
    within = slo_allowance(a, dt) / unit
    upper = np.ones(nv)
    upper[b_] = within
    cost = np.zeros(nv)
    for k, (workers, _) in enumerate(segments):
        cost[(1 + k) * n + t] = workers * dt / 3600.0
    a_ub = b_ub = None
    if k_viol:  # b_t - v_t * extra_t <= within_t,  sum v_t <= K
        cum = np.concatenate([[0.0], np.cumsum(a)])
        ends = (t + 1) * dt
        at = lambda s: np.interp(s, np.arange(n + 1) * dt, cum, left=0.0)  # noqa: E731  cumulative arrivals
        extra = (at(ends - SLO_LAG_S) - at(ends - SLO_LAG_S - k_viol * dt)) / unit
        upper[b_] = np.inf
        a_ub = sparse.vstack([
            sparse.csr_matrix((np.concatenate([np.ones(n), -extra]), (np.concatenate([t, t]), np.concatenate([b_, v_]))),
                              shape=(n, nv)),
            sparse.csr_matrix((np.ones(n), (np.zeros(n, dtype=int), v_)), shape=(1, nv))]).tocsr()
        b_ub = np.concatenate([within, [float(k_viol)]])
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=balance, b_eq=a / unit,
                  bounds=np.column_stack([np.zeros(nv), upper]), method="highs")
    if res.status == 2:  # infeasible: even peak_workers cannot keep the lag
        return math.inf
    if res.status != 0:
        raise RuntimeError(f"the lower bound's linear program failed: {res.message}")
    return float(res.fun) + lo * n * dt / 3600.0


def _busy_reading(shares: list[float], dt: float, window_s: float | None) -> float:
    """The busy share over the last ``window_s`` seconds of ``shares`` (one per interval of
    ``dt``, newest last; the oldest one counted in part), or the newest interval's."""
    if window_s is None or window_s <= dt:
        return shares[-1]
    left, total = window_s, 0.0
    for share in reversed(shares):
        take = min(dt, left)
        total += share * take
        left -= take
        if left <= 0:
            break
    return total / (window_s - left)


@dataclass
class _Job:
    """One policy's simulated job."""

    workers: int
    allocated: int
    consumed: np.ndarray  # per partition (one entry: the pool)
    action_new: int | None = None
    action_start: float = 0.0  # the decision's time
    action_prep_end: float = 0.0
    action_end: float = 0.0
    actions: int = 0
    downtime_s: float = 0.0
    settled_at: float = 0.0  # the end of a scale-in's leavers' exit: not ready before it


def simulate(
    arrivals: np.ndarray,
    policies: Sequence[str] | dict[str, Callable[[], Planner]],
    cfg: SimConfig,
    history: np.ndarray | None = None,
) -> dict[str, PolicyResult]:
    """Run every policy over ``arrivals`` (samples per ``cfg.interval_s``, already scaled).

    ``history`` (same units) is what the stream held before the simulated window: given to
    planners that can learn from it (``observe_history``), never simulated or scored.
    """
    if cfg.migration not in MIGRATIONS:
        raise ConfigError(f"migration must be one of {', '.join(MIGRATIONS)}, got {cfg.migration!r}")
    if cfg.partitions is not None and cfg.partitions < 1:
        raise ConfigError(f"partitions must be at least 1, got {cfg.partitions}")
    if cfg.shuffle_upper is not None and (cfg.partitions is None or cfg.shuffle_upper < 0):
        raise ConfigError("shuffle_upper needs partitions and must not be negative")
    if not cfg.capacity_reading > 0:
        raise ConfigError(f"capacity_reading must be positive, got {cfg.capacity_reading:g}")
    if cfg.shuffle_batch is not None and not cfg.shuffle_batch > 0:
        raise ConfigError(f"shuffle_batch must be positive, got {cfg.shuffle_batch:g}")
    if not cfg.shuffle_spread >= 0:
        raise ConfigError(f"shuffle_spread must not be negative, got {cfg.shuffle_spread:g}")
    if not cfg.shuffle_read_s >= 0:
        raise ConfigError(f"shuffle_read_s must not be negative, got {cfg.shuffle_read_s:g}")
    for w, points in (cfg.rest_lags or {}).items():
        loads = [load for load, _ in points]
        if not points or any(b <= a for a, b in itertools.pairwise(loads)) or any(not lag >= 0 for _, lag in points):
            raise ConfigError(f"rest_lags[{w}] must be (load, lag) points in increasing load with lags of 0 or more")
    if cfg.busy_window_s is not None and not cfg.busy_window_s > 0:
        raise ConfigError(f"busy_window_s must be positive, got {cfg.busy_window_s:g}")
    if not 0 <= cfg.latency_s < cfg.interval_s * max(1, len(arrivals)):
        raise ConfigError(f"latency_s must be at least 0 and shorter than the run, got {cfg.latency_s:g}")
    mig = MIGRATIONS[cfg.migration]
    shuffled = cfg.shuffle_upper is not None
    dt = cfg.interval_s
    n = len(arrivals)
    parts = cfg.partitions or 1
    cum = np.concatenate([[0.0], np.cumsum(arrivals)])
    # each partition's share (the pool's: all of it)
    part_cum, part_arrivals = cum / parts, np.asarray(arrivals, dtype=float) / parts
    noise = throughput_noise(cfg, n)
    max_w = cfg.peak_workers
    f_true = [true_throughput(cfg, w) for w in range(max_w + 1)]
    first_rate = float(np.mean(arrivals[: max(1, round(3600 / dt))])) / dt
    start_w = next((w for w in range(1, max_w + 1) if f_true[w] > first_rate), max_w)

    factories: dict[str, Callable[[], Planner]]
    if isinstance(policies, dict):
        factories = dict(policies)
    else:
        factories = {}
        for name in policies:
            planners.get(name)  # raises ConfigError for an unknown name
            factories[name] = planner_factory(name, cfg, mig)
    results: dict[str, PolicyResult] = {}
    for name, make in factories.items():
        planner = make()
        if history is not None and len(history) and hasattr(planner, "observe_history"):
            planner.observe_history(list(map(float, history)), dt)
        job = _Job(workers=start_w, allocated=start_w, consumed=np.zeros(parts))
        # the first decision sizes the job at launch (not ``ready``: the job is being launched, there
        # are no metrics yet): no action, no downtime. Policies that scale from metrics keep start_w,
        # the count the first hour's traffic needs.
        first = planner.plan(
            JobObservation.model_construct(
                job_id=name, min_workers=1, max_workers=max_w, current_workers=start_w, samples_per_s=0.0,
                applied_step=-1, stragglers=0, now_s=0.0, ready=False,
                stream=StreamObservation.model_construct(
                    interval_s=dt, arrivals=[], measured=[], backlog=0.0, lag_s=0.0, utilization=0.0,
                ),
            )
        )
        job.workers = job.allocated = max(1, min(max_w, first.workers))
        workers_log = np.zeros(n)
        lag_log = np.zeros(n)
        last_util = 0.0
        busy_shares: list[float] = []  # of the intervals the workers reported in, oldest first
        for k in range(n):
            t0, t1 = k * dt, (k + 1) * dt
            # -- carry out a scaling action in progress
            train_s = dt
            ended = False
            if job.action_new is not None:
                pause_lo, pause_hi = max(t0, job.action_prep_end), min(t1, job.action_end)
                paused = max(0.0, pause_hi - pause_lo)
                train_s -= paused
                job.downtime_s += paused
                if job.action_end <= t1:
                    if job.action_new < job.workers:
                        job.settled_at = job.action_end + mig.scale_in_settle_s
                    job.workers = job.action_new
                    job.action_new = None
                    ended = True
            allocated = (job.workers if job.action_new is None
                         else mig.held(job.workers, job.action_new, t0 - job.action_start, dt))
            # workers during the trained part: the old ones until the pause, the new ones after
            w_train = job.workers
            rate = f_true[w_train] * noise[k]
            capacity = rate * train_s
            reachable = part_cum[k + 1] if cfg.latency_s <= 0 else _cum_at(part_cum, part_arrivals, t1 - cfg.latency_s, dt)
            available = np.maximum(0.0, reachable - job.consumed)
            served = _serve(available, capacity, None if cfg.partitions is None else 1 if shuffled else w_train)
            job.consumed += served
            done = float(served.sum())
            waiting = part_cum[k + 1] - job.consumed
            backlog = float(waiting.sum())
            lag = max((_lag(part_cum, part_arrivals, float(c), t1, dt) for c, left in zip(job.consumed, waiting, strict=True)
                       if left > 1e-6 / parts), default=0.0)
            if shuffled and w_train > 0 and rate > 0:
                lag = max(lag, _shuffle_wait(part_arrivals[k], w_train, rate, cfg, dt))
            if train_s > 0 and rate > 0:
                # the busy share of the interval: the part of it spent in a pause is idle, as a live
                # worker counts it; an interval paused throughout reports nothing (a live worker in
                # a pause sends no report), so the reading before the action stands
                busy_shares.append(done / (rate * dt))
                last_util = _busy_reading(busy_shares, dt, cfg.busy_window_s)
            workers_log[k] = allocated
            lag_log[k] = lag
            measured = [(float(w_train), rate * cfg.capacity_reading)] if train_s >= dt and w_train > 0 else []
            obs = JobObservation.model_construct(
                job_id=name,
                min_workers=1,
                max_workers=max_w,
                current_workers=job.workers if job.action_new is None else job.action_new,
                samples_per_s=done / dt,
                applied_step=-1,
                stragglers=0,
                now_s=t1,
                # not ready while a scaling action is under way, nor in the interval it ends in: its
                # workers have just started and its busy share mixes the pause with the catch-up
                # after it (Kubernetes' HPA samples no pod before it is ready)
                ready=job.action_new is None and not ended and t1 >= job.settled_at,
                throughput=[], workers=[], pauses=[],  # given: pydantic's default factories are slow
                stream=StreamObservation.model_construct(
                    interval_s=dt,
                    arrivals=[float(arrivals[k])],
                    measured=measured,
                    backlog=backlog,
                    lag_s=lag,
                    utilization=last_util,
                    partitions=cfg.partitions or 0,
                    queue_upper=cfg.shuffle_upper or 0.0,
                    step_batch=cfg.shuffle_batch or 0.0,
                    intake_spread=cfg.shuffle_spread,
                ),
            )
            plan = planner.plan(obs)
            want = max(1, min(max_w, plan.workers))
            if job.action_new is None and want != job.workers:
                prep, pause = mig.cost(scale_out=want > job.workers)
                job.action_new = want
                job.action_start = t1
                job.action_prep_end = t1 + prep
                job.action_end = t1 + prep + pause
                job.actions += 1
        results[name] = PolicyResult(
            name=name,
            slo_violation_rate=float(np.mean(lag_log > SLO_LAG_S)),
            accumulated_lag_min=float(np.sum(lag_log / 60.0) * dt / 60.0),
            downtime_min=job.downtime_s / 60.0,
            worker_hours=float(np.sum(workers_log) * dt / 3600.0),
            scaling_actions=job.actions,
            workers=workers_log,
            lag_s=lag_log,
        )
    return results


def _serve(available: np.ndarray, capacity: float, workers: int | None) -> np.ndarray:
    """What each partition gets trained of ``available`` with ``capacity`` in all: from the pool
    (``workers`` None), or per worker, each with ``capacity / workers`` over the partitions it
    reads (i, i + workers, ...), water-filled."""
    if workers is None or workers <= 0:
        return np.minimum(available, capacity)
    served = np.zeros_like(available)
    for i in range(min(workers, len(available))):
        mine = np.arange(i, len(available), workers)
        left = capacity / workers
        for j, p in enumerate(mine[np.argsort(available[mine], kind="stable")]):
            served[p] = min(available[p], left / (len(mine) - j))
            left -= served[p]
    return served


def _shuffle_wait(per_partition: float, workers: int, rate: float, cfg: SimConfig, dt: float) -> float:
    """The lag under global shuffling while the pool keeps up (module docstring): the pipeline,
    plus what the busiest worker's local queue holds a record (``tidal.brain.kale.shuffle_wait_s``),
    or the lag measured at this count and load (``SimConfig.rest_lags``); 0 with nothing arriving."""
    assert cfg.partitions is not None and cfg.shuffle_upper is not None
    if per_partition <= 0:
        return 0.0
    if cfg.rest_lags and (measured := cfg.rest_lags.get(workers)):
        loads, lags = zip(*measured, strict=True)
        return float(np.interp(per_partition * cfg.partitions / (rate * dt), loads, lags))
    return cfg.latency_s + shuffle_wait_s(per_partition * cfg.partitions / dt, cfg.partitions, workers, rate,
                                          cfg.shuffle_upper, cfg.shuffle_batch or 0.0, cfg.shuffle_spread,
                                          cfg.shuffle_read_s)


def _cum_at(cum: np.ndarray, arrivals: np.ndarray, t: float, dt: float) -> float:
    """Samples arrived by time ``t`` (spread evenly within each interval, as ``_lag`` counts)."""
    if t <= 0:
        return 0.0
    j = min(int(t // dt), len(arrivals) - 1)
    return float(cum[j] + min(1.0, t / dt - j) * arrivals[j])


def _lag(cum: np.ndarray, arrivals: np.ndarray, consumed: float, now: float, dt: float) -> float:
    """Age of the oldest waiting sample: arrivals are spread evenly within each interval."""
    j = int(np.searchsorted(cum, consumed, side="right")) - 1  # interval of the next sample
    j = min(max(j, 0), len(arrivals) - 1)
    frac = (consumed - cum[j]) / arrivals[j] if arrivals[j] > 0 else 0.0
    return max(0.0, now - (j + frac) * dt)


def planner_factory(name: str, cfg: SimConfig, mig: Migration, **kale: Any) -> Callable[[], Planner]:
    """The planner ``name`` as the simulated job configures it: the lead time is a scale-out's length (the
    action that must come in time). ``kale``: more ``KalePlanner`` arguments (a yardstick's forecaster)."""
    from tidal.brain.baselines import MaduPlanner
    from tidal.brain.kale import KalePlanner

    lead = mig.prep_s + mig.pause_s
    if name == "kale":
        if not cfg.time_share:
            kale = {"deadline_s": None, **kale}
        kale = {"program_horizon_s": cfg.program_horizon_s, "program_lag_price": cfg.program_lag_price,
                "program_lag_ratio": cfg.program_lag_ratio, **kale}
        return lambda: KalePlanner(lead_s=lead, pause_s=mig.pause_s, measure_actions=False, batch_size=cfg.batch_size,
                                   headroom=cfg.load_headroom, lag_price=cfg.lag_price,
                                   planned_lag_s=cfg.planned_lag_s, **kale)
    if kale:
        raise ConfigError(f"KalePlanner arguments given for {name!r}")
    if name == "madu":
        return lambda: MaduPlanner(lead_s=lead)
    return lambda: planners.get(name)


def forecast_wait_s(name: str, cfg: SimConfig, history_s: float) -> float:
    """How far into the window the planner ``name`` runs without a forecast, given ``history_s``
    seconds of arrivals before it: a forecasting planner fits its forecaster once it has seen
    ``min_history_bins`` planning bins (kale's and madu's Holt-Winters: two days and two bins of
    10 minutes); 0 for a planner that forecasts nothing or has history enough. Until then kale
    scales out by its threshold fallback alone (and in to what the last 3 hours' busiest
    20 minutes need) and madu keeps its count."""
    planner = planner_factory(name, cfg, MIGRATIONS[cfg.migration])()
    bins, every = getattr(planner, "min_history_bins", None), getattr(planner, "plan_interval_s", None)
    if bins is None or every is None:
        return 0.0
    return max(0.0, bins * float(every) - history_s)


def load_trace(rows: Sequence[Sequence[str]], column: str | None) -> tuple[np.ndarray, float]:
    """Counts per interval and the interval (seconds) from CSV rows (header first).

    The first column is time: timestamps (``YYYY-MM-DD HH:MM[:SS]``) or minutes as numbers;
    the count column is ``column`` or the second one. Missing intervals count as zero.
    """
    if len(rows) < 3:
        raise ConfigError("the trace needs a header and at least two rows")
    header = [h.strip() for h in rows[0]]
    if column is None:
        if len(header) < 2:
            raise ConfigError("the trace needs a time column and a count column")
        ci = 1
    else:
        if column not in header:
            raise ConfigError(f"no column {column!r} in the trace (columns: {', '.join(header)})")
        ci = header.index(column)
    times, counts = [], []
    for i, row in enumerate(rows[1:], start=2):
        try:
            counts.append(float(row[ci]))
        except (ValueError, IndexError):
            raise ConfigError(f"line {i}: count {row[ci] if ci < len(row) else ''!r} is not a number") from None
        times.append(_parse_time(row[0], i))
    t = np.array(times)
    steps = np.diff(t)
    if np.any(steps <= 0):
        raise ConfigError("the trace's times must increase")
    interval = float(np.min(steps))  # gaps are missing intervals (zero arrivals)
    idx = np.round((t - t[0]) / interval).astype(int)
    out = np.zeros(idx[-1] + 1)
    np.add.at(out, idx, np.maximum(np.array(counts), 0.0))
    if not math.isfinite(float(out.sum())):
        raise ConfigError("the trace has non-finite counts")
    return out, interval


def _parse_time(text: str, line: int) -> float:
    from datetime import datetime

    s = text.strip()
    try:
        return float(s) * 60.0
    except ValueError:
        pass
    try:
        stamp = datetime.fromisoformat(s)
        if stamp.tzinfo is None:  # naive timestamps are read as UTC: no DST jumps
            stamp = stamp.replace(tzinfo=UTC)
        return stamp.timestamp()
    except ValueError:
        raise ConfigError(f"line {line}: time {s!r} is neither a timestamp nor a number of minutes") from None
