"""The Elastic Scheduler baseline ("ES", Or et al., MLSys'20) as DLRover describes it (section 6.3).

ES only scales *workers*, by a fixed step (DLRover's experiment: 4 workers for Wide & Deep, 1
for xDeepFM), and keeps the PSes the job was submitted with. After each step it measures the
*scaling efficiency*, the throughput a new worker added relative to what one existing worker
delivered:

    eff = ((R_new - R_old) / k) / (R_old / w_old),

and keeps adding while ``eff`` exceeds the threshold (0.3 in DLRover's experiment); when a step
falls below it, the step is removed again and ES stops scaling. Lost workers are replaced.
Pure: a per-job object that remembers its previous step.
"""

from __future__ import annotations

import math
from dataclasses import replace

from tidal.api import JobObservation, ResourcePlan
from tidal.brain.dlrover import PSConfig, hold_reason, require_ps

__all__ = ["ESPlanner", "scaling_efficiency"]


def scaling_efficiency(r_old: float, w_old: int, r_new: float, w_new: int) -> float:
    """Throughput per added worker over throughput per existing worker (0 when undefined)."""
    if r_old <= 0 or w_old <= 0 or w_new == w_old:
        return 0.0
    return ((r_new - r_old) / (w_new - w_old)) / (r_old / w_old)


class ESPlanner:
    """Per-job ES: add ``step`` workers while the scaling efficiency stays above ``threshold``.

    Throughputs are ``obs.samples_per_s`` (steps/s in the cluster simulator); the efficiency
    is a ratio of two of them, so their unit does not matter.
    """

    name = "es"

    def __init__(self, cpu_quota: int, step: int = 1, threshold: float = 0.3) -> None:
        self.cpu_quota, self.step, self.threshold = cpu_quota, step, threshold
        self.before: tuple[int, float] | None = None  # (workers, throughput) before the last step
        self.done = False

    def plan(self, obs: JobObservation) -> ResourcePlan:
        """The next step of workers, a step back, or the workers the job has.

        Raises:
            ConfigError: ``obs.ps`` is None (not a parameter-server job).
        """
        ps = require_ps(obs, self.name)
        c = PSConfig.from_observation(obs)
        thp = obs.samples_per_s
        if self.done:
            return c.to_plan(f"done: {c.workers} workers")
        hold = hold_reason(obs)
        if hold is not None:
            return c.to_plan(hold)
        why = "first step"
        if self.before is not None:
            w_old, r_old = self.before
            self.before = None
            eff = scaling_efficiency(r_old, w_old, thp, c.workers)
            if eff < self.threshold:
                self.done = True
                back = max(1, w_old)
                return replace(c, workers=back).to_plan(
                    f"scaling efficiency {eff:.2f} < {self.threshold:g}: back to {back} workers, stop")
            why = f"scaling efficiency {eff:.2f} >= {self.threshold:g}"
        k = self.step
        room = (self.cpu_quota - c.cpus()) // max(c.worker_cpu, 1)
        k = min(k, room)
        free_cpus = math.inf if ps.free_cpus is None else ps.free_cpus
        if free_cpus < k * c.worker_cpu:
            k = int(free_cpus // max(c.worker_cpu, 1))
        if k <= 0:
            return c.to_plan(f"no cores for another worker (quota {self.cpu_quota}, free {free_cpus:g})")
        self.before = (c.workers, thp)
        return replace(c, workers=c.workers + k).to_plan(f"{why}: +{k} workers, {c.workers + k} in all")
