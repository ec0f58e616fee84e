"""Worker-count planners for data-parallel (all-reduce) jobs: what ``tidal run --planner`` runs.

The papers' planners size parameter-server jobs (``tidal.brain.dlrover``, ``dlrover_rm``, ``es``,
``optimus_alloc``: workers, servers and their cores, which the cluster simulator places). A job
that reads a dataset with all-reduce has one knob, its number of workers, and these are the same
policies on that knob. Every one implements ``tidal.brain.api.Planner`` and decides from the
``JobObservation`` alone: the master builds it live, ``tidal.sim.job`` from a throughput model.

What they share (``Curve``): one throughput point per worker count the job ran with
(``obs.throughput``: the master measures each count while nothing is starting or re-forming),
the ``data-parallel`` model of ``tidal.brain.models`` refitted by NNLS on those points, and the
value of a count: the measured throughput where there is one, the model's prediction elsewhere.
A planner holds while the current count has been measured less than ``settle_s`` seconds (its
first decision after a change waits for a measurement of the change: the stabilisation of Kale
3.4, and DLRover-RM's "stabilized changes").

* ``fixed``: the count the job started with (``--workers N`` or MIN:MAX's initial), never changed.
* ``es``: DLRover's Elastic Scheduler baseline (section 6.3) on workers: add ``step`` while the
  scaling efficiency of the last step (``tidal.brain.es.scaling_efficiency``) is at least 0.3,
  then undo the step that fell below and stop.
* ``optimus``: Optimus as DLRover describes it (section 6.3): fit Optimus Eq. 2
  (``tidal.brain.models.OptimusModel``, no PS) and add a worker while it predicts a gain over
  ``min_gain`` (2%) of the current throughput; it explores one worker at a time until the model
  has as many points as coefficients.
* ``dlrover``: DLRover's sample -> optimize -> adjust (sections 4.1-4.2) on workers. Sample: one
  worker, measure its CPU use ``w_hat`` (cores) and throughput. Optimize: the count the job's
  CPUs feed, ``N_w = C_total / w_hat`` (DLRover's Eq. for workers given the cores left),
  within MIN:MAX. Adjust: once measured there, fit the model on the two points and move to the
  fewest workers whose value is within ``slack`` of the best; then hold, except once for a job
  with parameter servers (``obs.ps``) whose servers use less than ``idle_ps_util`` of their
  cores: DLRover 4.2's idle-PS-CPU rule adds workers, ``s_hat = s_used / N_w`` and
  ``N_w' = min(s_total / s_hat, MAX)`` (``tidal.brain.dlrover.adjust_idle_ps``).
* ``dlrover-rm``: DLRover-RM's three stages (sections 4.2-4.3) on workers. Stage 1, warm start
  (Algorithm 1, Eq. 10): the exponentially smoothed worker count of the most similar finished
  jobs (``tidal.brain.dlrover_rm.warm_start``) and the most similar job's fitted model as the
  prior; cold, it starts like DLRover with one worker. Stage 2, every decision: refit the model
  online and move to the fewest workers whose predicted time to finish the samples left is
  within ``slack`` of the fastest count's (the oracle's own rule: as fast as the fastest at the
  least cost, Eq. 9's two objectives made one). The time to finish carries Eq. 8's overheads,
  ``TG = dPsi - (dPsi t_start + Psi t_pause) / H``: new workers train only after ``t_start``
  (the job goes on at the current rate meanwhile) and every change costs a pause, so a
  scale-out near the end of the job does not pay for its start-up. Counts beyond the largest
  measured one (by this job or the similar one) are candidates only while its last step still
  scaled (each added worker gave at least half a worker's throughput), and then up to twice it. A job of unknown
  length (no total) decides on throughput alone: the fewest workers within ``slack`` of the best.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from tidal.api import JobObservation, ResourcePlan
from tidal.brain.api import FitError, ThroughputConfig, ThroughputSample
from tidal.brain.dlrover import IDLE_PS_UTIL, adjust_idle_ps
from tidal.brain.dlrover_rm import warm_start
from tidal.brain.es import scaling_efficiency
from tidal.brain.history import Feature, HistoryStore, top_k
from tidal.brain.models import DataParallelModel, OptimusModel

__all__ = [
    "POINT_KEY",
    "SETTLE_S",
    "Curve",
    "DLRoverRMWorkers",
    "DLRoverWorkers",
    "ESWorkers",
    "FixedWorkers",
    "OptimusWorkers",
    "efficient_count",
    "history_params",
]

#: measured seconds at the current count before a planner decides again
SETTLE_S = 3.0
#: a count within this share of the best throughput is as good as the best (the bench's oracle rule)
SLACK = 0.10
#: history parameters ``samples_per_s@W``: the throughput a finished job measured at W workers
POINT_KEY = "samples_per_s@"


class Curve:
    """The job's throughput by worker count: measured points, and the model fitted on them.

    Args:
        obs: the observation (its ``throughput`` points with ``ps == 0``).
        prior: a similar past job's record (``history_params``): the coefficients of its
            ``data-parallel`` model, the start while fewer than two counts are measured
            (rescaled to the measured point), and the throughput it measured per count, which
            stands in for the counts this job has not measured (rescaled by the counts both
            measured): a measurement of a job like this one beats an extrapolation.
    """

    def __init__(self, obs: JobObservation, prior: Mapping[str, float] | None = None) -> None:
        self.batch = max(obs.batch_size, 1)
        self.measured: dict[int, float] = {p.workers: p.samples_per_s for p in obs.throughput
                                           if p.ps == 0 and p.samples_per_s > 0}
        self.seconds: dict[int, float] = {p.workers: p.seconds for p in obs.throughput if p.ps == 0}
        self.model: DataParallelModel | None = None
        self.error_pct: float | None = None
        terms = set(DataParallelModel().terms())
        model_prior = {k: v for k, v in (prior or {}).items() if k in terms}
        self._fit(model_prior if set(model_prior) == terms else None)
        self.similar = self._similar_points(prior or {})

    def _similar_points(self, prior: Mapping[str, float]) -> dict[int, float]:
        points = {int(k[len(POINT_KEY):]): v for k, v in prior.items() if k.startswith(POINT_KEY) and v > 0}
        common = [w for w in points if w in self.measured]
        if not points:
            return {}
        # no count in common: taken as they are (the job is similar: the warm start said so)
        scale = sum(self.measured[w] / points[w] for w in common) / len(common) if common else 1.0
        return {w: v * scale for w, v in points.items()}

    def _fit(self, prior: Mapping[str, float] | None) -> None:
        samples = [ThroughputSample(ThroughputConfig(w, batch_size=w * self.batch), thp)
                   for w, thp in sorted(self.measured.items())]
        if len(samples) >= 2:
            try:
                self.model = DataParallelModel().fit(samples)
            except FitError:
                self.model = None
        elif samples and prior:
            model = DataParallelModel(dict(prior))
            (w, thp), = self.measured.items()
            predicted = model.predict(ThroughputConfig(w, batch_size=w * self.batch))
            if predicted > 0:  # step time scales with theta0, theta1: match the measured point
                scale = predicted / thp
                model.params = {k: v * scale if k != "knee" else v for k, v in model.params.items()}
                self.model = model
        if self.model is not None and self.measured:
            errors = [abs(self.predict(w) - thp) / thp for w, thp in self.measured.items()]
            self.error_pct = 100.0 * sum(errors) / len(errors)

    def predict(self, workers: int) -> float:
        assert self.model is not None
        return self.model.predict(ThroughputConfig(workers, batch_size=workers * self.batch))

    def value(self, workers: int) -> float | None:
        """Measured throughput at ``workers``, else a similar job's (rescaled), else the model's
        prediction, else None."""
        if workers in self.measured:
            return self.measured[workers]
        if workers in self.similar:
            return self.similar[workers]
        return None if self.model is None else self.predict(workers)

    def explore_up_to(self, efficiency: float) -> int:
        """The largest count worth predicting: twice the largest one measured (by this job or the
        similar one) while its last step still scaled (the added workers gave at least
        ``efficiency`` of a worker's throughput each), else that count itself (beyond a
        flattened curve, the model only extrapolates)."""
        known = {**self.similar, **self.measured}
        top = max(known)
        below = [w for w in known if w < top]
        if not below:
            return 2 * top
        prev = max(below)
        return 2 * top if scaling_efficiency(known[prev], prev, known[top], top) >= efficiency else top

    def settled(self, obs: JobObservation, settle_s: float) -> bool:
        """The current count has been measured ``settle_s`` seconds, nothing starting."""
        return obs.ready and self.seconds.get(obs.current_workers, 0.0) >= settle_s

    def best_count(self, lo: int, hi: int, slack: float = SLACK) -> int | None:
        """The fewest workers in ``lo..hi`` whose value is within ``slack`` of the best value."""
        values = {w: self.value(w) for w in range(lo, hi + 1)}
        return efficient_count({w: v for w, v in values.items() if v is not None}, slack)

    def plan(self, workers: int, reason: str) -> ResourcePlan:
        """A plan for ``workers`` that carries this curve's model (for the journal and status)."""
        if self.model is None:
            return ResourcePlan(workers=workers, reason=reason)
        return ResourcePlan(workers=workers, reason=reason, model=self.model.name,
                            params={k: round(v, 6) for k, v in self.model.params.items()},
                            error_pct=None if self.error_pct is None else round(self.error_pct, 2))


