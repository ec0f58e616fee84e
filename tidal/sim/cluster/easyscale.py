"""EasyScale's trace experiment (section 5.2): YARN-CS vs EasyScale-homo vs EasyScale-heter.

Cluster: 32 V100 (4 servers x 8), 16 P100 (8 x 2), 16 T4 (4 x 4), as in section 5.

Where each number comes from:

* **Trace (Philly, measured)**: arrivals, GPU counts (``max_p``: the job's ESTs, i.e. the
  GPUs it asked for) and durations of a window of ``jobs`` consecutive jobs of
  ``philly-jobs.csv`` (``load_philly``; jobs above 32 GPUs are skipped: YARN-CS gives one
  type per job and there are 32 V100). A duration becomes a number of training steps at the
  job's *ideal* speed: the fastest all-V100 packed configuration of at most ``max_p`` GPUs.
* **Models (assumption)**: each job trains one of the eight models of Table 1, uniformly.
  ShuffleNetV2, ResNet50, VGG19, YOLOv3 rely on vendor convolution kernels, so EasyScale
  confines them to homogeneous GPUs (section 5.1.3: D2 costs them 236%); NeuMF, Bert,
  Electra and SwinTransformer may mix types (< 1% overhead, ignored).
* **Step times (Pollux, measured)**: each model is mapped to a measured Pollux application
  (CV models -> ``imagenet`` (ResNet-50), Bert/Electra -> ``bert``, NeuMF -> ``cifar10``, the
  smallest). Compute time of one mini-batch on one GPU: ``step_time - sync_time`` of
  placement ``1`` at the middle local batch size of ``placements.csv``. Gradient
  synchronisation: Pollux's own form ``alpha + beta * (K - 2)`` for K >= 2 GPUs, one pair for
  single-node and one for multi-node placements, fitted by NNLS to every ``sync_time`` of
  ``placements.csv`` and ``scalability.csv``. Pollux measured on T4 GPUs.
* **GPU speeds (assumption)**: compute per mini-batch on V100, P100, T4 in the ratio
  2.5 : 1.5 : 1 (public ResNet-50 training benchmarks); synchronisation costs the same on
  every type. Jobs are packed: a plan with ``N_i`` GPUs of type ``i`` spans
  ``sum_i ceil(N_i / GPUs per server of type i)`` servers.
* **EasyScale (paper's model)**: a plan with ``A_i`` ESTs per GPU runs one step in
  ``max_i A_i / C_i + sync(K, servers)`` (the bottleneck of Eq. 1b plus synchronisation).
  The intra-job planner estimates with Eq. 1 only (no synchronisation): it can be wrong, and
  the Role-3 fallback catches the scale-outs measured slower. Each rescale pauses the job
  10 s (section 5.3: jobs "scale in seconds"); a measurement round follows 60 s after a
  scale-out. YARN-CS jobs keep their gang: one EST per GPU, never rescaled.
* **Queue (our extension)**: EasyScale's jobs are served least attained service first, and a
  queued job preempts one that has trained ``PREEMPT_AFTER_S`` (4 hours) longer
  (``InterJobAllocator.preempt_after_s``); the paper serves its queue in submission order.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from tidal.api import ConfigError
from tidal.brain.easyscale import ElasticJob, InterJobAllocator, IntraJobPlanner, map_ests
from tidal.brain.yarn import GangRequest, Machine, YarnCapacityFifo
from tidal.sim.cluster.api import (
    JobOutcome,
    PolicyMetrics,
    ScenarioResult,
    at_load,
    load_philly,
    policy_metrics,
    run_policies,
    srpt_mean_flow_s,
)

__all__ = ["POLICIES", "AppProfile", "pollux_profiles", "run"]

POLICIES = ["yarn-cs", "easyscale-homo", "easyscale-heter"]

#: (type, servers, GPUs per server); V100 first: YARN-CS prefers the fastest type that fits
SERVERS = (("V100", 4, 8), ("P100", 8, 2), ("T4", 4, 4))
TOTAL_GPUS = sum(n * g for _, n, g in SERVERS)
SPEED = {"V100": 2.5, "P100": 1.5, "T4": 1.0}  # relative to T4 (assumption, see docstring)
RESCALE_PAUSE_S = 10.0
#: EasyScale's jobs are ranked by the service they have had, and a queued one preempts a job that
#: has trained this much longer (``InterJobAllocator.preempt_after_s``, least attained service);
#: 4 hours chosen on Philly seeds 0-9 (1 hour lost up to 15% on a window that barely queues)
PREEMPT_AFTER_S = 4 * 3600.0
MEASURE_AFTER_S = 60.0
MAX_JOB_GPUS = 32

#: Table 1 models: (Pollux application for step times, may use heterogeneous GPUs)
MODELS = {
    "ShuffleNetv2": ("imagenet", False), "ResNet50": ("imagenet", False),
    "VGG19": ("imagenet", False), "YOLOv3": ("imagenet", False),
    "NeuMF": ("cifar10", True), "Bert": ("bert", True), "Electra": ("bert", True),
    "SwinTransformer": ("imagenet", True),
}


@dataclass(frozen=True)
class AppProfile:
    """Measured step-time model of one Pollux application (seconds, on a T4)."""

    compute_s: float  # one mini-batch on one GPU
    local: tuple[float, float]  # (alpha, beta) of sync on one server, K >= 2
    multi: tuple[float, float]  # (alpha, beta) of sync across servers

    def sync_s(self, gpus: int, servers: int) -> float:
        if gpus < 2:
            return 0.0
        a, b = self.multi if servers > 1 else self.local
        return a + b * (gpus - 2)


# Fitted by ``pollux_profiles`` on ../shared/traces/pollux-throughput (used when it is absent).
_EMBEDDED = {
    "imagenet": AppProfile(0.41951, (0.0043456, 0.00062747), (0.086727, 0.0040263)),
    "bert": AppProfile(0.68956, (0.055499, 0.022009), (0.92983, 0.0072335)),
    "cifar10": AppProfile(0.13669, (0.0053404, 0.011834), (0.053006, 0.0023037)),
}


def pollux_profiles(root: Path) -> dict[str, AppProfile]:
    """Fit ``AppProfile`` of each application under ``root`` (``APP/{placements,scalability}.csv``)."""
    out: dict[str, AppProfile] = {}
    for app in _EMBEDDED:
        try:
            with open(root / app / "placements.csv", newline="") as f:
                rows = list(csv.DictReader(f))
            with open(root / app / "scalability.csv", newline="") as f:
                scal = list(csv.DictReader(f))
        except OSError as exc:
            raise ConfigError(f"cannot read Pollux measurements under {root}: {exc}") from None
        bszs = sorted({int(r["local_bsz"]) for r in rows})
        ref = bszs[len(bszs) // 2]
        comp = [float(r["step_time"]) - float(r["sync_time"]) for r in rows
                if r["placement"] == "1" and int(r["local_bsz"]) == ref]
        pts = [(sum(int(c) for c in r["placement"]), len(r["placement"]), float(r["sync_time"]))
               for r in rows]
        pts += [(int(r["num_replicas"]), int(r["num_nodes"]), float(r["sync_time"])) for r in scal]
        fits = []
        for multi in (False, True):
            sel = [(k, s) for k, m, s in pts if k >= 2 and (m > 1) == multi]
            a = np.array([[1.0, k - 2.0] for k, _ in sel])
            x, _ = nnls(a, np.array([s for _, s in sel]))
            fits.append((float(x[0]), float(x[1])))
        out[app] = AppProfile(float(np.mean(comp)), fits[0], fits[1])
    return out


@dataclass
class _Job:
    job_id: str
    order: int
    submit_s: float
    max_p: int
    app: AppProfile
    heterogeneous: bool
    steps: float
    ideal_s: float
    remaining: float = 0.0
    alloc: dict[str, int] = field(default_factory=dict)
    rate: float = 0.0  # steps/s on alloc
    pause_until: float = 0.0
    start_s: float | None = None
    end_s: float | None = None
    previous: dict[str, int] | None = None
    rate_previous: float | None = None
    banned: frozenset[tuple[tuple[str, int], ...]] = frozenset()
    measured_plans: dict[tuple[tuple[str, int], ...], float] = field(default_factory=dict)
    attained_s: float = 0.0  # seconds trained, pauses excluded

    def capability(self) -> dict[str, float]:
        return {t: SPEED[t] / self.app.compute_s for t in SPEED}


def _servers(counts: Mapping[str, int]) -> int:
    per = {t: g for t, _, g in SERVERS}
    return sum(math.ceil(n / per[t]) for t, n in counts.items() if n > 0)


def true_rate(job: _Job, counts: Mapping[str, int], servers: int | None = None) -> float:
    """Steps/s of ``job`` on ``counts`` GPUs: bottleneck compute (Eq. 1b) plus synchronisation."""
    used = {t: n for t, n in counts.items() if n > 0}
    if not used:
        return 0.0
    plan = map_ests(job.max_p, used, job.capability())
    a = dict(plan.ests_per_gpu)
    compute = max(a[t] * job.app.compute_s / SPEED[t] for t in used)
    k = sum(used.values())
    return 1.0 / (compute + job.app.sync_s(k, _servers(used) if servers is None else servers))


def _ideal_rate(job: _Job) -> float:
    per_server = SERVERS[0][2]
    best = 0.0
    for n in range(1, job.max_p + 1):
        step = math.ceil(job.max_p / n) * job.app.compute_s / SPEED["V100"]
        best = max(best, 1.0 / (step + job.app.sync_s(n, math.ceil(n / per_server))))
    return best


def _make_jobs(trace: Path, jobs: int, seed: int, load: float | None = None) -> list[_Job]:
    philly = load_philly(trace, jobs, seed, max_gpus=MAX_JOB_GPUS)
    if load is not None:
        philly = at_load(philly, load, TOTAL_GPUS)
    root = trace.parent / "pollux-throughput"
    profiles = pollux_profiles(root) if root.is_dir() else dict(_EMBEDDED)
    rng = random.Random(seed)
    names = sorted(MODELS)
    out = []
    for i, pj in enumerate(philly):
        app, het = MODELS[rng.choice(names)]
        job = _Job(f"j{i}", i, pj.submit_s, pj.num_gpus, profiles[app], het, 0.0, pj.duration_s)
        job.steps = job.remaining = pj.duration_s * _ideal_rate(job)
        out.append(job)
    return out


class _Usage:
    def __init__(self, total_gpus: int) -> None:
        self.total = total_gpus
        self.samples: list[tuple[float, float, float]] = []

    def record(self, now: float, busy_gpus: int) -> None:
        u = busy_gpus / self.total
        if self.samples and self.samples[-1][0] == now:
            self.samples[-1] = (now, u, 0.0)
        elif not self.samples or self.samples[-1][1] != u:
            self.samples.append((now, u, 0.0))


def _advance(running: list[_Job], t0: float, t1: float) -> None:
    for j in running:
        eff = t1 - max(t0, j.pause_until)
        if eff > 0:
            j.remaining -= j.rate * eff
            j.attained_s += eff


def _finish_time(j: _Job, now: float) -> float:
    if j.rate <= 0:
        return math.inf
    return max(now, j.pause_until) + max(j.remaining, 0.0) / j.rate


def _simulate(jobs: list[_Job], policy: str) -> PolicyMetrics:
    total = sum(s * g for _, s, g in SERVERS)
    usage = _Usage(total)
    pending = sorted(jobs, key=lambda j: j.submit_s)
    waiting: list[_Job] = []
    running: list[_Job] = []
    now = 0.0
    actions = fallbacks = 0
    next_round = math.inf
    heter = policy == "easyscale-heter"
    planner = IntraJobPlanner(heterogeneous=heter)
    allocator = InterJobAllocator(planner, preempt_after_s=PREEMPT_AFTER_S)
    yarn = YarnCapacityFifo()
    free_m = {f"{t}-{i}": Machine(f"{t}-{i}", t, g) for t, s, g in SERVERS for i in range(s)}
    placements: dict[str, dict[str, tuple[int, float]]] = {}
    while pending or waiting or running:
        t_arr = pending[0].submit_s if pending else math.inf
        t_fin = min((_finish_time(j, now) for j in running), default=math.inf)
        t_next = min(t_arr, t_fin, next_round)
        if t_next == math.inf:
            raise RuntimeError(f"{policy}: {len(waiting)} jobs can never run")
        _advance(running, now, t_next)
        now = t_next
        if next_round <= now:
            next_round = math.inf
        for j in [j for j in running if j.remaining <= 1e-6 * j.steps or _finish_time(j, now) <= now]:
            j.end_s, j.remaining = now, 0.0
            running.remove(j)
            if policy == "yarn-cs":
                for name, (g, c) in placements.pop(j.job_id).items():
                    m = free_m[name]
                    free_m[name] = Machine(m.name, m.gpu_type, m.gpus + g, m.cpus + c)
        while pending and pending[0].submit_s <= now:
            waiting.append(pending.pop(0))

        if policy == "yarn-cs":
            queue = [GangRequest(j.job_id, j.order, j.max_p) for j in waiting]
            started = {g.job_id: g.placement for g in yarn.allocate(queue, list(free_m.values()))}
            for j in list(waiting):
                if j.job_id not in started:
                    continue
                placed = placements[j.job_id] = started[j.job_id]
                for name, (g, c) in placed.items():
                    m = free_m[name]
                    free_m[name] = Machine(m.name, m.gpu_type, m.gpus - g, m.cpus - c)
                t = free_m[next(iter(placed))].gpu_type
                j.alloc = {t: j.max_p}
                j.rate = true_rate(j, j.alloc, servers=len(placed))
                j.start_s = now
                waiting.remove(j)
                running.append(j)
        else:
            # Role-3: fall back from scale-outs measured slower (rates are measured at once)
            for j in running:
                snap = ElasticJob(j.job_id, j.order, j.max_p, j.capability(), j.alloc,
                                  heter and j.heterogeneous, j.previous, j.rate, j.rate_previous)
                back = planner.fallback(snap)
                if back is not None:
                    j.banned = j.banned | {tuple(sorted(j.alloc.items()))}
                    j.alloc, j.rate = back, true_rate(j, back)
                    j.measured_plans[tuple(sorted(back.items()))] = j.rate
                    j.pause_until = now + RESCALE_PAUSE_S
                    fallbacks += 1
                    actions += 1
                j.previous = j.rate_previous = None
            free = {t: s * g for t, s, g in SERVERS}
            for j in running:
                for t, n in j.alloc.items():
                    free[t] -= n
            snaps = [ElasticJob(j.job_id, j.order, j.max_p, j.capability(), j.alloc,
                                heter and j.heterogeneous, banned=j.banned,
                                measured_plans=dict(j.measured_plans), attained_s=j.attained_s)
                     for j in running + waiting]
            by_id = {j.job_id: j for j in running + waiting}
            # the inter-job scheduler shares GPUs by type: one pooled "machine" per type
            for grant in allocator.allocate(snaps, [Machine(t, t, n) for t, n in free.items()]):
                j, new = by_id[grant.job_id], grant.gpus
                old_gpus = sum(j.alloc.values())
                if j.start_s is None:
                    j.start_s = now
                    waiting.remove(j)
                    running.append(j)
                elif new:
                    actions += 1
                    j.pause_until = now + RESCALE_PAUSE_S
                    if j in waiting:  # a preempted job resumes
                        waiting.remove(j)
                        running.append(j)
                if sum(new.values()) > old_gpus and old_gpus > 0:
                    j.previous, j.rate_previous = dict(j.alloc), j.rate
                    next_round = min(next_round, now + MEASURE_AFTER_S)
                j.alloc = new
                j.rate = true_rate(j, new)
                if new:  # the framework reports it: the companion module's database keeps it
                    j.measured_plans[tuple(sorted(new.items()))] = j.rate
                else:  # preempted (or reclaimed to zero by a non-elastic job): back to the queue
                    j.previous = j.rate_previous = None
                    running.remove(j)
                    waiting.append(j)
                    actions += 1
        usage.record(now, sum(sum(j.alloc.values()) for j in running))
    outcomes = [JobOutcome(j.submit_s, j.start_s, j.end_s, j.ideal_s) for j in jobs]
    avg_gpus = float(np.mean([j.max_p for j in jobs])) if jobs else 0.0
    metrics = policy_metrics(outcomes, usage.samples, actions,
                             {"fallbacks": float(fallbacks), "avg_requested_gpus": avg_gpus})
    metrics.avg_capacity_s = srpt_mean_flow_s([(j.submit_s, least_work(j)) for j in jobs], CLUSTER_SPEED)
    return metrics


#: the whole cluster's compute, in V100s (``least_work``'s unit): 32 + 16 x 0.6 + 16 x 0.4 = 48
CLUSTER_SPEED = sum(n * g * SPEED[t] / SPEED["V100"] for t, n, g in SERVERS)


def least_work(job: _Job) -> float:
    """V100-seconds ``job`` needs on any plan: every step computes all ``max_p`` ESTs, each
    ``compute_s / SPEED[t]`` on a GPU of type t, i.e. ``compute_s / SPEED["V100"]`` V100-seconds
    (a slower GPU is a fraction of a V100 busy longer); synchronisation only adds to it."""
    return job.steps * job.max_p * job.app.compute_s / SPEED["V100"]


def run(trace: Path, jobs: int, seed: int, policies: list[str],
        load: float | None = None) -> ScenarioResult:
    """Simulate each of ``policies`` on the same ``jobs`` jobs of ``trace`` (window by ``seed``).

    ``load``: stretch the arrivals to this offered load (``at_load``); None keeps Philly's times.

    Raises:
        ConfigError: an unknown policy, or a trace with fewer usable jobs.
    """
    return run_policies("easyscale", POLICIES, policies, __doc__ or "",
                        lambda policy: _simulate(_make_jobs(trace, jobs, seed, load), policy))
