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

from dataclasses import replace

from tidal.brain.dlrover import PSConfig, PSJobObservation

__all__ = ["ESPlanner", "scaling_efficiency"]


def scaling_efficiency(r_old: float, w_old: int, r_new: float, w_new: int) -> float:
    """Throughput per added worker over throughput per existing worker (0 when undefined)."""
    if r_old <= 0 or w_old <= 0 or w_new == w_old:
        return 0.0
    return ((r_new - r_old) / (w_new - w_old)) / (r_old / w_old)


class ESPlanner:
    """Per-job ES: add ``step`` workers while the scaling efficiency stays above ``threshold``."""

    name = "es"

    def __init__(self, cpu_quota: int, step: int = 1, threshold: float = 0.3) -> None:
        self.cpu_quota, self.step, self.threshold = cpu_quota, step, threshold
        self.before: tuple[int, float] | None = None  # (workers, throughput) before the last step
        self.done = False

    def plan(self, obs: PSJobObservation) -> PSConfig:
        c = obs.config
        if not obs.ready or obs.throughput <= 0 or self.done:
            return c
        if self.before is not None:
            w_old, r_old = self.before
            self.before = None
            if scaling_efficiency(r_old, w_old, obs.throughput, c.workers) < self.threshold:
                self.done = True
                return replace(c, workers=max(1, w_old))
        k = self.step
        room = (self.cpu_quota - c.cpus()) // max(c.worker_cpu, 1)
        k = min(k, room)
        if obs.free_cpus < k * c.worker_cpu:
            k = int(obs.free_cpus // max(c.worker_cpu, 1))
        if k <= 0:
            return c
        self.before = (c.workers, obs.throughput)
        return replace(c, workers=c.workers + k)
