"""Scenario ``dlrover-rm``: a CPU cluster of parameter-server (DLRM) jobs, five policies.

Policies: ``manual`` (the user's static configuration, TFJob-like), ``es`` (``tidal.brain.es``),
``optimus`` (``tidal.brain.optimus_alloc``), ``dlrover`` (``tidal.brain.dlrover``) and
``dlrover-rm`` (``tidal.brain.dlrover_rm``: warm start from a SQLite history, NSGA-II
candidates, cluster-wide weighted greedy, OOM prediction). The simulator builds a
``JobObservation`` with its parameter-server part (``PSObservation``) per job and calls the very
planners a live brain would (``Planner.plan -> ResourcePlan``, turned back into a ``PSConfig`` by
``PSConfig.from_plan``); DLRover-RM's cluster step is the ``WeightedGreedy`` allocator. The
observation's ``samples_per_s`` is the job's steps/s: one "sample" is one step here.

Where the numbers come from:

* Jobs: a window of ``../shared/traces/philly-jobs.csv`` (``load_philly``; jobs shorter than
  10 min skipped: DLRover-RM's jobs run 200,000 steps, tens of minutes). Arrival = submission
  time; the Philly duration is the job's length *at the ideal speed*: ``steps = duration x
  Psi*`` where ``Psi*`` is the best throughput any configuration within the job's quota reaches
  (exhaustive search of the ground truth below). So ``JCT >= duration`` for every policy.
* Quota ``C_total``: DLRover 6.1 (200 cores a job, 32 a pod); a job with ``g`` Philly GPUs gets
  ``min(200, 64 g)`` (our mapping: bigger Philly jobs are bigger CPU jobs).
* Throughput (ground truth): DLRover-RM Eq. 1-6 with the coefficients of section 6.2
  (alpha_grad 3.48, alpha_upd 2.36, alpha_sync 0.68, alpha_lookup 2.45, sum of beta 2.45; read
  as step-time units of 10 ms, per-worker batch 512 = one unit of m) for the Wide&Deep-like
  archetype; the xDeepFM-like archetype has alpha_grad x 7.8 (DLRover Table 1: its sampled worker
  used 19.4 cores vs 2.5). Each *kind* (a recurring model of a user) multiplies every coefficient
  by a log-normal factor (sigma 0.3). Two things the fitted model does not have: a worker can use
  at most ``w_cap`` cores (DLRover's w_hat: 3 for W&D, 20 for xDeepFM, DLRover Table 2), and 13%
  of kinds have one PS holding ``h`` in [1.5, 2.5] times the average share (DLRover 6.4: 13% of
  jobs had hot PSes). A measured throughput has 2% noise.
* CPU used (what the master reports): a worker keeps ``min(cores, w_cap)`` busy except while it
  waits for the PS update; a PS keeps its cores busy during the PS-side terms. With these, one
  W&D worker on 32 cores and 2 PSes of 8 cores reads w_hat ~ 2.9 and s_hat ~ 5.2 (DLRover Table
  1: 2.5 and 5.7), and DLRover's Eq. 10/11 then give its Table 2 configuration (24 x 3, 8 x 16).
* Memory: workers need 4 GB (W&D) or 8 GB (xDeepFM) (DLRover Table 2); the PSes of a job need
  ``m0`` GB in total at the start and grow linearly with consumed samples (DLRover-RM 5.3) to
  ``r m0`` at the end, ``r`` log-normal with 5% of jobs above 2, so that the users' 2x
  over-provisioned memory OOMs in ~5% of jobs (DLRover-RM Table 4: 4.7% OOM failures).
* Users (``manual``): the ideal configuration's pod counts times log-normal factors (sigma 0.5)
  and 1-2x the cores per pod (DLRover 1: users over-provision; Fig. 2: >80% of jobs below 50%
  CPU), capped by the quota; 2x the starting memory. ``es`` and ``optimus`` start from the
  user's pod shapes (they do not size pods) with 1 worker (and, for Optimus, 1 PS; ES keeps the
  user's PSes); DLRover 6.3's steps: 4 workers / 2 PSes for the W&D archetype, 1 / 1 else.
* Cloud instability: each pod fails at 1 per 500 pod-hours (node failures, preemption:
  DLRover 6.4); 7% of jobs get a worker straggler at 25% of its cores (DLRover 6.2's experiment;
  DLRover-RM Table 4: 7% of jobs). ``manual`` (TFJob): static data sharding, so a straggler
  slows the whole job to its pace; a lost PS or an OOM fails the job; a lost worker is
  restarted (the job waits for it). Elastic policies: dynamic sharding (a straggler only costs
  its share), a lost pod is replaced, a lost PS restores from the last checkpoint (every 10 min;
  DLRover-RM: flash checkpoint, nothing lost), an OOM restarts the PS with twice the memory.
* Overheads: a new pod trains after 120 s (DLRover 6.3: 20 s launch + 100 s init); a PS change
  pauses the job 240 s (checkpoint to remote storage and re-partition), a change of the
  workers' shape 120 s more (every worker pod is new). DLRover-RM migrates seamlessly
  (DLRover-RM 5.2, Fig. 6): the new pods (new PSes, workers of a new shape) start while the old
  configuration trains, holding their resources beside it, and the job then pauses 60 s (flash
  checkpoint and re-partition, Fig. 12); where the cluster cannot hold both, it stops, starts
  the new pods and pauses (180 s). Decisions every 180 s (DLRover-RM 6.2, DLRover 6.3), every
  30 min once a job's planner keeps its plan.
* Cluster: 32-core, 192 GB servers (DLRover-RM 6, small cluster), pooled (pods assumed to fit);
  as many servers as make the users' requested core-seconds over the window 80% of the
  cluster's (a busy shared cluster; at least 20 servers, the paper's small cluster; ``load``
  sets another fraction). FIFO
  admission without backfilling; elastic policies start as small as their planner says and
  scale into free cores.

Metrics: JCT over completed jobs (submission to completion, queueing included); completion rate
= completed / all; utilisation = cores *used* / cluster cores; scaling actions = configuration
changes decided after start. ``extra`` holds the warm start's accuracy for recurring jobs
(initial vs final workers and PSes, ``1 - |init - final| / final``), failures and OOMs.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from tidal.api import ConfigError, JobObservation, PSObservation
from tidal.brain.api import Planner
from tidal.brain.dlrover import C_MAX, DLRoverPlanner, PSConfig
from tidal.brain.dlrover_rm import (
    PAPER_PARAMS,
    Candidate,
    CostModel,
    DLRoverRMPlanner,
    FreeCapacity,
    WeightedGreedy,
    fit_to_quota,
    quota_grid,
)
from tidal.brain.es import ESPlanner
from tidal.brain.history import JobRecord
from tidal.brain.optimus_alloc import OptimusPlanner
from tidal.history import SQLiteHistory
from tidal.sim.cluster.api import PolicyMetrics, ScenarioResult, check_load, load_philly

__all__ = ["POLICIES", "run", "simulate"]

POLICIES = ["manual", "es", "optimus", "dlrover", "dlrover-rm"]

UNIT_S = 0.01  # one step-time unit of the coefficients
NODE_CORES, NODE_MEM_GB = 32, 192.0
DEFAULT_LOAD = 0.8  # requested cores / cluster cores over the arrival window (a busy shared cluster)
START_S = 120.0
TICK_S, SLOW_TICK_S = 180.0, 1800.0
CKPT_S = 600.0
POD_FAIL_PER_S = 1.0 / (500 * 3600.0)
STRAGGLER_P, STRAGGLER_CPU = 0.07, 0.25
PS_PAUSE_S = {"dlrover-rm": 60.0}
PS_PAUSE_DEFAULT_S = 240.0
SEAMLESS = {"dlrover-rm"}  # policies that start new pods while the old configuration trains
MIN_DURATION_S = 600.0
TIMELINE_POINTS = 2000


@dataclass(frozen=True)
class Kind:
    """A recurring model of one user: ground-truth coefficients and habits."""

    name: str
    archetype: str  # "wd" (IO-intensive) or "xdfm" (compute-intensive)
    coef: tuple[float, float, float, float, float]  # a_g, a_u, a_s, a_e, beta
    w_cap: float
    hot: float  # share of the hottest PS over the mean (1: balanced)
    worker_mem: float
    ps_mem0: float
    mem_growth_mu: float  # log-mean of the end/start PS memory ratio
    user_count: tuple[float, float]  # the user's factors on the ideal worker / PS counts
    user_cpu: float  # the user's factor on cores per pod

    def features(self) -> dict[str, str | float]:
        return {"model": self.archetype, "kind": self.name, "user": self.name.split("-")[0],
                "ps_mem0": self.ps_mem0}


def make_kinds(n: int, rng: random.Random) -> list[Kind]:
    kinds = []
    for i in range(n):
        arch = "wd" if rng.random() < 0.6 else "xdfm"
        base = dict(PAPER_PARAMS)
        if arch == "xdfm":
            base["alpha_grad"] *= 19.4 / 2.5
        coef = tuple(v * math.exp(rng.gauss(0, 0.3)) for v in base.values())
        w_cap = (3.0 if arch == "wd" else 20.0) * math.exp(rng.gauss(0, 0.2))
        hot = rng.uniform(1.5, 2.5) if rng.random() < 0.13 else 1.0
        kinds.append(Kind(
            name=f"u{i % max(1, n // 3)}-m{i}", archetype=arch, coef=coef, w_cap=w_cap, hot=hot,  # type: ignore[arg-type]
            worker_mem=4.0 if arch == "wd" else 8.0, ps_mem0=rng.choice([8.0, 16.0, 24.0, 32.0]),
            mem_growth_mu=rng.gauss(0.0, 0.15),
            user_count=(math.exp(rng.gauss(0, 0.5)), math.exp(rng.gauss(0, 0.5))),
            user_cpu=rng.uniform(1.0, 2.0)))
    return kinds


def step_time(k: Kind, w: float, p: float, wc: float, pc: float, hot_eff: float, worker_cpu_scale: float = 1.0) -> float:
    """Ground-truth time of one worker step (units of 10 ms): DLRover-RM Eq. 2-5 plus the two effects above."""
    a_g, a_u, a_s, a_e, beta = k.coef
    return (a_g / min(wc * worker_cpu_scale, k.w_cap) + hot_eff * (a_u * w / (p * pc) + a_s * w / p + a_e / p) + beta)


# what ``ideal`` depends on -> its answer. Not the kind's name: every seed has a kind "u0-m0",
# with other coefficients (keyed by name, a second seed in one process read the first's).
_IDEAL: dict[tuple[object, ...], tuple[float, PSConfig]] = {}


def ideal(k: Kind, quota: int) -> tuple[float, PSConfig]:
    """Best throughput (steps/s) within the quota and its configuration (balanced PSes)."""
    key = (k.coef, k.w_cap, k.worker_mem, k.ps_mem0, quota)
    if key not in _IDEAL:
        w, p, wc, pc = quota_grid(quota)
        a_g, a_u, a_s, a_e, beta = k.coef
        t = a_g / np.minimum(wc, k.w_cap) + a_u * w / (p * pc) + a_s * w / p + a_e / p + beta
        thp = w / (t * UNIT_S)
        i = int(np.argmax(thp))
        _IDEAL[key] = (float(thp[i]), PSConfig(int(w[i]), int(p[i]), int(wc[i]), int(pc[i]), k.worker_mem, k.ps_mem0 / p[i]))
    return _IDEAL[key]


@dataclass(frozen=True)
class Migration:
    """A seamless migration under way (DLRover-RM 5.2): the new pods start until ``ready``
    while the job trains on its old configuration; ``cpus`` and ``mem_gb`` are what they hold
    beside it."""

    ready: float
    new: PSConfig
    cpus: float
    mem_gb: float


def new_pods(old: PSConfig, new: PSConfig) -> tuple[float, float]:
    """(cores, GB) of the pods ``new`` has that ``old`` has not: every PS when the PS side
    changes, every worker when their shape changes, else the added workers."""
    cpus = mem = 0.0
    if not new.same_ps(old):
        cpus += new.cpus() - new.workers * new.worker_cpu
        mem += new.ps * new.ps_mem_gb
    same_shape = (new.worker_cpu, new.worker_mem_gb) == (old.worker_cpu, old.worker_mem_gb)
    added = max(0, new.workers - old.workers) if same_shape else new.workers
    return cpus + added * new.worker_cpu, mem + added * new.worker_mem_gb


@dataclass
class Job:
    jid: str
    submit: float
    kind: Kind
    quota: int
    total_steps: float
    duration: float
    mem_ratio: float
    straggle_at: float  # progress fraction at which a worker straggles (inf: never)
    fail_draws: list[tuple[float, float]]  # (exposure threshold in pod-seconds x rate, uniform for pod type)
    state: str = "queued"
    cfg: PSConfig = field(default_factory=lambda: PSConfig(1, 1, 1, 1))
    steps: float = 0.0
    start: float = math.nan
    end: float = math.nan
    paused_until: float = 0.0
    pending: list[tuple[float, int]] = field(default_factory=list)  # (ready time, workers starting)
    straggling: bool = False
    hot_fixed: bool = False
    exposure: float = 0.0
    fail_i: int = 0
    ckpt_steps: float = 0.0
    ckpt_t: float = 0.0
    next_decision: float = 0.0
    stable: int = 0
    actions: int = 0
    ooms: int = 0
    failures: int = 0
    planner: Planner | None = None
    init_cfg: PSConfig | None = None
    want: PSConfig | None = None  # the configuration the job is submitted with
    cores_used: float = 0.0  # cores in use now (set by ``Sim.refresh``)
    core_s_used: float = 0.0  # core-seconds used and allocated while running (DLRover Fig. 2)
    core_s_allocated: float = 0.0
    warm: bool = False
    last_thp: float = 0.0
    inputs: tuple[object, ...] = ()  # what last_thp and cores_used were computed from (``Sim.refresh``)
    decisions: list[tuple[float, PSConfig, PSConfig]] = field(default_factory=list)  # (time, old, new) applied
    migration: Migration | None = None  # a seamless migration whose new pods are starting

    def diagnostics(self) -> dict[str, object]:
        """One line of ``tidal sim cluster --jobs-out``: where this job's time and cores went."""
        def conf(c: PSConfig | None) -> str | None:
            return None if c is None else f"{c.workers}w x {c.worker_cpu}c + {c.ps}ps x {c.ps_cpu}c"

        return {
            "job": self.jid, "kind": self.kind.name, "state": self.state, "submit_s": self.submit,
            "queue_s": self.start - self.submit if not math.isnan(self.start) else None,
            "jct_s": self.end - self.submit if self.state == "done" else None,
            "ideal_s": self.duration, "quota_cores": self.quota,
            "core_s_allocated": self.core_s_allocated, "core_s_used": self.core_s_used,
            "submitted_with": conf(self.want), "final": conf(self.cfg), "actions": self.actions,
            "ooms": self.ooms, "pod_failures": self.failures, "straggled": self.straggling,
            "decisions": [[round(t), f"{conf(old)} -> {conf(new)}"] for t, old, new in self.decisions],
        }


