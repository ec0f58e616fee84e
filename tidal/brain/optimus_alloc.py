"""The Optimus baseline (Peng et al., EuroSys'18) as DLRover describes it (section 6.3).

Optimus fits its throughput model (``tidal.brain.models.OptimusModel``, Optimus Eq. 2 with the
PS count) to the configurations the job ran with and then adds, one step at a time, *either* PSes
*or* workers, whichever gives the larger marginal gain per core:

    gain_w = (f(w + k_w, p) - f(w, p)) / (k_w lambda_w),
    gain_p = (f(w, p + k_p) - f(w, p)) / (k_p lambda_p),

(DLRover's experiment: 2 PSes or 4 workers per step for Wide & Deep, 1 and 1 for xDeepFM). It
ignores the cores of each pod (they stay as submitted) and stops when neither step gains more
than ``min_gain`` of the current throughput. Until the model has as many distinct samples as
coefficients, it alternates a worker step and a PS step to collect them.
"""

from __future__ import annotations

import math
from dataclasses import replace

from tidal.api import JobObservation, ResourcePlan
from tidal.brain.api import FitError, ThroughputConfig, ThroughputSample
from tidal.brain.dlrover import PSConfig, hold_reason, require_ps
from tidal.brain.models import OptimusModel

__all__ = ["OptimusPlanner"]


class OptimusPlanner:
    """Per-job Optimus: marginal gain of a PS step vs a worker step.

    Throughputs are ``obs.samples_per_s`` (steps/s in the cluster simulator: the model is
    fitted and compared in that unit).
    """

    name = "optimus"

    def __init__(self, cpu_quota: int, worker_step: int = 1, ps_step: int = 1, min_gain: float = 0.02) -> None:
        self.cpu_quota, self.worker_step, self.ps_step, self.min_gain = cpu_quota, worker_step, ps_step, min_gain
        self.samples: dict[tuple[int, int], float] = {}
        self.explore_ps = False

    def _fits(self, c: PSConfig, now: PSConfig, free_cpus: float) -> bool:
        extra = c.cpus() - now.cpus()
        return c.cpus() <= self.cpu_quota and extra <= free_cpus

    def plan(self, obs: JobObservation) -> ResourcePlan:
        """A worker step or a PS step, whichever the fitted model says gains more per core.

        Raises:
            ConfigError: ``obs.ps`` is None (not a parameter-server job).
        """
        ps = require_ps(obs, self.name)
        c = PSConfig.from_observation(obs)
        thp = obs.samples_per_s
        hold = hold_reason(obs)
        if hold is not None:
            return c.to_plan(hold)
        free_cpus = math.inf if ps.free_cpus is None else ps.free_cpus
        self.samples[(c.workers, c.ps)] = thp
        add_w = replace(c, workers=c.workers + self.worker_step)
        add_p = replace(c, ps=c.ps + self.ps_step)
        steps = {add_w: f"+{self.worker_step} workers", add_p: f"+{self.ps_step} PS"}
        model = OptimusModel(with_ps=True)
        if len(self.samples) < len(model.terms()):
            first, second = (add_p, add_w) if self.explore_ps else (add_w, add_p)
            self.explore_ps = not self.explore_ps
            seen = f"{len(self.samples)} of {len(model.terms())} configurations measured"
            for cand in (first, second):
                if self._fits(cand, c, free_cpus):
                    return cand.to_plan(f"explore ({seen}): {steps[cand]}")
            return c.to_plan(f"explore ({seen}): no step fits the free cores")
        try:
            model.fit([ThroughputSample(ThroughputConfig(w, p, batch_size=w), r) for (w, p), r in self.samples.items()])
        except FitError as e:
            return c.to_plan(f"model not fitted ({e}): keep")
        now = model.predict(ThroughputConfig(c.workers, c.ps, batch_size=c.workers))
        best, best_gain = c, 0.0
        for cand, cores in ((add_w, self.worker_step * c.worker_cpu), (add_p, self.ps_step * c.ps_cpu)):
            if not self._fits(cand, c, free_cpus):
                continue
            pred = model.predict(ThroughputConfig(cand.workers, cand.ps, batch_size=cand.workers))
            if pred - now > self.min_gain * max(now, 1e-9) and (pred - now) / cores > best_gain:
                best, best_gain = cand, (pred - now) / cores
        if best == c:
            return c.to_plan(f"no step gains more than {self.min_gain:.0%}: keep")
        return best.to_plan(f"marginal gain {best_gain:.3g}/s per core: {steps[best]}")
