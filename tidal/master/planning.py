"""The job's planner inside the master: measurements in, decisions out, both kept.

``Planning`` owns what the brain needs from a live job and what the user sees of it:

* throughput per worker count (``measure``, ``tidal.brain.meter``, as the job simulator measures
  it): samples committed per second while the job ran with a given number of workers and
  nothing was starting or re-forming, the first interval after each change left out;
* the ``JobObservation`` handed to the planner (``observe``): those points, each worker's step
  split, CPU and memory, the pauses since the previous decision, progress;
* the decisions (``decide``): every change of the target, with the inputs it rested on, the
  reason and the throughput model the planner fitted; the master journals them (``to_meta``,
  restored by ``restore`` on failover) and shows them in ``tidal status`` and the dashboard;
* the timeline the dashboard draws: throughput, workers and target, one point a second;
* a stream job's lag against its SLO (``StreamLag``, scored as ``tidal.sim.online`` scores a
  policy, so live and simulated runs compare), journaled by the master under its own key;
* the past traffic the planner was seeded with (``seed_history``, ``--traffic-history``).
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tidal.api import (
    DataWorkerObservation,
    Event,
    JobObservation,
    PauseObservation,
    PlannerDecision,
    PlannerStatus,
    PSObservation,
    ResourcePlan,
    StreamLagStatus,
    StreamObservation,
    ThroughputPoint,
    TimelinePoint,
    WorkerObservation,
)
from tidal.brain.api import Planner
from tidal.brain.meter import ThroughputMeter
from tidal.master.membership import WorkerRecord

__all__ = ["MAX_DECISIONS", "MAX_TIMELINE", "ArrivalMeter", "Planning", "StreamLag", "intake_spread", "partition_lag_s", "stream_busy", "stream_lag_s", "worker_lag_s"]

MAX_DECISIONS = 200  # decisions kept (and journaled); the count of all of them is kept too
MAX_TIMELINE = 3600  # timeline points kept: an hour at one a second
# What a change of the worker count costs this runtime (wall seconds), a planner's prior until it
# has measured the job's own actions (kale does): the new workers start while the old ones train
# (a process importing torch and joining: 3-5 s on the 2-core VM, bench/online_live.py measured
# 3.2 s from decision to hand-over; forked from the local backend's fork server, 0.5-1.5 s,
# bench/launch.py), then training pauses for the re-form (0.05-0.9 s measured). The prior stays
# on the slow side: a backend without a fork server (Ray, or TIDAL_FORKSERVER=0) pays it.
ACTION_LEAD_S = 4.0
ACTION_PAUSE_S = 0.5
MEASURE_UTILIZATION = 0.25  # below it, too few records to extrapolate a stream job's capacity from
# wall seconds a worker's lag measurement holds before the lag ages on from it: its loader measures
# once a second (tidal.worker.stream_loader.BACKLOG_EVERY_S), its reporter sends every 0.25 s
LAG_STALE_S = 2.0


def stream_lag_s(now: float, time_scale: float, members: Sequence[WorkerRecord]) -> float | None:
    """The age of the oldest record waiting in the stream, in trace time: from the arrival time
    (its id) the members report of the oldest record waiting after what they read, as of when
    they looked (``_age_s``); 0 when nothing waits; None while no member has reported its
    partitions (the master never reads the stream: the lag is not known)."""
    if not any(r.stream_backlog >= 0 for r in members):
        return None
    return max(worker_lag_s(now, time_scale, r) for r in members)


def worker_lag_s(now: float, time_scale: float, r: WorkerRecord) -> float:
    """The age of the oldest record one worker reported waiting for it (unread in its partitions,
    or in its local queue, forwarded ones too), in trace time; 0 when none waits."""
    return _age_s(now, r.stream_oldest_ms, r.stream_measured_ms) * time_scale if r.stream_oldest_ms > 0 else 0.0


def stream_busy(members: Sequence[WorkerRecord]) -> float | None:
    """The members' mean busy share (``tidal.worker.stream_loader``); None: none reported it."""
    busy = [r.stream_busy for r in members if r.stream_busy >= 0]
    return min(1.0, sum(busy) / len(busy)) if busy else None