class Sim:
    def __init__(self, policy: str, jobs: list[Job], cores: int, mem_gb: float, seed: int) -> None:
        self.policy, self.jobs, self.cores, self.mem = policy, jobs, cores, mem_gb
        self.rng = random.Random(f"{seed}-{policy}")
        self.history = SQLiteHistory(":memory:") if policy == "dlrover-rm" else None
        self.used_cpu = 0.0
        self.used_mem = 0.0
        self.t = 0.0
        self.timeline: list[tuple[float, float, float]] = []
        self.util_area = 0.0
        self.cur_used = 0.0
        self.running: list[Job] = []
        self.cost = CostModel(ps_pause_s=PS_PAUSE_S.get(policy, PS_PAUSE_DEFAULT_S))
        self.greedy = WeightedGreedy()

    # -- ground truth ----------------------------------------------------------------------------

    def hot_eff(self, j: Job) -> float:
        h = 1.0 if j.hot_fixed else j.kind.hot
        if j.cfg.hot_ps_cpu:
            h = h * j.cfg.ps_cpu / j.cfg.hot_ps_cpu
        return max(1.0, h) if j.cfg.ps > 1 else 1.0

    def active_workers(self, j: Job) -> int:
        return j.cfg.workers - sum(n for _, n in j.pending)

    def throughput(self, j: Job) -> float:
        if j.state != "running" or self.t < j.paused_until:
            return 0.0
        c, w = j.cfg, self.active_workers(j)
        if w <= 0:
            return 0.0
        h = self.hot_eff(j)
        t = step_time(j.kind, w, c.ps, c.worker_cpu, c.ps_cpu, h)
        if not j.straggling:
            return w / (t * UNIT_S)
        ts = step_time(j.kind, w, c.ps, c.worker_cpu, c.ps_cpu, h, STRAGGLER_CPU)
        if self.policy == "manual":  # static sharding: everyone waits for the straggler's share
            return w / (ts * UNIT_S)
        return ((w - 1) / t + 1 / ts) / UNIT_S

    def cpu_used(self, j: Job) -> tuple[float, list[float]]:
        """(cores one worker uses, cores each PS uses) as the master would measure them."""
        c, k = j.cfg, j.kind
        w = max(self.active_workers(j), 1)
        h = self.hot_eff(j)
        _, a_u, a_s, a_e, _ = k.coef
        ps_part = a_u * w / (c.ps * c.ps_cpu) + a_s * w / c.ps + a_e / c.ps
        t = step_time(k, w, c.ps, c.worker_cpu, c.ps_cpu, h)
        if self.t < j.paused_until:
            return 0.0, [0.0] * c.ps
        worker = min(c.worker_cpu, k.w_cap) * (t - h * a_u * w / (c.ps * c.ps_cpu)) / t
        ps = [c.ps_cpu * ps_part / t] * c.ps
        if c.ps > 1 and (k.hot > 1 and not j.hot_fixed):
            cores = c.hot_ps_cpu or c.ps_cpu
            ps[0] = min(cores, c.ps_cpu * k.hot * ps_part / t)
        return worker, ps

    def ps_mem_need(self, j: Job) -> float:
        f = min(j.steps / j.total_steps, 1.0)
        return j.kind.ps_mem0 * (1 + (j.mem_ratio - 1) * f) / j.cfg.ps

    # -- resources -------------------------------------------------------------------------------

    def alloc(self, old: PSConfig | None, new: PSConfig) -> bool:
        return self.reserve(new.cpus() - (old.cpus() if old else 0), new.memory_gb() - (old.memory_gb() if old else 0.0))

    def reserve(self, cpus: float, mem_gb: float) -> bool:
        """Take (or, negative, give back) resources if the cluster has them."""
        if self.used_cpu + cpus > self.cores + 1e-9 or self.used_mem + mem_gb > self.mem + 1e-9:
            return False
        self.used_cpu += cpus
        self.used_mem += mem_gb
        return True

    def release(self, c: PSConfig) -> None:
        self.used_cpu -= c.cpus()
        self.used_mem -= c.memory_gb()

    def fit_to_free(self, c: PSConfig, old: PSConfig | None = None) -> PSConfig | None:
        """Fewer workers until the configuration fits (elastic policies start or grow partially)."""
        free_cpu = self.cores - self.used_cpu + (old.cpus() if old else 0)
        free_mem = self.mem - self.used_mem + (old.memory_gb() if old else 0.0)
        while c.cpus() > free_cpu or c.memory_gb() > free_mem:
            if c.workers <= 1:
                return None
            c = replace(c, workers=c.workers - 1)
        return c

    # -- policy glue -----------------------------------------------------------------------------

    def first_config(self, j: Job) -> PSConfig:
        k = j.kind
        _, best = ideal(k, j.quota)
        user = self.user_config(j, best)
        steps = (4, 2) if k.archetype == "wd" else (1, 1)
        if self.policy == "manual":
            return user
        if self.policy == "es":
            j.planner = ESPlanner(j.quota, step=steps[0])
            return replace(user, workers=1)
        if self.policy == "optimus":
            j.planner = OptimusPlanner(j.quota, worker_step=steps[0], ps_step=steps[1])
            return replace(user, workers=1, ps=1, ps_mem_gb=user.ps_mem_gb * user.ps)
        if self.policy == "dlrover":
            pl = DLRoverPlanner(j.quota, worker_mem_gb=k.worker_mem, ps_mem_gb=2 * k.ps_mem0 / 2)
            j.planner = pl
            return pl.initial()
        assert self.history is not None
        rm = DLRoverRMPlanner(j.jid, k.features(), j.quota, self.history, self.cost, worker_mem_gb=k.worker_mem,
                              ps_mem_gb=2 * k.ps_mem0 / 2, seed=int(j.jid[1:]))
        j.planner = rm
        j.warm = rm.warm_started
        c = rm.initial_config
        # memory per pod: the history's smoothed memory, or (cold start) the user's starting memory
        return replace(c, worker_mem_gb=k.worker_mem,
                       ps_mem_gb=max(c.ps_mem_gb, 2 * k.ps_mem0 / c.ps) if not rm.warm_started else c.ps_mem_gb)

    def user_config(self, j: Job, best: PSConfig) -> PSConfig:
        k = j.kind
        w = max(1, round(best.workers * k.user_count[0]))
        p = max(1, round(best.ps * k.user_count[1]))
        wc = min(C_MAX, math.ceil(best.worker_cpu * k.user_cpu))
        pc = min(C_MAX, math.ceil(best.ps_cpu * k.user_cpu))
        # a user told the request is over the quota shrinks it keeping its shape (dropping
        # workers first left 10-19% of the jobs with 1 worker and up to 18 PSes)
        w, p, wc, pc = fit_to_quota(w, p, wc, pc, j.quota)
        return PSConfig(w, p, wc, pc, k.worker_mem, 2 * k.ps_mem0 / p)

    def observe(self, j: Job) -> JobObservation:
        """What the job master would report: ``target_workers`` and the PS sizes are the job's
        configuration (pods still starting included, ``PSConfig.from_observation``),
        ``current_workers`` the workers training now; throughput in steps/s (with 2% noise)."""
        worker, ps = self.cpu_used(j)
        thp = self.throughput(j) * (1 + self.rng.gauss(0, 0.02))
        c = j.cfg
        return JobObservation(
            job_id=j.jid, min_workers=1, max_workers=j.quota,  # a worker has >= 1 core: the quota bounds them
            current_workers=max(self.active_workers(j), 0), target_workers=c.workers, now_s=self.t - j.submit,
            ready=not j.pending and j.migration is None and self.t >= j.paused_until, samples_per_s=max(thp, 0.0),
            steps_done=j.steps, total_steps=j.total_steps,
            ps=PSObservation(
                ps=c.ps, worker_cpu=c.worker_cpu, ps_cpu=c.ps_cpu, worker_mem_gb=c.worker_mem_gb,
                ps_mem_gb=c.ps_mem_gb, hot_ps_cpu=c.hot_ps_cpu, cpu_quota=j.quota, worker_cpu_used=worker,
                ps_cpu_used=ps, ps_mem_used_gb=self.ps_mem_need(j), free_cpus=self.cores - self.used_cpu,
                free_mem_gb=self.mem - self.used_mem))

    def apply(self, j: Job, new: PSConfig) -> None:
        old = j.cfg
        if new == old:
            return
        reshape = not new.same_ps(old) or new.worker_cpu != old.worker_cpu
        if reshape and self.policy in SEAMLESS and self.migrate(j, new):
            return
        fitted = self.fit_to_free(new, old) if new.workers > old.workers or new.cpus() > old.cpus() else new
        if fitted is None or (not fitted.same_ps(old) and fitted.ps != new.ps):
            return
        new = fitted
        if not self.alloc(old, new):
            return
        j.actions += 1
        j.stable = 0
        j.decisions.append((self.t, old, new))
        if reshape:
            # stop and restart: the new pods start (all of them for a seamless policy that had
            # no room to start them beside the old; the workers if their shape changes), then
            # the PSes re-partition
            starts = self.policy in SEAMLESS or new.worker_cpu != old.worker_cpu
            j.paused_until = max(j.paused_until, self.t + (START_S if starts else 0.0) + self.cost.ps_pause_s)
            j.pending = []
            if self.policy in SEAMLESS and new.ps != old.ps:
                j.hot_fixed = True  # DeepRec re-partition spreads the embeddings evenly (DLRover-RM 4.3)
        elif new.workers > old.workers:
            j.pending.append((self.t + START_S, new.workers - old.workers))
        elif new.workers < old.workers:
            drop = old.workers - new.workers
            while drop and j.pending:
                ready, n = j.pending.pop()
                take = min(n, drop)
                drop -= take
                if n > take:
                    j.pending.append((ready, n - take))
        j.cfg = new

    def migrate(self, j: Job, new: PSConfig) -> bool:
        """Begin a seamless migration to ``new`` (fewer workers if the cluster cannot hold all of
        its new pods beside the old configuration); False when not even one worker fits."""
        old = j.cfg
        while True:
            cpus, mem = new_pods(old, new)
            if self.reserve(cpus, mem):
                break
            if new.workers <= 1:
                return False
            new = replace(new, workers=new.workers - 1)
        j.actions += 1
        j.stable = 0
        j.decisions.append((self.t, old, new))
        j.migration = Migration(self.t + START_S, new, cpus, mem)
        j.next_decision = max(j.next_decision, j.migration.ready + self.cost.ps_pause_s)
        return True

    def complete_migration(self, j: Job) -> None:
        """The new pods are up: pause to checkpoint and re-partition, then train on ``new``
        (the old pods it replaces are given back)."""
        m = j.migration
        assert m is not None
        j.migration = None
        self.reserve(-m.cpus, -m.mem_gb)
        old = j.cfg
        if not self.alloc(old, m.new):  # never: the new pods were held beside the old
            raise AssertionError(f"{j.jid}: migration to {m.new} does not fit where it was held")
        j.cfg = m.new
        j.paused_until = max(j.paused_until, self.t + self.cost.ps_pause_s)
        j.pending = []
        if m.new.ps != old.ps:
            j.hot_fixed = True  # DeepRec re-partition spreads the embeddings evenly (DLRover-RM 4.3)

    # -- events ----------------------------------------------------------------------------------

    def start(self, j: Job) -> bool:
        if j.want is None:
            j.want = self.first_config(j)
        c = j.want
        if self.policy != "manual":
            fitted = self.fit_to_free(c)
            if fitted is None:
                return False
            c = fitted
        if not self.alloc(None, c):
            return False
        j.cfg, j.state, j.start = c, "running", self.t
        j.init_cfg = c
        j.paused_until = self.t + START_S
        j.ckpt_t = self.t
        j.next_decision = self.t + START_S + TICK_S
        return True

    def finish(self, j: Job, state: str) -> None:
        j.state, j.end = state, self.t
        self.release(j.cfg)
        if j.migration is not None:
            self.reserve(-j.migration.cpus, -j.migration.mem_gb)
            j.migration = None
        if state == "done" and self.history is not None and isinstance(j.planner, DLRoverRMPlanner):
            c = j.cfg
            self.history.add(JobRecord(j.jid, self.t, j.kind.features(), {
                "workers": c.workers, "ps": c.ps, "worker_cpu": c.worker_cpu, "ps_cpu": c.ps_cpu,
                "worker_mem_gb": c.worker_mem_gb, "ps_mem_gb": c.ps_mem_gb, "ps_mem_total_gb": c.ps * c.ps_mem_gb},
                j.planner.params))

    def lose_pod(self, j: Job, is_ps: bool, oom: bool = False) -> None:
        """A pod died (node failure, preemption or OOM)."""
        if self.policy == "manual":
            if is_ps or oom:
                self.finish(j, "failed")
                return
            j.paused_until = max(j.paused_until, self.t + START_S)  # TFJob restarts the worker; the rest wait
            return
        if is_ps:
            if self.policy != "dlrover-rm":  # restore from the last periodic checkpoint
                j.steps = j.ckpt_steps
            j.paused_until = max(j.paused_until, self.t + START_S + self.cost.ps_pause_s)
            if oom:
                new = replace(j.cfg, ps_mem_gb=j.cfg.ps_mem_gb * 2)
                if self.alloc(j.cfg, new):
                    j.cfg = new
        else:
            j.pending.append((self.t + START_S, 1))

    def advance(self, dt: float) -> None:
        """Progress every running job by ``dt`` seconds at its current throughput and cores."""
        for j in self.running:
            j.steps += j.last_thp * dt
            j.exposure += (j.cfg.workers + j.cfg.ps) * POD_FAIL_PER_S * dt
            j.core_s_used += j.cores_used * dt
            j.core_s_allocated += (j.cfg.cpus() + (j.migration.cpus if j.migration else 0.0)) * dt
        self.util_area += self.cur_used * dt

    def refresh(self) -> None:
        """Each running job's throughput and the cores it uses now, after the events of this
        instant. Both change only at events, so ``advance`` integrates the values set here; they
        are recomputed only for a job whose inputs changed (most events concern one job of
        hundreds: this was most of a run's time)."""
        used = 0.0
        for j in self.running:
            active = self.active_workers(j)
            inputs = (j.cfg, active, self.t < j.paused_until, j.straggling, j.hot_fixed)
            if inputs != j.inputs:
                j.inputs = inputs
                j.last_thp = self.throughput(j)
                w, ps = self.cpu_used(j) if j.last_thp > 0 else (0.0, [])
                j.cores_used = w * active + sum(ps)
            used += j.cores_used
        self.cur_used = used

    def internal_events(self, j: Job) -> float:
        """The earliest time something changes inside job ``j`` at its current rate."""
        t = math.inf
        if j.pending:
            t = min(t, min(r for r, _ in j.pending))
        if self.t < j.paused_until:
            t = min(t, j.paused_until)
        if j.migration is not None:
            t = min(t, j.migration.ready)
        thp = j.last_thp
        if thp > 0:
            t = min(t, self.t + max(j.total_steps - j.steps, 0.0) / thp)
            if not j.straggling and j.straggle_at < 1:
                t = min(t, self.t + max(j.straggle_at * j.total_steps - j.steps, 0.0) / thp)
            # OOM: per-PS need reaches the PS memory
            k = j.kind
            if j.mem_ratio > 1:
                f = (j.cfg.ps_mem_gb * j.cfg.ps / k.ps_mem0 - 1) / (j.mem_ratio - 1)
                if f < 1:
                    t = min(t, self.t + max(f * j.total_steps - j.steps, 0.0) / thp)
        if j.fail_i < len(j.fail_draws):
            rate = (j.cfg.workers + j.cfg.ps) * POD_FAIL_PER_S
            t = min(t, self.t + max(j.fail_draws[j.fail_i][0] - j.exposure, 0.0) / rate)
        if self.policy != "manual":
            t = min(t, j.next_decision)
        return t

    def check(self, j: Job) -> None:
        """Apply the internal events due now."""
        j.pending = [(r, n) for r, n in j.pending if r > self.t + 1e-6]
        if j.migration is not None and self.t >= j.migration.ready - 1e-6:
            self.complete_migration(j)
        if self.t - j.ckpt_t >= CKPT_S:
            j.ckpt_t, j.ckpt_steps = self.t, j.steps
        if j.steps >= j.total_steps * (1 - 1e-9):
            self.finish(j, "done")
            return
        if not j.straggling and j.steps >= j.straggle_at * j.total_steps - 1e-6:
            j.straggling = True
            j.next_decision = min(j.next_decision, self.t + TICK_S)
        if j.mem_ratio > 1 and self.t >= j.paused_until and self.ps_mem_need(j) >= j.cfg.ps_mem_gb * (1 - 1e-9):
            j.ooms += 1
            self.lose_pod(j, True, oom=True)
            if j.state != "running":
                return
        if j.fail_i < len(j.fail_draws) and j.exposure >= j.fail_draws[j.fail_i][0] - 1e-9:
            u = j.fail_draws[j.fail_i][1]
            j.fail_i += 1
            j.failures += 1
            self.lose_pod(j, u < j.cfg.ps / (j.cfg.ps + j.cfg.workers))

    def decide(self) -> None:
        due = []
        for j in self.running:
            if self.t < j.next_decision - 1e-6:
                continue
            if j.migration is not None:  # decide again once the job trains on the new configuration
                j.next_decision = j.migration.ready + self.cost.ps_pause_s
                continue
            due.append(j)
        if not due:
            return
        cands: list[Candidate] = []
        for j in due:
            obs = self.observe(j)
            before = j.cfg
            planner = j.planner
            assert planner is not None
            if isinstance(planner, DLRoverRMPlanner):
                planner.observe(obs)
                new = PSConfig.from_plan(planner.plan(obs), before)
                if new != before:
                    self.apply(j, new)
                elif obs.ready:
                    cands.extend(planner.candidates(obs))
            else:
                self.apply(j, PSConfig.from_plan(planner.plan(obs), before))
            if j.cfg == before:
                j.stable += 1
            j.next_decision = self.t + (TICK_S if j.stable < 2 else SLOW_TICK_S)
        if cands:
            chosen = self.greedy.allocate(cands, [FreeCapacity(self.cores - self.used_cpu, self.mem - self.used_mem)])
            by_id = {j.jid: j for j in due}
            for cand in chosen:
                j = by_id[cand.job_id]
                self.apply(j, cand.config)
                j.next_decision = self.t + TICK_S

    def run(self) -> PolicyMetrics:
        arrivals = sorted(self.jobs, key=lambda j: j.submit)
        queue: list[Job] = []
        ai = 0
        samples_every = max(arrivals[-1].submit + 86400.0, 1.0) / TIMELINE_POINTS
        next_sample = 0.0
        while ai < len(arrivals) or queue or self.running:
            # next event
            t_next = arrivals[ai].submit if ai < len(arrivals) else math.inf
            for j in self.running:
                t_next = min(t_next, self.internal_events(j))
            if t_next == math.inf:
                break
            t_next = max(t_next, self.t + 1e-3)  # events at "now" were handled: never spin in place
            self.advance(t_next - self.t)
            self.t = t_next
            while ai < len(arrivals) and arrivals[ai].submit <= self.t:
                queue.append(arrivals[ai])
                ai += 1
            for j in list(self.running):
                self.check(j)
            self.running = [j for j in self.running if j.state == "running"]
            while queue and self.start(queue[0]):  # FIFO, no backfilling
                self.running.append(queue.pop(0))
            if self.policy != "manual":
                self.decide()
            self.refresh()
            if self.t >= next_sample:
                self.timeline.append((self.t, 0.0, self.cur_used / self.cores))
                next_sample = self.t + samples_every
            assert self.used_cpu <= self.cores + 1e-6 and self.used_mem <= self.mem + 1e-6
        return self.metrics()

    def metrics(self) -> PolicyMetrics:
        done = [j for j in self.jobs if j.state == "done"]
        jcts = [j.end - j.submit for j in done]
        started = [j for j in self.jobs if not math.isnan(j.start)]
        t0 = min(j.submit for j in self.jobs)
        makespan = max((j.end for j in self.jobs if not math.isnan(j.end)), default=t0) - t0
        extra: dict[str, float] = {
            "jobs": float(len(self.jobs)),
            "failed": float(sum(j.state == "failed" for j in self.jobs)),
            "oom_events": float(sum(j.ooms for j in self.jobs)),
            "pod_failures": float(sum(j.failures for j in self.jobs)),
            "cluster_cores": float(self.cores),
            "jct_over_ideal_median": statistics.median([(j.end - j.submit) / j.duration for j in done]) if done else math.nan,
        }
        job_util = [j.core_s_used / j.core_s_allocated for j in self.jobs if j.core_s_allocated > 0]
        if job_util:  # DLRover Fig. 2 measures this per job: > 80% of manual jobs below 0.5
            extra["job_cpu_util_median"] = statistics.median(job_util)
            extra["jobs_below_half_cpu"] = sum(u < 0.5 for u in job_util) / len(job_util)
        if self.policy == "dlrover-rm":
            rec = [j for j in done if j.warm and j.init_cfg is not None]
            if rec:
                acc_w = [1 - abs(j.init_cfg.workers - j.cfg.workers) / j.cfg.workers for j in rec if j.init_cfg]
                acc_p = [1 - abs(j.init_cfg.ps - j.cfg.ps) / j.cfg.ps for j in rec if j.init_cfg]
                extra.update({"recurring_jobs": float(len(rec)),
                              "warm_start_worker_accuracy": statistics.fmean(acc_w),
                              "warm_start_ps_accuracy": statistics.fmean(acc_p),
                              "warm_start_worker_rel_err": 1 - statistics.fmean(acc_w),
                              "warm_start_ps_rel_err": 1 - statistics.fmean(acc_p)})
        return PolicyMetrics(
            avg_jct_s=statistics.fmean(jcts) if jcts else math.nan,
            median_jct_s=statistics.median(jcts) if jcts else math.nan,
            makespan_s=makespan,
            avg_queue_s=statistics.fmean([j.start - j.submit for j in started]) if started else math.nan,
            gpu_util=0.0,
            cpu_util=self.util_area / (self.cores * makespan) if makespan > 0 else 0.0,
            completion_rate=len(done) / len(self.jobs),
            scaling_actions=sum(j.actions for j in self.jobs),
            extra=extra,
            timeline=self.timeline,
            jcts=jcts,
            jobs=[j.diagnostics() for j in self.jobs],
        )


