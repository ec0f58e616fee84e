"""One data-parallel job under a live planner, simulated: ``tidal sim job``.

The same planner object the master runs (``tidal.brain.planners.get``) is driven with
``JobObservation``s built from a throughput model instead of measurements, so a live run can be
replayed: give the simulator the model the live run fitted (``tidal status`` shows it; the
history records it) and it predicts the count the planner settles at and the job's time.

What is modelled, per tick of ``tick_s`` (the planner is asked every ``interval_s``):

* the job trains ``model(w)`` samples/s with ``w`` running workers, until ``samples`` are done;
* a new worker trains ``start_s`` after the planner asked for it (process start, imports, the
  rendezvous); then every running worker stands still ``pause_s`` (the re-form's pause);
  a worker released stops at once, also with a pause;
* measurements as the master takes them (``tidal.brain.meter``): throughput per count over
  the intervals in which the job ran with the target and nothing was starting, the first
  interval after each change left out;
* the job's fixed costs: ``start_s`` before the first step, ``tail_s`` after the last (the
  example's final evaluation, the workers' exit).

Worker-seconds count every worker from its request to its end (starting workers included).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from tidal.api import JobObservation
from tidal.brain.api import Planner, ThroughputConfig
from tidal.brain.meter import ThroughputMeter
from tidal.brain.models import DataParallelModel

__all__ = ["JobSimResult", "simulate_job"]


@dataclass
class JobSimResult:
    job_s: float
    worker_s: float
    settled_workers: int
    settle_s: float
    decisions: list[tuple[float, int, int, str]] = field(default_factory=list)


def simulate_job(
    planner: Planner, params: Mapping[str, float], *, samples: int, batch_size: int, min_workers: int,
    max_workers: int, interval_s: float = 1.0, start_s: float = 4.0, pause_s: float = 0.1, tail_s: float = 2.0,
    tick_s: float = 0.1, limit_s: float = 1e6,
) -> JobSimResult:
    """Run the job to its end under ``planner``, the throughput given by ``params`` (a
    ``data-parallel`` model: theta0, theta1, knee)."""
    if samples <= 0 or batch_size <= 0 or not 1 <= min_workers <= max_workers:
        raise ValueError("samples, batch_size must be positive and 1 <= min_workers <= max_workers")
    model = DataParallelModel(dict(params))

    def rate(w: int) -> float:
        return model.predict(ThroughputConfig(w, batch_size=w * batch_size)) if w > 0 else 0.0

    now, done, worker_s = 0.0, 0.0, 0.0
    running, starting = 0, list[float]()  # running workers; when each starting one begins training
    target = max_workers
    paused_until = 0.0
    meter = ThroughputMeter()
    next_plan = 0.0
    result = JobSimResult(0.0, 0.0, 0, 0.0)
    while done < samples and now < limit_s:
        if now >= next_plan:
            next_plan = now + interval_s
            ready = not starting and running == target and now >= paused_until
            meter.measure(now, running, done, ready)
            obs = JobObservation(
                job_id="sim", min_workers=min_workers, max_workers=max_workers, current_workers=running,
                target_workers=target, now_s=now, ready=ready, samples_per_s=rate(running),
                throughput=meter.throughput(),
                batch_size=batch_size, committed_samples=int(done), total_samples=samples,
            )
            plan = planner.plan(obs)
            wanted = min(max(plan.workers, min_workers), max_workers)
            if wanted != target:
                result.decisions.append((round(now, 3), target, wanted, plan.reason))
                target = wanted
            while running + len(starting) < target:
                starting.append(now + start_s)
            while running + len(starting) > target and starting:
                starting.pop()
            if running > target:
                running = target
                paused_until = now + pause_s
        joined = [t for t in starting if t <= now]
        if joined:
            starting = [t for t in starting if t > now]
            running += len(joined)
            paused_until = now + pause_s
        train_s = max(0.0, min(tick_s, now + tick_s - paused_until))
        done += rate(running) * train_s
        worker_s += (running + len(starting)) * tick_s
        now += tick_s
    result.job_s = now + tail_s
    result.worker_s = worker_s + running * tail_s
    result.settled_workers = target
    result.settle_s = result.decisions[-1][0] if result.decisions else 0.0
    if not math.isfinite(result.job_s):
        raise ValueError("the simulation did not finish")
    return result