def _within_range(obs: JobObservation, wanted: int) -> int:
    return min(max(wanted, obs.min_workers), obs.max_workers)


def _starting(obs: JobObservation) -> bool:
    """Nothing has run yet: the planner picks the count to start with."""
    return obs.current_workers == 0 and not obs.throughput


def _current(obs: JobObservation) -> int:
    """The count the job runs with or is moving to (the master's target before any worker ran)."""
    return obs.target_workers or obs.current_workers


class FixedWorkers:
    """Never changes the count the job started with."""

    name = "fixed"

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers

    def plan(self, obs: JobObservation) -> ResourcePlan:
        if self.workers is None:
            self.workers = _current(obs) or obs.max_workers
        return ResourcePlan(workers=_within_range(obs, self.workers), reason="fixed count")


class ESWorkers:
    """DLRover's ES baseline on workers: ``step`` at a time while the scaling efficiency holds."""

    name = "es"

    def __init__(self, step: int = 1, threshold: float = 0.3, settle_s: float = SETTLE_S) -> None:
        self.step, self.threshold, self.settle_s = step, threshold, settle_s
        self.done = False

    def plan(self, obs: JobObservation) -> ResourcePlan:
        curve = Curve(obs)
        now = _current(obs)
        if _starting(obs):
            return ResourcePlan(workers=_within_range(obs, obs.min_workers), reason="start with MIN workers")
        if self.done or not curve.settled(obs, self.settle_s):
            return curve.plan(now, "stopped: the last step did not scale" if self.done else f"measuring {now} workers")
        below = max((w for w in curve.measured if w < now), default=None)
        if below is not None:
            eff = scaling_efficiency(curve.measured[below], below, curve.measured[now], now)
            if eff < self.threshold:
                self.done = True
                return curve.plan(below, f"scaling efficiency {below}->{now} is {eff:.2f} < {self.threshold}: "
                                         f"back to {below} and stop")
        if now >= obs.max_workers:
            self.done = True
            return curve.plan(now, "at MAX workers")
        return curve.plan(min(now + self.step, obs.max_workers),
                          f"add {self.step}: efficiency held at {now} workers")