def intake_spread(members: Sequence[WorkerRecord]) -> float:
    """The median spread of the step intake (``WorkerRecord.stream_intake_spread``) of the
    members reading the most partitions, whose queues decide the shuffle wait
    (``tidal.brain.kale.shuffle_wait_s``); 0 when none measured it."""
    most = max((len(r.stream_lag) for r in members), default=0)
    spreads = [r.stream_intake_spread for r in members if len(r.stream_lag) == most and r.stream_intake_spread >= 0]
    return float(statistics.median(spreads)) if spreads else 0.0


def partition_lag_s(now: float, time_scale: float, reader: WorkerRecord, partition: int) -> float:
    """The age of the oldest record waiting in ``partition``, in trace time, as its reader
    reports it (0: nothing waits)."""
    ms = reader.stream_oldest_by_partition.get(partition, 0)
    return _age_s(now, ms, reader.stream_measured_ms) * time_scale if ms > 0 else 0.0


def _age_s(now: float, oldest_ms: int, measured_ms: int) -> float:
    """A waiting record's age (wall seconds): as the worker measured it, and growing from then
    on only once the measurement is older than ``LAG_STALE_S`` (a worker that stalled or died).
    Aging every measurement from its report would add up to a measuring period and a report
    (about 1.25 s) to every lag: under a 96x time compression, two trace minutes that nothing
    waited. A worker that does not say when it looked is aged from its report."""
    if measured_ms <= 0:
        return max(0.0, now - oldest_ms / 1000.0)
    at = (measured_ms - oldest_ms) / 1000.0
    return max(0.0, at + max(0.0, now - measured_ms / 1000.0 - LAG_STALE_S))


class ArrivalMeter:
    """A stream's arrival rate from its readers' counts of the records ever appended to each
    partition (``StreamSource.appended``, read at each worker's stream report, once a second).

    Per partition, the slope of that count over the reports of its current reader within the
    last ``window_s`` (and the one before them, so that the slope spans at least the window);
    a partition whose reader changes starts again (two workers' clocks are not compared). The
    rate is the sum over the partitions, None until each has a slope. The master's other
    estimate, the records committed plus the growth of what waits, moves in steps' batches:
    read over one planner interval (0.625 wall s at 96x) it was off by a step's worth either way,
    and a nowcast read a live job's 17 records/s as 21 (the nineteenth run's 4 -> 8 at 14 h).
    """

    def __init__(self, window_s: float = 1.0, stale_s: float = 3.0) -> None:
        self.window_s = window_s
        self.stale_s = stale_s  # master seconds without a count for a partition: its slope is not used
        # partition -> (reader, [(its clock, count)], the master's clock at its last count)
        self._samples: dict[int, tuple[int, deque[tuple[float, int]], float]] = {}

    def note(self, reader: int, at_s: float, appended: dict[int, int], now: float) -> None:
        """A reader's counts, as it read them at ``at_s`` (its clock, seconds), reported at
        ``now`` (the master's clock)."""
        for partition, count in appended.items():
            held = self._samples.get(partition)
            if held is None or held[0] != reader:
                self._samples[partition] = (reader, deque([(at_s, count)]), now)
                continue
            samples = held[1]
            if at_s > samples[-1][0]:  # not a report resent, nor a clock stepping back
                samples.append((at_s, count))
                while len(samples) > 2 and samples[1][0] <= at_s - self.window_s:
                    samples.popleft()
            self._samples[partition] = (reader, samples, now)

    def rate(self, partitions: Iterable[int], now: float) -> float | None:
        """Records appended per second (wall) over ``partitions``; None while one has no slope,
        or none counted for ``stale_s`` (its reader stalled or died)."""
        total = 0.0
        for partition in partitions:
            held = self._samples.get(partition)
            if held is None or len(held[1]) < 2 or now - held[2] > self.stale_s:
                return None
            (t0, c0), (t1, c1) = held[1][0], held[1][-1]
            total += max(0, c1 - c0) / (t1 - t0)  # a trimmed stream on an old Redis: XLEN falls
        return total


