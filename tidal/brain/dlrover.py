"""DLRover's Brain for parameter-server jobs: sample, optimize, adjust (DLRover section 4).

Also what every PS-job planner of this package shares: ``PSConfig`` (a job's resources:
workers, PSes, cores and memory of each), its conversions from a ``JobObservation`` and to a
``ResourcePlan``, and ``require_ps`` (the observation's parameter-server part, or a
``ConfigError``). The baselines (``tidal.brain.es``, ``tidal.brain.optimus_alloc``) and
DLRover-RM (``tidal.brain.dlrover_rm``) are ``Planner``s (``tidal.brain.api``) like this one:
``plan(JobObservation) -> ResourcePlan``, with every size of the plan set and a reason.

Units: these planners compare throughputs of one job only, and take it from
``obs.samples_per_s``. The cluster simulator (``tidal.sim.cluster.dlrover_rm``) puts steps/s
there, i.e. one "sample" is one step of the job (as if its batch size were 1); a caller that
gives samples/s gives the same decisions as long as the batch size stays fixed.

DLRover's model (section 4.1, Eq. 1-6): a worker's step takes ``t_IO + W_compute / (r
min(w_i, w_hat)) + W_update / (r min(s_total, s_hat))``; the job's rate is the sum over its
workers (asynchronous PS training). Maximising it under a CPU quota ``C_total`` splits into
sizing one worker (its used cores ``w_hat``) and the PSes it needs (``s_hat``: the PS cores
used *per worker*), then as many workers as the quota allows:

* Eq. 10, ``N_w = C_total / (w_hat + s_hat)``: each worker costs its own cores plus the PS
  cores that serve it;
* Eq. 11, ``s_total = C_total - N_w w_hat``: the rest of the quota goes to the PSes, in PSes of
  ``s = 16`` cores each (``N_ps = s_total / s``, DLRover's choice balancing pod pending time).

Stages (section 4.2):

* *sample*: one worker with ``C_max`` cores and a few PSes; an OOM doubles the worker's memory
  (worker OOM) or the number of PSes (PS OOM); PSes above 90% CPU get more cores;
* *optimize*: Eq. 10/11 from the sampled ``w_hat``, ``s_hat``; workers get ``ceil(w_hat)``
  cores and their observed memory;
* *adjust*: idle PS CPU (``s_hat`` over-estimated): recompute ``s_hat = s_used / N_w`` and add
  ``Delta N_w = s_total / s_hat - N_w`` workers (bounded by the quota: we do not relax
  ``C_total`` with low-priority pods as DLRover can, so simulated JCTs stay comparable); a hot
  PS is replaced by one with ``s = min(s_hot / s_total * s_hat * N_w, C_max)`` cores.

Pure: no clock, no I/O; time arrives in the observation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tidal.api import ConfigError, JobObservation, PSObservation, ResourcePlan

__all__ = [
    "C_MAX",
    "PS_CORES",
    "DLRoverPlanner",
    "PSConfig",
    "adjust_idle_ps",
    "hold_reason",
    "hot_ps_cores",
    "optimize_config",
    "require_ps",
]

#: cores one pod may have (DLRover section 6.1: "a maximum of 32 CPU cores")
C_MAX = 32
#: cores of one PS chosen by DLRover's optimize stage (section 4.1)
PS_CORES = 16
#: PSes using less than this share of their cores are idle: the adjust stage adds workers (4.2)
IDLE_PS_UTIL = 0.7


def require_ps(obs: JobObservation, planner: str) -> PSObservation:
    """The parameter-server part of ``obs``; a ``ConfigError`` naming ``planner`` when it has none."""
    if obs.ps is None:
        raise ConfigError(f"planner {planner} needs a parameter-server observation (obs.ps is None)")
    return obs.ps


def hold_reason(obs: JobObservation) -> str | None:
    """Why a PS planner cannot decide on this observation (pods starting, nothing measured), or None."""
    if not obs.ready:
        return "waiting for pods to start"
    if obs.samples_per_s <= 0:
        return "no throughput measured yet"
    return None


@dataclass(frozen=True)
class PSConfig:
    """Resources of one parameter-server job.

    Attributes:
        workers, ps: pod counts.
        worker_cpu, ps_cpu: cores of each worker / PS (DLRover-RM's lambda_w, lambda_p).
        worker_mem_gb, ps_mem_gb: memory of each worker / PS.
        hot_ps_cpu: cores of the PS that replaced a hot one (DLRover's adjust stage); 0 when no
            PS was replaced. It counts instead of one ordinary PS.
    """

    workers: int
    ps: int
    worker_cpu: int
    ps_cpu: int
    worker_mem_gb: float = 4.0
    ps_mem_gb: float = 8.0
    hot_ps_cpu: int = 0

    @classmethod
    def from_observation(cls, obs: JobObservation) -> PSConfig:
        """The configuration the job runs with now, pods still starting included.

        Workers are ``obs.target_workers`` (what was last asked for: the pods that run plus
        those still starting, as ``obs.ps.ps`` counts the PSes), not ``current_workers`` (the
        workers training now, fewer while pods start); an observation that leaves
        ``target_workers`` at 0 falls back to ``current_workers``.

        Raises:
            ConfigError: ``obs.ps`` is None (not a parameter-server job).
        """
        ps = obs.ps
        if ps is None:
            raise ConfigError(f"job {obs.job_id}: a PS configuration needs a parameter-server observation")
        return cls(obs.target_workers or obs.current_workers, ps.ps, ps.worker_cpu, ps.ps_cpu,
                   ps.worker_mem_gb, ps.ps_mem_gb, ps.hot_ps_cpu)

    @classmethod
    def from_plan(cls, plan: ResourcePlan, now: PSConfig) -> PSConfig:
        """The configuration ``plan`` asks for (the inverse of ``to_plan``); sizes the plan
        leaves ``None`` keep those of ``now``."""
        return cls(plan.workers, plan.ps,
                   now.worker_cpu if plan.worker_cpu is None else plan.worker_cpu,
                   now.ps_cpu if plan.ps_cpu is None else plan.ps_cpu,
                   now.worker_mem_gb if plan.worker_mem_gb is None else plan.worker_mem_gb,
                   now.ps_mem_gb if plan.ps_mem_gb is None else plan.ps_mem_gb,
                   now.hot_ps_cpu if plan.hot_ps_cpu is None else plan.hot_ps_cpu)

    def to_plan(self, reason: str) -> ResourcePlan:
        """This configuration as a plan, every size set (none left ``None``)."""
        return ResourcePlan(workers=self.workers, ps=self.ps, worker_cpu=self.worker_cpu, ps_cpu=self.ps_cpu,
                            worker_mem_gb=self.worker_mem_gb, ps_mem_gb=self.ps_mem_gb,
                            hot_ps_cpu=self.hot_ps_cpu, reason=reason)

    def cpus(self) -> int:
        """Cores allocated to the whole job."""
        extra = max(0, self.hot_ps_cpu - self.ps_cpu) if self.hot_ps_cpu and self.ps else 0
        return self.workers * self.worker_cpu + self.ps * self.ps_cpu + extra

    def memory_gb(self) -> float:
        return self.workers * self.worker_mem_gb + self.ps * self.ps_mem_gb

    def same_ps(self, other: PSConfig) -> bool:
        """True when the PS side (count, cores, memory, hot PS) is unchanged: only workers change."""
        return (self.ps, self.ps_cpu, self.ps_mem_gb, self.hot_ps_cpu) == (
            other.ps, other.ps_cpu, other.ps_mem_gb, other.hot_ps_cpu)


def optimize_config(w_hat: float, s_hat: float, c_total: int, ps_cores: int = PS_CORES) -> tuple[int, int, int]:
    """DLRover Eq. 10 and 11: ``(N_w, worker cores, N_ps)`` from one sampled worker.

    ``N_w = floor(C_total / (w_hat + s_hat))`` (Eq. 10, integers by Eq. 9); each worker gets
    ``ceil(w_hat)`` cores (Eq. 6: integer cores); ``s_total = C_total - N_w ceil(w_hat)``
    (Eq. 11); ``N_ps = max(1, floor(s_total / s))`` PSes of ``s`` cores, so the job stays within
    its quota (Eq. 8). With Table 1's W&D sample (``w_hat`` 2.5, ``s_hat`` 5.7, ``C_total`` 200)
    this gives 24 workers of 3 cores and 8 PSes, Table 1's optimize row.
    """
    if w_hat <= 0 or s_hat < 0 or c_total <= 0:
        raise ValueError(f"need w_hat > 0, s_hat >= 0, C_total > 0; got {w_hat}, {s_hat}, {c_total}")
    worker_cpu = max(1, min(C_MAX, math.ceil(w_hat - 1e-9)))
    n_w = max(1, math.floor(c_total / (w_hat + s_hat)))
    while n_w > 1 and c_total - n_w * worker_cpu < ps_cores:  # leave room for one PS at least
        n_w -= 1
    s_total = c_total - n_w * worker_cpu
    n_ps = max(1, math.floor(s_total / ps_cores))
    return n_w, worker_cpu, n_ps


def adjust_idle_ps(n_w: int, s_used: float, s_total: float, max_workers: int) -> int:
    """DLRover's adjust stage for idle PS CPU: the number of workers to run.

    ``s_hat = s_used / N_w`` (PS cores one worker really needs), then ``N_w' = min(s_total /
    s_hat, max_workers)`` (DLRover's ``Delta N_w = min(s_total / s_hat, sqrt K) - N_w`` with the
    bound taken from the quota). Never fewer than ``n_w``.
    """
    if n_w <= 0 or s_used <= 0:
        return n_w
    s_hat = s_used / n_w
    return max(n_w, min(max_workers, math.floor(s_total / s_hat)))


def hot_ps_cores(s_hot: float, s_total_used: float, s_hat: float, n_w: int) -> int:
    """Cores of the PS replacing a hot one: ``min(s_hot / s_total * s_hat * N_w, C_max)`` (DLRover 4.2).

    ``s_hot / s_total`` is the hot PS's share of the PS load, ``s_hat N_w`` the PS cores all
    workers need: their product is what the hot PS needs.
    """
    if s_total_used <= 0:
        return 0
    return max(1, min(C_MAX, math.ceil(s_hot / s_total_used * s_hat * n_w)))


class DLRoverPlanner:
    """DLRover's three stages as a per-job planner (one instance per job, keeps its stage).

    Args:
        cpu_quota: C_total of the job.
        sample_ps, sample_ps_cpu: the "few parameter servers" of the sample stage.
        ps_hot_ratio: a PS using this many times the mean PS load is "hot".
        idle_ps_util: PS utilisation below which the adjust stage adds workers.
    """

    name = "dlrover"

    def __init__(self, cpu_quota: int, worker_mem_gb: float = 8.0, ps_mem_gb: float = 8.0,
                 sample_ps: int = 2, sample_ps_cpu: int = 8, ps_hot_ratio: float = 1.5,
                 idle_ps_util: float = IDLE_PS_UTIL) -> None:
        self.cpu_quota = cpu_quota
        self.stage = "sample"
        self.sample_ps, self.sample_ps_cpu = sample_ps, sample_ps_cpu
        self.worker_mem_gb, self.ps_mem_gb = worker_mem_gb, ps_mem_gb
        self.ps_hot_ratio, self.idle_ps_util = ps_hot_ratio, idle_ps_util
        self.s_hat = 0.0  # PS cores per worker, from the sample stage
        self.adjusted_idle = False

    def initial(self) -> PSConfig:
        """The sample stage's configuration: one worker with C_max cores and a few PSes."""
        return PSConfig(1, self.sample_ps, min(C_MAX, self.cpu_quota - self.sample_ps * self.sample_ps_cpu),
                        self.sample_ps_cpu, self.worker_mem_gb, self.ps_mem_gb)

    def plan(self, obs: JobObservation) -> ResourcePlan:
        """The next configuration of the job's current stage (see the module docstring).

        Raises:
            ConfigError: ``obs.ps`` is None (not a parameter-server job).
        """
        ps_obs = require_ps(obs, self.name)
        c = PSConfig.from_observation(obs)
        # OOM during sampling (or later): double the worker's memory, or the number of PSes so
        # that the PSes have more memory in total (DLRover 4.2, "Sampling").
        fixes = []
        if ps_obs.oom_worker:
            c = replace(c, worker_mem_gb=c.worker_mem_gb * 2)
            fixes.append(f"worker OOM: worker memory doubled to {c.worker_mem_gb:g} GB")
        if ps_obs.oom_ps:
            if self.stage == "sample":
                c = replace(c, ps=c.ps * 2)
                fixes.append(f"PS OOM while sampling: PSes doubled to {c.ps}")
            else:
                c = replace(c, ps_mem_gb=c.ps_mem_gb * 2)
                fixes.append(f"PS OOM: PS memory doubled to {c.ps_mem_gb:g} GB")
        if fixes:
            return c.to_plan("; ".join(fixes))
        hold = hold_reason(obs)
        if hold is not None:
            return c.to_plan(f"{self.stage} stage: {hold}")
        ps_used = sum(ps_obs.ps_cpu_used)
        if self.stage == "sample":
            if ps_obs.ps_cpu_used and ps_used >= 0.9 * c.ps * c.ps_cpu and c.ps_cpu < C_MAX:
                c = replace(c, ps_cpu=min(C_MAX, c.ps_cpu * 2))  # PS saturated: s_hat unknown yet
                return c.to_plan(f"sample stage: PSes saturated ({ps_used:.1f} cores used): {c.ps_cpu} cores per PS")
            w_hat = max(ps_obs.worker_cpu_used, 0.1)
            self.s_hat = ps_used / max(c.workers, 1)
            n_w, w_cpu, n_ps = optimize_config(w_hat, self.s_hat, self.cpu_quota)
            self.stage = "optimize"
            return PSConfig(n_w, n_ps, w_cpu, PS_CORES, c.worker_mem_gb, c.ps_mem_gb).to_plan(
                f"optimize (Eq. 10/11, w_hat {w_hat:.1f}, s_hat {self.s_hat:.1f}): {n_w} workers x {w_cpu} cores, "
                f"{n_ps} PS x {PS_CORES} cores")
        if self.stage == "optimize":
            self.stage = "adjust"
            # re-estimate w_hat and fill the PS capacity: N_w = s_total / s_hat
            s_total = c.ps * c.ps_cpu
            max_w = max(c.workers, (self.cpu_quota - s_total) // max(c.worker_cpu, 1))
            if ps_used < self.idle_ps_util * s_total:
                n_w = adjust_idle_ps(c.workers, ps_used, s_total, max_w)
                reason = f"adjust: PSes use {ps_used:.1f} of {s_total} cores: {n_w} workers"
            else:
                n_w = c.workers
                reason = f"adjust: PSes busy ({ps_used:.1f} of {s_total} cores): keep {n_w} workers"
            return replace(c, workers=n_w).to_plan(reason)
        # adjust: hot PS first, then idle PS CPU
        if ps_obs.ps_cpu_used and c.hot_ps_cpu == 0 and len(ps_obs.ps_cpu_used) > 1:
            mean = ps_used / len(ps_obs.ps_cpu_used)
            s_hot = max(ps_obs.ps_cpu_used)
            if mean > 0 and s_hot > self.ps_hot_ratio * mean and s_hot >= 0.85 * c.ps_cpu:
                cores = hot_ps_cores(s_hot, ps_used, self.s_hat or ps_used / c.workers, c.workers)
                if cores > c.ps_cpu and c.cpus() + cores - c.ps_cpu <= self.cpu_quota:
                    return replace(c, hot_ps_cpu=cores).to_plan(
                        f"hot PS ({s_hot:.1f} cores used, {s_hot / mean:.1f}x the mean): replaced by one of {cores} cores")
        if not self.adjusted_idle and ps_used < self.idle_ps_util * c.ps * c.ps_cpu:
            self.adjusted_idle = True
            s_total = c.ps * c.ps_cpu
            max_w = max(c.workers, (self.cpu_quota - c.cpus() + c.workers * c.worker_cpu) // max(c.worker_cpu, 1))
            n_w = adjust_idle_ps(c.workers, ps_used, s_total, max_w)
            return replace(c, workers=n_w).to_plan(f"idle PS CPU ({ps_used:.1f} of {s_total} cores used): {n_w} workers")
        return c.to_plan("adjust stage: no change")
