"""A causal yardstick for kale's worker-hours (issue 22): a deadline rule, swept over its deadline.

    .venv/bin/python bench/deadline_yardstick.py [--split eval] [--traces goog-volume,wc98-w3]
        [--migrations seamless] [--deadlines 300,600,900,1080] [--procs 2]

Where kale misses its worker-hour target, the bounds of ``bench/brain_robustness.py`` say what a
schedule that *knew* the traffic would need; this says what a simple rule that does not know it
reaches, and at what lag. Not a bound (a better online rule may exist), and not a planner: it is
given the job's true throughput model, which a planner must learn.

The rule (``DeadlineRule``): every sample is to be trained within ``deadline_s`` of its arrival.
After each interval it takes the fewest workers that train, over the next ``horizon_s``, every
sample whose deadline falls within it: those waiting (FIFO, the oldest first) and those forecast
to arrive (the traffic now, flat: the higher of the last interval's rate and the mean of the last
four), an action's preparation at the current count and its pause training nothing. It scales
up at once and in after ``hold`` intervals in a row that ask for fewer. Time-sharing whole
workers through what waits is how it goes below the count the traffic needs each interval, so
its lag grows with the deadline: the table puts each deadline's worker-hours beside its lag.

Prints, per trace and migration, kale's and each deadline's worker-hours over the LP bound
(``tidal.sim.online.oracle_worker_hours``), SLO violation and accumulated lag over hpa's. A
5-minute trace takes a second, a week of minutes about a minute per deadline.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from brain_robustness import chosen_runs, policy_rows, print_policy_rows, seconds_within_slo, traces

from tidal.api import JobObservation, ResourcePlan
from tidal.brain.kale import deadline_workers
from tidal.sim import online as sim

MEAN_INTERVALS = 4  # the flat forecast: the higher of the last interval's rate and these intervals' mean


class DeadlineRule:
    """The yardstick's rule (module docstring); ``throughput[w]`` is w workers' true samples/s."""

    name = "deadline"

    def __init__(self, throughput: list[float], mig: sim.Migration, deadline_s: float, horizon_s: float,
                 hold: int) -> None:
        self.throughput, self.deadline_s, self.horizon_s, self.hold = throughput, deadline_s, horizon_s, hold
        self.prep_s, self.pause_s = mig.cost(scale_out=True)
        self.arrivals: list[float] = []
        self.target: int | None = None
        self.asked_fewer = 0

    def plan(self, obs: JobObservation) -> ResourcePlan:
        stream = obs.stream
        assert stream is not None
        self.arrivals.extend(map(float, stream.arrivals))
        current = obs.current_workers
        if self.target is None or not self.arrivals:
            self.target = current
        if not obs.ready or not self.arrivals:
            return ResourcePlan(workers=self.target, reason="waiting")
        want = self._fewest(stream.interval_s, stream.backlog, current, obs.max_workers)
        self.asked_fewer = self.asked_fewer + 1 if want < current else 0
        if want > current or self.asked_fewer >= self.hold:
            self.target, self.asked_fewer = want, 0
        else:
            self.target = current
        return ResourcePlan(workers=self.target, reason=f"deadlines: {want}")

    def _fewest(self, dt: float, backlog: float, current: int, most: int) -> int:
        recent = self.arrivals[-MEAN_INTERVALS:]
        rate = max(self.arrivals[-1], sum(recent) / len(recent)) / dt
        return deadline_workers(self.throughput.__getitem__, self.arrivals, dt, backlog, rate, self.deadline_s,
                                self.prep_s, self.pause_s, current, 1, most, self.horizon_s)


def run(trace: str, migration: str, split: str, deadlines: list[float], horizon_s: float, hold: int) -> list[dict[str, Any]]:
    window, history, interval = traces(split)[trace]()
    cfg = sim.SimConfig(migration=migration, interval_s=interval)
    scaled = sim.scale_to_peak(window, cfg)
    mig = sim.MIGRATIONS[migration]
    throughput = [sim.true_throughput(cfg, w) for w in range(cfg.peak_workers + 1)]
    policies = {"kale": sim.planner_factory("kale", cfg, mig), "hpa": sim.planner_factory("hpa", cfg, mig)}
    for d in deadlines:
        policies[f"deadline {d:g} s"] = lambda d=d: DeadlineRule(throughput, mig, d, horizon_s, hold)
    res = sim.simulate(scaled, policies, cfg, history=history * float(scaled.max() / window.max()))
    bound = sim.oracle_worker_hours(scaled, cfg)
    return policy_rows(trace, migration, res, bound)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", default="eval", choices=["eval", "tune"])
    ap.add_argument("--traces", default="goog-volume,wc98-w3", help="comma-separated (brain_robustness.traces)")
    ap.add_argument("--migrations", default="seamless,restart")
    ap.add_argument("--deadlines", default="300,600,900,1080", help="seconds, each below the 20-minute SLO")
    ap.add_argument("--horizon-s", type=float, default=1800.0, help="how far ahead the deadlines are counted")
    ap.add_argument("--hold", type=int, default=2, help="intervals in a row asking for fewer before a scale-in")
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    runs = chosen_runs(args.split, args.traces, args.migrations)
    deadlines = seconds_within_slo(args.deadlines, "--deadlines")
    if args.hold < 1 or not args.horizon_s > 0:
        sys.exit("--hold must be at least 1 and --horizon-s positive")
    with ProcessPoolExecutor(max_workers=args.procs) as pool:
        jobs = [pool.submit(run, t, m, args.split, deadlines, args.horizon_s, args.hold) for t, m in runs]
        print_policy_rows(job.result for job in jobs)


if __name__ == "__main__":
    main()