@dataclass
class StreamLag:
    """A stream job's lag against its SLO over the job's life, in trace time (Kale 4.1).

    The same definitions as ``tidal.sim.online`` so that live and simulated runs compare: the
    time between two observations counts with the lag seen at its end (the simulator: the lag
    at the end of each minute); the SLO-violation ratio is the share of that time whose lag
    exceeded ``slo_s``; the accumulated lag (Eq. 11, the integral of the lag) is in minutes of
    lag times minutes, the sum of the per-minute lag the simulator reports.

    The clock starts at the first observation with a known lag (a member reported): the master
    never reads the stream, so before that the lag is unknown. ``last_at`` (wall clock) is
    journaled with the rest: a master that takes over counts the time since with the lag it then
    sees, so an outage of the master is scored, not skipped.
    """

    slo_s: float = 1200.0
    lag_s: float = 0.0
    observed_s: float = 0.0
    violated_s: float = 0.0
    accumulated_lag_min: float = 0.0
    last_at: float | None = None

    @property
    def violation_ratio(self) -> float:
        return self.violated_s / self.observed_s if self.observed_s > 0 else 0.0

    def observe(self, now: float, lag_s: float, time_scale: float) -> None:
        """The lag seen at wall time ``now`` (trace seconds) closes the interval since the previous call."""
        if self.last_at is not None and now > self.last_at:
            dt = (now - self.last_at) * time_scale
            self.observed_s += dt
            if lag_s > self.slo_s:
                self.violated_s += dt
            self.accumulated_lag_min += lag_s / 60.0 * dt / 60.0
        if self.last_at is None or now > self.last_at:
            self.last_at = now
        self.lag_s = lag_s

    def status(self, time_scale: float) -> StreamLagStatus | None:
        if self.last_at is None:
            return None
        return StreamLagStatus(lag_s=round(self.lag_s, 3), slo_s=self.slo_s, time_scale=time_scale,
                               observed_s=round(self.observed_s, 3), violation_ratio=self.violation_ratio,
                               accumulated_lag_min=self.accumulated_lag_min)

    def to_meta(self) -> dict[str, Any]:
        return {"lag_s": self.lag_s, "observed_s": self.observed_s, "violated_s": self.violated_s,
                "accumulated_lag_min": self.accumulated_lag_min, "last_at": self.last_at}

    def restore(self, meta: dict[str, Any] | None) -> None:
        """Carry on from a journaled ``to_meta`` (the SLO is the spec's, not the journal's)."""
        if not meta:
            return
        self.lag_s = float(meta.get("lag_s", 0.0))
        self.observed_s = float(meta.get("observed_s", 0.0))
        self.violated_s = float(meta.get("violated_s", 0.0))
        self.accumulated_lag_min = float(meta.get("accumulated_lag_min", 0.0))
        last = meta.get("last_at")
        self.last_at = None if last is None else float(last)