class OptimusWorkers:
    """Optimus on workers: add one while its fitted model predicts a gain over ``min_gain``."""

    name = "optimus"

    def __init__(self, step: int = 1, min_gain: float = 0.02, settle_s: float = SETTLE_S) -> None:
        self.step, self.min_gain, self.settle_s = step, min_gain, settle_s

    def plan(self, obs: JobObservation) -> ResourcePlan:
        curve = Curve(obs)
        now = _current(obs)
        if _starting(obs):
            return ResourcePlan(workers=_within_range(obs, obs.min_workers), reason="start with MIN workers")
        if not curve.settled(obs, self.settle_s):
            return curve.plan(now, f"measuring {now} workers")
        model = OptimusModel()
        points = [ThroughputSample(ThroughputConfig(w, batch_size=w * curve.batch), thp)
                  for w, thp in sorted(curve.measured.items())]
        nxt = min(now + self.step, obs.max_workers)
        if len(points) < len(model.terms()):
            return curve.plan(nxt, f"exploring: {len(points)} of {len(model.terms())} points for Optimus Eq. 2")
        try:
            model.fit(points)
        except FitError as exc:
            return curve.plan(now, f"Optimus Eq. 2 does not fit: {exc}")
        gain = (model.predict(ThroughputConfig(nxt, batch_size=nxt * curve.batch))
                - model.predict(ThroughputConfig(now, batch_size=now * curve.batch)))
        current = model.predict(ThroughputConfig(now, batch_size=now * curve.batch))
        params = {k: round(v, 9) for k, v in model.params.items()}
        if nxt > now and gain > self.min_gain * current:
            return ResourcePlan(workers=nxt, model=model.name, params=params,
                                reason=f"Optimus Eq. 2 predicts +{gain:.0f} samples/s (> {self.min_gain:.0%})")
        return ResourcePlan(workers=now, model=model.name, params=params,
                            reason=f"Optimus Eq. 2 predicts +{gain:.0f} samples/s for one more worker: stay")


