"""What a threshold autoscaler would do with a job's own traffic, simulated beside the job.

Issue 22 reads kale's lag against the Kubernetes HPA's (Kale 4.4 compares with a GPU-utilization
HPA): at most 0.35x its accumulated lag. A planner that must keep that ratio cannot know the
HPA's lag from the traffic alone, so it simulates one: ``ShadowHPA`` feeds every interval of
arrivals the job receives to a real ``HPAPlanner`` driving a queue trained at the planner's
believed F(w), with the job's measured lead and pause per action (the same queue the online
simulator runs, without its noise). Its accumulated lag is the yardstick ``KalePlanner`` sets
its lag price against (``program_lag_ratio``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from tidal.api import JobObservation, StreamObservation
from tidal.brain.baselines import HPAPlanner

TRIM_AFTER = 1024  # intervals trained through that are kept before they are dropped


@dataclass
class ShadowHPA:
    """An HPA-scaled copy of the job, stepped once per interval of arrivals (``step``; every
    interval as long as the first, as a stream's are).

    ``lead_s``: from a decision to the new count training; ``pause_s``: the last part of it, in
    which nothing trains. ``accumulated_lag_min``: the oldest waiting sample's age (minutes) at
    each interval's end times the interval (minutes), summed: the simulator's score.
    """

    workers: int
    max_workers: int
    lead_s: float
    pause_s: float
    hpa: HPAPlanner = field(default_factory=HPAPlanner)
    accumulated_lag_min: float = 0.0
    now_s: float = 0.0
    _cum: list[float] = field(default_factory=lambda: [0.0])  # arrived by the start of each interval kept
    _first: int = 0  # the index of the interval _cum starts at (those before it are trained and dropped)
    _consumed: float = 0.0
    _action: tuple[int, float, float] | None = None  # (new count, pause start, end)
    _busy: float = 0.0

    def step(self, arrived: float, dt: float, throughput: Callable[[int], float]) -> float:
        """Advance one interval of ``dt`` seconds in which ``arrived`` samples came; returns the
        lag (s) at its end."""
        t0, t1 = self.now_s, self.now_s + dt
        self.now_s = t1
        train_s, ended = dt, False
        if self._action is not None:
            new, pause_at, end = self._action
            train_s -= max(0.0, min(t1, end) - max(t0, pause_at))
            if end <= t1:
                self.workers, self._action, ended = new, None, True
        self._cum.append(self._cum[-1] + max(0.0, arrived))
        rate = throughput(self.workers)
        served = min(self._cum[-1] - self._consumed, rate * train_s)
        self._consumed += served
        if train_s > 0 and rate > 0:
            self._busy = served / (rate * dt)
        lag = self._oldest_age(dt)
        self.accumulated_lag_min += lag / 60.0 * dt / 60.0
        current = self.workers if self._action is None else self._action[0]
        obs = JobObservation.model_construct(
            job_id="shadow-hpa", min_workers=1, max_workers=self.max_workers, current_workers=current,
            samples_per_s=served / dt, applied_step=-1, stragglers=0, now_s=t1,
            ready=self._action is None and not ended, throughput=[], workers=[], pauses=[],
            stream=StreamObservation.model_construct(interval_s=dt, arrivals=[arrived], measured=[],
                                                     backlog=self._cum[-1] - self._consumed, lag_s=lag,
                                                     utilization=self._busy),
        )
        want = max(1, min(self.max_workers, self.hpa.plan(obs).workers))
        if self._action is None and want != self.workers:
            self._action = (want, t1 + max(0.0, self.lead_s - self.pause_s), t1 + self.lead_s)
        return lag

    def _oldest_age(self, dt: float) -> float:
        """Age at the interval's end of the oldest sample waiting (arrivals spread evenly within
        each interval, as ``lag_program.oldest_age`` reads them, here on a list that grows by one a
        step), 0 with none; then drops the intervals trained through once TRIM_AFTER are kept."""
        cum = self._cum
        j = min(bisect.bisect_right(cum, self._consumed) - 1, len(cum) - 2)  # the next sample's interval
        age = 0.0
        if cum[-1] - self._consumed > 1e-6:
            span = cum[j + 1] - cum[j]
            frac = (self._consumed - cum[j]) / span if span > 0 else 0.0
            age = max(0.0, self.now_s - (self._first + j + frac) * dt)
        if j >= TRIM_AFTER:  # a live job's shadow steps for weeks
            del cum[:j]
            self._first += j
        return age