class Planning:
    def __init__(self, planner: Planner, started_at: float, cpus: float = 0.0, warm_start: str = "",
                 lag_slo_s: float = 1200.0) -> None:
        self.planner = planner
        self.started_at = started_at
        self.cpus = cpus
        self.warm_start = warm_start
        self.lag = StreamLag(slo_s=lag_slo_s)
        self.history_bins = 0  # intervals of past traffic the planner was seeded with
        self.history_interval_s = 0.0
        self.meter = ThroughputMeter()  # throughput per worker count
        self.decisions: deque[PlannerDecision] = deque(maxlen=MAX_DECISIONS)
        self.total = 0
        self.last_plan: ResourcePlan | None = None
        self.timeline: deque[TimelinePoint] = deque(maxlen=MAX_TIMELINE)
        self._pauses_seen = 0.0  # the time of the newest pause already handed to the planner
        self._stream_seen: tuple[int, int] | None = None  # (records committed, backlog) at the previous call
        self.arrivals = ArrivalMeter()  # the stream's arrival rate, from its readers' appended counts

    # ------------------------------------------------------------------ measurements
    @property
    def points(self) -> dict[int, list[float]]:
        """Workers -> [samples, seconds] measured at that count (``tidal.brain.meter``)."""
        return self.meter.points

    def measure(self, now: float, workers: int, committed: int, ready: bool) -> None:
        self.meter.measure(now, workers, committed, ready)

    def throughput(self) -> list[ThroughputPoint]:
        return self.meter.throughput()

    def record(self, now: float, samples_per_s: float, workers: int, target: int,
               lag_s: float | None = None, busy: float | None = None, ready: bool | None = None,
               arrivals_per_s: float | None = None) -> None:
        """One timeline point (the caller calls it once a second)."""
        self.timeline.append(TimelinePoint(t_s=round(now - self.started_at, 3), samples_per_s=round(samples_per_s, 1),
                                           workers=workers, target=target,
                                           lag_s=None if lag_s is None else round(lag_s, 1),
                                           busy=None if busy is None else round(busy, 3), ready=ready,
                                           arrivals_per_s=arrivals_per_s))

    def seed_history(self, arrivals: Sequence[float], interval_s: float) -> int:
        """Hand the stream's past traffic (records per ``interval_s`` trace seconds, oldest first) to
        a planner that keeps an arrival history (``observe_history``: kale, madu) before its first
        decision; the intervals it took (0: it keeps none)."""
        observe_history = getattr(self.planner, "observe_history", None)
        if observe_history is None or not arrivals:
            return 0
        observe_history([float(a) for a in arrivals], interval_s)
        self.history_bins, self.history_interval_s = len(arrivals), interval_s
        return self.history_bins

    # ------------------------------------------------------------------ observation and decision
    def observe_stream(self, now: float, interval_s: float, time_scale: float, committed: int,
                       members: Sequence[WorkerRecord], ready: bool,
                       partitions: Sequence[int] = ()) -> StreamObservation:
        """A stream job's side of the observation (Kale), in trace time (``time_scale``): the
        records that arrived in the interval (at the rate ``arrivals`` measures from what was
        appended to ``partitions``; from workers that do not report it, those committed since the
        previous call plus the growth of what waits), the backlog the members report, the age of the oldest waiting record (from
        its id), the members' busy share (the share of their step time, weighted by how full their
        batches were: ``tidal.worker.stream_loader``), and their capacity once that share is at
        least ``MEASURE_UTILIZATION``: the sum of the rates each trained at while busy, measured
        over the same steps as its busy share (from a worker that does not report it: the rate
        over the busy share). Nothing is measured while a member has not finished its first steps
        of the round (``tidal.worker.stream_loader.ROUND_WARMUP_STEPS``): the sum would mix the
        old count's window and a new worker's slow start. With it go the stream's ``partitions`` and
        what the members say of their steps' batch and their local queues' upper threshold (global
        shuffling), for a planner that prices the queues' wait (kale's ``lag_price``)."""
        backlog = sum(max(0, r.stream_backlog) for r in members)
        before = self._stream_seen or (committed, backlog)
        self._stream_seen = (committed, backlog)
        appended = self.arrivals.rate(partitions, now) if partitions else None
        arrived = appended * interval_s if appended is not None else \
            max(0, (committed - before[0]) + (backlog - before[1]))
        lag_s = stream_lag_s(now, time_scale, members) or 0.0
        utilization = stream_busy(members) or 0.0
        rate = sum(r.samples_per_s for r in members) / time_scale
        # the members' capacity: what they trained over the share of their steps' batches they
        # filled (the simulator measures it every minute; live, only a busy job shows it)
        if members and all(r.stream_capacity > 0 for r in members):
            capacity = sum(r.stream_capacity for r in members) / time_scale
        elif any(r.stream_capacity == 0 for r in members):
            capacity = 0.0  # a member's first steps of the round are not over: not measured
        else:
            capacity = rate / min(1.0, utilization) if utilization > 0 else 0.0
        measured = ([(float(len(members)), capacity)]
                    if ready and members and utilization >= MEASURE_UTILIZATION and capacity > 0 else [])
        return StreamObservation(interval_s=interval_s * time_scale, arrivals=[float(arrived)], measured=measured,
                                 backlog=float(backlog), lag_s=lag_s, utilization=min(1.0, utilization),
                                 partitions=len(partitions),
                                 queue_upper=float(max((r.stream_queue_upper for r in members), default=0)),
                                 step_batch=float(max((r.stream_batch for r in members), default=0)),
                                 intake_spread=intake_spread(members))

    def observe(
        self, *, job_id: str, now: float, min_workers: int, max_workers: int, target: int,
        active: Sequence[WorkerRecord], ready: bool, applied_step: int, batch_size: int,
        committed: int, total: int, pauses: Iterable[Event], stream: StreamObservation | None = None,
        time_scale: float = 1.0, ps: PSObservation | None = None, data: DataWorkerObservation | None = None,
    ) -> JobObservation:
        new_pauses = [p for p in pauses if p.seconds is not None and p.time > self._pauses_seen]
        if new_pauses:
            self._pauses_seen = max(p.time for p in new_pauses)
        return JobObservation(
            job_id=job_id, now_s=(now - self.started_at) * time_scale, min_workers=min_workers, max_workers=max_workers,
            # a stream planner sees the count it is moving to while a change is under way, as in
            # the simulator (tidal.sim.online): told the old count, it would undo its own scale-out
            current_workers=target if stream is not None else len(active), target_workers=target, ready=ready,
            samples_per_s=sum(r.samples_per_s for r in active), applied_step=applied_step,
            stragglers=sum(r.straggler for r in active), throughput=self.throughput(),
            batch_size=batch_size, committed_samples=committed, total_samples=total,
            workers=[worker_observation(r) for r in active],
            # on the observation's clock, as now_s: trace time for a replayed stream
            pauses=[PauseObservation(at_s=(p.time - self.started_at) * time_scale, seconds=(p.seconds or 0.0) * time_scale,
                                     cause=p.cause or "") for p in new_pauses],
            cpus_available=self.cpus, stream=stream, ps=ps, data=data,
        )

    def decided(self, obs: JobObservation, plan: ResourcePlan, target: int, reason: str) -> PlannerDecision:
        """Keep a change of the target from ``obs.target_workers`` to ``target``."""
        decision = PlannerDecision(
            at_s=round(obs.now_s, 3), planner=self.planner.name, from_workers=obs.target_workers, to_workers=target,
            reason=reason, model=plan.model, params=plan.params, error_pct=plan.error_pct,
            inputs={"workers": obs.current_workers, "samples_per_s": round(obs.samples_per_s, 1),
                    "committed_samples": obs.committed_samples,
                    "throughput": [[p.workers, round(p.samples_per_s, 1), p.seconds] for p in obs.throughput],
                    **({"ps_cpu_used": [round(c, 3) for c in obs.ps.ps_cpu_used]} if obs.ps is not None else {})},
        )
        self.decisions.append(decision)
        self.total += 1
        return decision

    def status(self, overridden: bool) -> PlannerStatus:
        plan = self.last_plan
        return PlannerStatus(
            name=self.planner.name, overridden_by_user=overridden, decisions=self.total,
            last=self.decisions[-1] if self.decisions else None,
            model="" if plan is None else plan.model, params={} if plan is None else plan.params,
            error_pct=None if plan is None else plan.error_pct, warm_start=self.warm_start,
            history_bins=self.history_bins, history_interval_s=self.history_interval_s,
        )

    # ------------------------------------------------------------------ journal
    def to_meta(self) -> dict[str, Any]:
        return {
            "planner": self.planner.name, "started_at": self.started_at, "total": self.total,
            "points": {str(w): v for w, v in self.points.items()},
            "decisions": [d.model_dump() for d in self.decisions],
        }

    def restore(self, meta: dict[str, Any] | None) -> None:
        """Carry on from a journaled ``to_meta`` (a master that took over)."""
        if not meta:
            return
        self.started_at = float(meta.get("started_at", self.started_at))
        self.total = int(meta.get("total", 0))
        self.meter.points = {int(w): [float(v[0]), float(v[1])] for w, v in (meta.get("points") or {}).items()}
        self.decisions.clear()
        self.decisions.extend(PlannerDecision(**d) for d in meta.get("decisions") or [])


def available_cpus() -> float:
    """Cores this process may run on: what the local backend's workers share."""
    try:
        return float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return float(os.cpu_count() or 1)


def worker_observation(r: WorkerRecord) -> WorkerObservation:
    return WorkerObservation(
        worker_id=r.worker_id, step_s=r.step_s, data_s=r.data_s, compute_s=r.compute_s, comm_s=r.comm_s,
        samples_per_s=r.samples_per_s, cpu_percent=r.cpu_percent, rss_bytes=r.rss_bytes, straggler=r.straggler,
    )