class DLRoverWorkers:
    """DLRover's sample -> optimize -> adjust on a data-parallel job's workers."""

    name = "dlrover"

    def __init__(self, cpus: float = 0.0, settle_s: float = SETTLE_S, slack: float = SLACK,
                 idle_ps_util: float = IDLE_PS_UTIL) -> None:
        self.cpus, self.settle_s, self.slack, self.idle_ps_util = cpus, settle_s, slack, idle_ps_util
        self.stage = "sample"
        self.adjusted_idle_ps = False

    def plan(self, obs: JobObservation) -> ResourcePlan:
        curve = Curve(obs)
        now = _current(obs)
        if _starting(obs):
            return ResourcePlan(workers=_within_range(obs, 1), reason="sample stage: one worker")
        if not curve.settled(obs, self.settle_s):
            return curve.plan(now, f"{self.stage} stage: measuring {now} workers")
        if self.stage == "sample":
            self.stage = "optimize"
            used = [w.cpu_percent / 100.0 for w in obs.workers if w.cpu_percent > 0]
            cpus = self.cpus or obs.cpus_available
            if not used or cpus <= 0:
                return curve.plan(obs.max_workers, "optimize stage: no CPU measurement, MAX workers")
            w_hat = sum(used) / len(used)
            n_w = _within_range(obs, math.floor(cpus / max(w_hat, 1e-3)))
            return curve.plan(n_w, f"optimize stage: a worker uses {w_hat:.2f} cores, {cpus:g} cores feed {n_w}")
        if self.stage == "optimize":
            self.stage = "adjust"
            best = curve.best_count(obs.min_workers, obs.max_workers, self.slack)
            if best is None:
                return curve.plan(now, "adjust stage: no model")
            return curve.plan(best, f"adjust stage: {best} workers are within {self.slack:.0%} of the best")
        idle = self._idle_ps(obs, now)
        if idle is not None:
            return curve.plan(*idle)
        return curve.plan(now, "adjusted")

    def _idle_ps(self, obs: JobObservation, now: int) -> tuple[int, str] | None:
        """DLRover 4.2's idle PS CPU, once: more workers where the servers have cores to spare."""
        ps = obs.ps
        if self.adjusted_idle_ps or ps is None or not ps.ps_cpu_used or ps.ps <= 0:
            return None
        used, total = sum(ps.ps_cpu_used), ps.ps * ps.ps_cpu
        if used <= 0 or used >= self.idle_ps_util * total:
            return None
        self.adjusted_idle_ps = True
        n_w = adjust_idle_ps(now, used, total, obs.max_workers)
        if n_w <= now:
            return None
        return n_w, (f"idle PS CPU: the servers use {used:.2f} of their {total:g} cores ({used / now:.2f} a worker): "
                     f"{n_w} workers")