def make_jobs(trace: Path, n: int, seed: int, load: float = DEFAULT_LOAD) -> tuple[list[Job], int]:
    """The window's jobs (same draws for every policy) and the cluster's server count.

    The cluster has as many servers as make the users' requested core-seconds over the
    arrival window ``load`` of its cores.
    """
    check_load(load)
    philly = load_philly(trace, n, seed, min_duration_s=MIN_DURATION_S)
    rng = random.Random(seed)
    kinds = make_kinds(max(4, n // 8), rng)
    weights = [1.0 / (i + 1) ** 0.8 for i in range(len(kinds))]  # a few models recur often
    jobs = []
    requested = 0.0
    for i, pj in enumerate(philly):
        k = rng.choices(kinds, weights)[0]
        quota = min(200, 64 * pj.num_gpus)
        best_thp, _ = ideal(k, quota)
        straggle = rng.random() if rng.random() < STRAGGLER_P else math.inf
        draws, acc = [], 0.0
        for _ in range(8):
            acc += rng.expovariate(1.0)
            draws.append((acc, rng.random()))
        job = Job(f"j{i}", pj.submit_s, k, quota, pj.duration_s * best_thp, pj.duration_s,
                  math.exp(k.mem_growth_mu + rng.gauss(0, 0.4)), straggle, draws)
        jobs.append(job)
        requested += quota * pj.duration_s
    span = max(philly[-1].submit_s, 3600.0)
    nodes = max(20, math.ceil(requested / span / load / NODE_CORES))
    return jobs, nodes


def simulate(trace: Path, jobs: int, seed: int, policy: str, load: float = DEFAULT_LOAD) -> PolicyMetrics:
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r} for dlrover-rm; known: {', '.join(POLICIES)}")
    js, nodes = make_jobs(trace, jobs, seed, load)
    return Sim(policy, js, nodes * NODE_CORES, nodes * NODE_MEM_GB, seed).run()


def run(trace: Path, jobs: int, seed: int, policies: list[str],
        load: float | None = None) -> ScenarioResult:
    """Simulate every policy on the same jobs; see the module docstring for the setup.

    ``load``: the requested cores' share of the cluster (None: ``DEFAULT_LOAD``).
    """
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ConfigError(f"unknown policy {unknown[0]!r} for dlrover-rm; known: {', '.join(POLICIES)}")
    out = {p: simulate(trace, jobs, seed, p, DEFAULT_LOAD if load is None else load) for p in (policies or POLICIES)}
    notes = ["throughput: DLRover-RM Eq. 1-6 with its section 6.2 coefficients (W&D-like), alpha_grad x7.8 "
             "for xDeepFM-like (DLRover Table 1); quota 200 cores/job, 32/pod (DLRover 6.1)",
             "instability: pod failures 1/500 pod-h, 7% worker stragglers at 25% CPU, ~5% OOM under user memory "
             "(DLRover-RM Table 4); overheads: 120 s pod start (DLRover 6.3), PS change 240 s / 60 s (DLRover-RM 5.2)"]
    return ScenarioResult("dlrover-rm", out, notes)
