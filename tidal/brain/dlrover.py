"""DLRover's Brain for parameter-server jobs: sample, optimize, adjust (DLRover section 4).

Also the data every PS-job planner of this package shares: ``PSConfig`` (a job's resources:
workers, PSes, cores and memory of each) and ``PSJobObservation`` (what the job master measured
since the previous decision). The baselines (``tidal.brain.es``, ``tidal.brain.optimus_alloc``)
and DLRover-RM (``tidal.brain.dlrover_rm``) use the same two types, so the simulator drives them
all through one interface: ``planner.plan(observation) -> PSConfig``.

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
from dataclasses import dataclass, field, replace

__all__ = [
    "C_MAX",
    "PS_CORES",
    "DLRoverPlanner",
    "PSConfig",
    "PSJobObservation",
    "adjust_idle_ps",
    "hot_ps_cores",
    "optimize_config",
]

#: cores one pod may have (DLRover section 6.1: "a maximum of 32 CPU cores")
C_MAX = 32
#: cores of one PS chosen by DLRover's optimize stage (section 4.1)
PS_CORES = 16


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


@dataclass
class PSJobObservation:
    """What a PS-job planner sees at one decision point (built by the master or the simulator).

    Attributes:
        job_id: the job.
        now_s: seconds since the job was submitted (the caller's clock).
        config: the resources the job runs with now (pods still starting included).
        cpu_quota: the most cores the job may hold (DLRover's C_total).
        throughput: steps/s measured since the previous decision (0 while nothing ran).
        worker_cpu_used: cores a worker used on average (DLRover's w_hat when one worker runs).
        ps_cpu_used: cores each PS used, one entry per PS.
        ps_mem_used_gb: memory each PS uses now (the largest one matters for OOM).
        steps_done, total_steps: progress of the job.
        oom_worker, oom_ps: an OOM killed a worker / a PS since the previous decision.
        ready: all pods of ``config`` are running (no scaling in progress).
        free_cpus, free_mem_gb: what the cluster has unallocated now (a scale-up beyond it waits).
        stragglers: workers whose progress lags their peers (dynamic sharding feeds them less).
        history: throughput samples ``(config, steps/s)`` of this job so far, oldest first.
    """

    job_id: str
    now_s: float
    config: PSConfig
    cpu_quota: int
    throughput: float = 0.0
    worker_cpu_used: float = 0.0
    ps_cpu_used: list[float] = field(default_factory=list)
    ps_mem_used_gb: float = 0.0
    steps_done: float = 0.0
    total_steps: float = 0.0
    oom_worker: bool = False
    oom_ps: bool = False
    ready: bool = True
    free_cpus: float = math.inf
    free_mem_gb: float = math.inf
    stragglers: int = 0
    history: list[tuple[PSConfig, float]] = field(default_factory=list)


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
                 idle_ps_util: float = 0.7) -> None:
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

    def plan(self, obs: PSJobObservation) -> PSConfig:
        c = obs.config
        # OOM during sampling (or later): double the worker's memory, or the number of PSes so
        # that the PSes have more memory in total (DLRover 4.2, "Sampling").
        if obs.oom_worker:
            c = replace(c, worker_mem_gb=c.worker_mem_gb * 2)
        if obs.oom_ps:
            c = replace(c, ps=c.ps * 2) if self.stage == "sample" else replace(c, ps_mem_gb=c.ps_mem_gb * 2)
        if obs.oom_worker or obs.oom_ps or not obs.ready or obs.throughput <= 0:
            return c
        ps_used = sum(obs.ps_cpu_used)
        if self.stage == "sample":
            if obs.ps_cpu_used and ps_used >= 0.9 * c.ps * c.ps_cpu and c.ps_cpu < C_MAX:
                return replace(c, ps_cpu=min(C_MAX, c.ps_cpu * 2))  # PS saturated: s_hat unknown yet
            w_hat = max(obs.worker_cpu_used, 0.1)
            self.s_hat = ps_used / max(c.workers, 1)
            n_w, w_cpu, n_ps = optimize_config(w_hat, self.s_hat, self.cpu_quota)
            self.stage = "optimize"
            return PSConfig(n_w, n_ps, w_cpu, PS_CORES, c.worker_mem_gb, c.ps_mem_gb)
        if self.stage == "optimize":
            self.stage = "adjust"
            # re-estimate w_hat and fill the PS capacity: N_w = s_total / s_hat
            s_total = c.ps * c.ps_cpu
            max_w = max(c.workers, (self.cpu_quota - s_total) // max(c.worker_cpu, 1))
            n_w = adjust_idle_ps(c.workers, ps_used, s_total, max_w) if ps_used < self.idle_ps_util * s_total else c.workers
            return replace(c, workers=n_w)
        # adjust: hot PS first, then idle PS CPU
        if obs.ps_cpu_used and c.hot_ps_cpu == 0 and len(obs.ps_cpu_used) > 1:
            mean = ps_used / len(obs.ps_cpu_used)
            s_hot = max(obs.ps_cpu_used)
            if mean > 0 and s_hot > self.ps_hot_ratio * mean and s_hot >= 0.85 * c.ps_cpu:
                cores = hot_ps_cores(s_hot, ps_used, self.s_hat or ps_used / c.workers, c.workers)
                if cores > c.ps_cpu and c.cpus() + cores - c.ps_cpu <= self.cpu_quota:
                    return replace(c, hot_ps_cpu=cores)
        if not self.adjusted_idle and ps_used < self.idle_ps_util * c.ps * c.ps_cpu:
            self.adjusted_idle = True
            s_total = c.ps * c.ps_cpu
            max_w = max(c.workers, (self.cpu_quota - c.cpus() + c.workers * c.worker_cpu) // max(c.worker_cpu, 1))
            return replace(c, workers=adjust_idle_ps(c.workers, ps_used, s_total, max_w))
        return c