class DLRoverRMWorkers:
    """DLRover-RM's warm start, online refit and stabilised changes on a job's workers.

    Args:
        features: the job's signature (the warm start's similarity features).
        history: finished jobs (read at construction only).
        t_start_s, t_pause_s: Eq. 8's overheads: a new worker's start-up, a re-form's pause.
    """

    name = "dlrover-rm"

    def __init__(self, features: Mapping[str, Feature] | None = None, history: HistoryStore | None = None,
                 settle_s: float = SETTLE_S, slack: float = SLACK, t_start_s: float = 5.0,
                 t_pause_s: float = 0.1, k: int = 5, mu: float = 0.5, scaling_efficiency: float = 0.5) -> None:
        self.settle_s, self.slack, self.t_start_s, self.t_pause_s = settle_s, slack, t_start_s, t_pause_s
        self.scaling_efficiency = scaling_efficiency
        self.prior: dict[str, float] | None = None
        self.warm_workers: int | None = None
        self.warm_from = ""
        if history is not None and features:
            smoothed = warm_start(history, features, k, mu)
            if smoothed is not None and "workers" in smoothed:
                self.warm_workers = max(1, round(smoothed["workers"]))
                similar = top_k(history, features, 1, 0.5)
                if similar:
                    score, record = similar[0]
                    self.warm_from = f"{record.job_id} (similarity {score:.2f})"
                    self.prior = {k: float(v) for k, v in record.params.items()} or None

    def plan(self, obs: JobObservation) -> ResourcePlan:
        curve = Curve(obs, self.prior)
        now = _current(obs)
        if _starting(obs):
            if self.warm_workers is not None:
                start = _within_range(obs, self.warm_workers)
                return curve.plan(start, f"warm start (Algorithm 1) from {self.warm_from}: {start} workers")
            return curve.plan(_within_range(obs, 1), "cold start: one worker")
        if not curve.settled(obs, self.settle_s):
            return curve.plan(now, f"measuring {now} workers")
        if curve.model is None:  # one count measured, no prior: double to learn the slope
            nxt = _within_range(obs, 2 * now)
            return curve.plan(nxt, f"exploring: {now} -> {nxt} workers to fit the model")
        remaining = obs.total_samples - obs.committed_samples if obs.total_samples else 0
        lo, hi = obs.min_workers, min(obs.max_workers, curve.explore_up_to(self.scaling_efficiency))
        if remaining <= 0:  # unbounded (or unknown) job: the throughput alone decides
            best = curve.best_count(lo, hi, self.slack)
            if best is None or best == now:
                return curve.plan(now, f"{now} workers are within {self.slack:.0%} of the best throughput")
            return curve.plan(best, f"{best} workers are within {self.slack:.0%} of the best throughput")
        finish = {w: self.finish_s(curve, w, now, remaining) for w in range(lo, hi + 1)}
        fastest = min(finish.values())
        best = min(w for w, t in finish.items() if t <= (1 + self.slack) * fastest)
        psi_now, psi_new = curve.value(now) or 0.0, curve.value(best) or 0.0
        below = now - 1
        if (best == now and below >= lo and below not in curve.measured and below not in curve.similar
                and finish[below] <= (1 + 2 * self.slack) * fastest and finish[now] > 4 * self.t_start_s):
            # the model cannot tell whether one worker fewer would do (an unmeasured knee):
            # releasing one is cheap and measuring it settles the question
            return curve.plan(below, f"probing {below} workers: predicted to finish in {finish[below]:.0f} s, "
                                     f"near the fastest ({fastest:.0f} s), never measured")
        if best == now:
            quicker = max(finish, key=lambda w: curve.value(w) or 0.0)  # the highest throughput
            why = "" if quicker <= now else (
                f"; {quicker} train faster but would finish in {finish[quicker]:.0f} s with their "
                f"{self.t_start_s:g} s start-up (Eq. 8)")
            return curve.plan(now, f"{now} workers finish the {remaining} samples left in {finish[now]:.0f} s, "
                                   f"within {self.slack:.0%} of the fastest{why}")
        if best < now:
            return curve.plan(best, f"{best} workers finish in {finish[best]:.0f} s, within {self.slack:.0%} of the "
                                    f"fastest ({fastest:.0f} s): release {now - best}")
        tg = throughput_gain(psi_new, psi_now, self.t_start_s, self.t_pause_s, remaining / max(psi_now, 1e-9))
        return curve.plan(best, f"{best} workers finish in {finish[best]:.0f} s against {finish[now]:.0f} s now "
                                f"({psi_new:.0f} samples/s against {psi_now:.0f}, Eq. 8 gain {tg:.0f})")

    def finish_s(self, curve: Curve, workers: int, now: int, remaining: int) -> float:
        """Seconds to train ``remaining`` samples with ``workers``, with Eq. 8's overheads: the new
        workers' start-up (the job trains on at the current rate meanwhile) and the re-form's pause."""
        value = curve.value(workers)
        if not value:
            return math.inf
        if workers == now:
            return remaining / value
        pause = self.t_pause_s
        if workers < now:
            return pause + remaining / value
        start = self.t_start_s
        during = min(remaining, start * (curve.value(now) or 0.0))  # trained while they start
        return start + pause + (remaining - during) / value


def history_params(plan: ResourcePlan | None, points: Mapping[int, float]) -> dict[str, float]:
    """What a finished job leaves in the history for the next one's warm start: its fitted
    ``data-parallel`` coefficients and the throughput it measured per count."""
    out = dict(plan.params) if plan is not None and plan.model == DataParallelModel.name else {}
    out.update({f"{POINT_KEY}{w}": round(v, 3) for w, v in sorted(points.items()) if v > 0})
    return out


def efficient_count(points: Mapping[int, float], slack: float = SLACK) -> int | None:
    """The fewest workers whose throughput is within ``slack`` of the best in ``points`` (None when
    empty): what a planner settles on, and the count a finished job is recorded with from what
    it measured (not its last count, which the end of a job bends)."""
    if not points:
        return None
    best = max(points.values())
    return min(w for w, v in points.items() if v >= (1 - slack) * best)


def throughput_gain(psi_new: float, psi_now: float, t_start_s: float, t_pause_s: float, horizon_s: float) -> float:
    """DLRover-RM Eq. 8, ``TG = dPsi - (dPsi t_start + Psi t_pause) / H``, for new workers."""
    if horizon_s <= 0:
        return -math.inf
    d_psi = psi_new - psi_now
    return d_psi - (d_psi * t_start_s + psi_now * t_pause_s) / horizon_s

