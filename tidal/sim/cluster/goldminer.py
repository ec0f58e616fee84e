"""GoldMiner's cluster experiment (section 5.6): CPU allocation policies for data pre-processing.

Cluster: 8 machines x 8 V100 x 64 vCPUs (hardware CPU/GPU ratio 8). GPUs are always given by
YARN-CS FIFO with gang scheduling and compact packing (``tidal.brain.yarn``); the policies
differ in how CPUs are given:

* ``no-dw-tuned``: each worker asks for its model's best-fit CPU/GPU ratio on its own machine.
* ``no-dw-hw``: each worker asks for 8 CPUs (the hardware ratio), and runs slower if it needs more.
* ``fixed-dw``: trainers get their own CPUs; data workers (anywhere) get the tuned total,
  all before the job starts, never changed.
* ``goldminer-fair|maxtp|srtf``: a job starts like ``no-dw-hw`` (8 CPUs per GPU: trainer and
  one local data worker, section 5.5); its trainer is tuned down (``trainer_cpus``), its data
  worker size tuned (``data_worker_size``), and free CPUs go to data workers by the policy of
  ``tidal.brain.goldminer.DataWorkerAllocator``. Extra data workers are elastic: a starting job
  reclaims their CPUs when it needs them on its machines.

Where each number comes from:

* **Trace (Philly, measured)**: arrivals, GPUs and durations of a window of ``jobs``
  consecutive jobs (``load_philly``, jobs above 64 GPUs skipped). A duration is the job's
  work at the ideal speed (``steps = duration x ideal rate``); speeds below are fractions of it.
* **Models (paper + assumption)**: half the jobs CPU-intensive (WDL, DeepFM, DIN, AlexNet,
  ShuffleNet_v2, ResNet18), half not (Inception_v3, ResNet50, VGG16, Bert), uniform in each
  half (section 5.6). Best-fit CPU/GPU ratios: the paper gives them only as a figure (Fig. 1)
  with "up to 64" and "only Bert fits 8"; we assume 28, 24, 20, 32, 16, 24 and 12, 11, 10, 6.
  The trainer itself needs 3 CPUs per GPU (section 5.5's ResNet18 ends at 3); the rest is
  pre-processing. One data worker scales linearly up to 8 CPUs (section 5.5), the three
  recommendation models up to 4 ("scale poorly inside a single worker").
* **Speed model (assumption)**: data pre-processing is linear in CPUs (the paper's own
  assumption for data workers); monolithic speed ``min(1, (cpus - 3) / (ratio - 3))`` (the
  trainer's own 3 CPUs come first); with data workers
  ``min(1, (local + 0.9 x remote CPUs) / (g x pre-processing need))`` (remote data workers
  lose 10% to the transfer). GPU count does not change a job's step time here: GPUs are
  gang-allocated in every policy, so Pollux's scaling data does not apply.
* ``no-dw-tuned``: a ratio that could never fit an empty cluster (e.g. 32 GPUs at 24 CPUs)
  is cut to the most that fits (``64 / ceil(g / 8)`` per worker), else the FIFO would stop forever;
  likewise ``fixed-dw`` asks for at most what the empty cluster's CPUs supply.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from tidal.brain.goldminer import (
    DataJob,
    DataWorkerAllocator,
    MachineCpus,
    data_worker_size,
    trainer_cpus,
)
from tidal.brain.yarn import GangRequest, Machine, Placement, YarnCapacityFifo
from tidal.sim.cluster.api import (
    JobOutcome,
    PolicyMetrics,
    ScenarioResult,
    at_load,
    load_philly,
    policy_metrics,
    run_policies,
)

__all__ = ["MODELS", "POLICIES", "run"]

POLICIES = ["no-dw-tuned", "no-dw-hw", "fixed-dw", "goldminer-fair", "goldminer-maxtp", "goldminer-srtf"]

MACHINES, GPUS, CPUS = 8, 8, 64
HW_RATIO = CPUS // GPUS
TRAINER_CPUS = 3
REMOTE_EFFICIENCY = 0.9
#: model: (best-fit CPU/GPU ratio, CPUs one data worker scales to, CPU-intensive)
MODELS = {
    "WDL": (28, 4, True), "DeepFM": (24, 4, True), "DIN": (20, 4, True),
    "AlexNet": (32, 8, True), "ShuffleNet_v2": (16, 8, True), "ResNet18": (24, 8, True),
    "Inception_v3": (12, 8, False), "ResNet50": (11, 8, False), "VGG16": (10, 8, False),
    "Bert": (6, 8, False),
}


@dataclass
class _Job:
    job_id: str
    order: int
    submit_s: float
    gpus: int
    ratio: int
    dw_max: int
    remaining: float  # seconds of work at the ideal speed
    ideal_s: float
    speed: float = 0.0
    placement: Placement = field(default_factory=dict)
    # data workers: (machine, cpus, local, initial)
    dws: list[tuple[str, int, bool, bool]] = field(default_factory=list)
    gain_per_cpu: float = 0.0
    dw_size: int = 1
    start_s: float | None = None
    end_s: float | None = None

    @property
    def pre_cpus(self) -> float:  # pre-processing CPUs per GPU
        return float(self.ratio - TRAINER_CPUS)

    def dw_speed(self) -> float:
        supply = sum(min(c, self.dw_max) * (1.0 if local else REMOTE_EFFICIENCY)
                     for _, c, local, _ in self.dws)
        return min(1.0, supply / (self.gpus * self.pre_cpus))


def _make_jobs(trace: Path, jobs: int, seed: int, load: float | None = None) -> list[_Job]:
    philly = load_philly(trace, jobs, seed, max_gpus=MACHINES * GPUS)
    if load is not None:
        philly = at_load(philly, load, MACHINES * GPUS)
    rng = random.Random(seed)
    heavy = sorted(m for m, v in MODELS.items() if v[2])
    light = sorted(m for m, v in MODELS.items() if not v[2])
    out = []
    for i, pj in enumerate(philly):
        name = rng.choice(heavy if rng.random() < 0.5 else light)
        ratio, dw_max, _ = MODELS[name]
        out.append(_Job(f"j{i}", i, pj.submit_s, pj.num_gpus, ratio, dw_max, pj.duration_s, pj.duration_s))
    return out


class _Cluster:
    def __init__(self) -> None:
        self.gpus = {f"m{i}": GPUS for i in range(MACHINES)}
        self.cpus = {f"m{i}": CPUS for i in range(MACHINES)}

    def machines(self, extra_cpus: dict[str, int] | None = None) -> list[Machine]:
        extra = extra_cpus or {}
        return [Machine(n, "V100", self.gpus[n], self.cpus[n] + extra.get(n, 0)) for n in self.gpus]

    def take(self, placed: Placement) -> None:
        for n, (g, c) in placed.items():
            self.gpus[n] -= g
            self.cpus[n] -= round(c)

    def give(self, placed: Placement) -> None:
        for n, (g, c) in placed.items():
            self.gpus[n] += g
            self.cpus[n] += round(c)

    def usage(self) -> tuple[float, float]:
        total_g, total_c = MACHINES * GPUS, MACHINES * CPUS
        return 1 - sum(self.gpus.values()) / total_g, 1 - sum(self.cpus.values()) / total_c


def _place_data_workers(job: _Job, cpus_needed: float, free: dict[str, int]) -> list[tuple[str, int, bool, bool]] | None:
    """fixed-dw: tuned data workers (``dw_max`` CPUs each), local CPUs first, else ``None``."""
    free = dict(free)
    out: list[tuple[str, int, bool, bool]] = []
    supply = 0.0
    order = sorted(job.placement, key=lambda n: -free[n]) + sorted(
        (n for n in free if n not in job.placement), key=lambda n: -free[n])
    for n in order:
        local = n in job.placement
        eff = 1.0 if local else REMOTE_EFFICIENCY
        while free[n] > 0 and supply < cpus_needed - 1e-9:
            c = min(job.dw_max, free[n], math.ceil((cpus_needed - supply) / eff - 1e-9))
            out.append((n, c, local, True))
            free[n] -= c
            supply += c * eff
    return out if supply >= cpus_needed - 1e-9 else None


def _simulate(jobs: list[_Job], policy: str) -> PolicyMetrics:
    cluster = _Cluster()
    yarn = YarnCapacityFifo()
    elastic = policy.startswith("goldminer-")
    allocator = DataWorkerAllocator(policy.split("-", 1)[1]) if elastic else None
    pending = sorted(jobs, key=lambda j: j.submit_s)
    waiting: list[_Job] = []
    running: list[_Job] = []
    usage: list[tuple[float, float, float]] = []
    now = 0.0
    actions = 0

    def release_dw(j: _Job, dw: tuple[str, int, bool, bool]) -> None:
        j.dws.remove(dw)
        cluster.cpus[dw[0]] += dw[1]

    while pending or waiting or running:
        t_arr = pending[0].submit_s if pending else math.inf
        t_fin = min((now + j.remaining / j.speed for j in running if j.speed > 0), default=math.inf)
        t_next = min(t_arr, t_fin)
        if t_next == math.inf:
            raise RuntimeError(f"{policy}: {len(waiting)} jobs can never run")
        for j in running:
            j.remaining -= j.speed * (t_next - now)
        now = t_next
        for j in [j for j in running if j.remaining <= 1e-6 * max(j.ideal_s, 1.0)]:
            j.end_s = now
            running.remove(j)
            cluster.give(j.placement)
            for dw in list(j.dws):
                release_dw(j, dw)
        while pending and pending[0].submit_s <= now:
            waiting.append(pending.pop(0))

        # start jobs in FIFO order (gang), per policy
        while waiting:
            j = waiting[0]
            if policy in ("no-dw-tuned", "no-dw-hw"):
                cap = CPUS // math.ceil(j.gpus / MACHINES) if j.gpus > MACHINES else CPUS
                cpw = min(j.ratio, cap) if policy == "no-dw-tuned" else HW_RATIO
                placed = yarn.place(GangRequest(j.job_id, j.order, j.gpus, 1, cpw), cluster.machines())
                if placed is None:
                    break
                cluster.take(placed)
                j.placement, j.speed = placed, min(1.0, max(cpw - TRAINER_CPUS, 0) / j.pre_cpus)
            elif policy == "fixed-dw":
                placed = yarn.place(GangRequest(j.job_id, j.order, j.gpus, 1, TRAINER_CPUS), cluster.machines())
                if placed is None:
                    break
                j.placement = placed
                free = dict(cluster.cpus)
                for n, (_, c) in placed.items():
                    free[n] -= int(c)
                fits = REMOTE_EFFICIENCY * (MACHINES * CPUS - j.gpus * TRAINER_CPUS)
                dws = _place_data_workers(j, min(j.gpus * j.pre_cpus, fits), free)
                if dws is None:
                    j.placement = {}
                    break
                cluster.take(placed)
                for dw in dws:
                    cluster.cpus[dw[0]] -= dw[1]
                j.dws = dws
                j.speed = j.dw_speed()
            else:
                extra: dict[str, int] = {}
                for r in running:
                    for n, c, _, initial in r.dws:
                        if not initial:
                            extra[n] = extra.get(n, 0) + c
                placed = yarn.place(GangRequest(j.job_id, j.order, j.gpus, 1, HW_RATIO), cluster.machines(extra))
                if placed is None:
                    break
                for n, (_, c) in placed.items():  # reclaim elastic data workers where needed
                    for r in sorted(running, key=lambda r: -r.order):
                        for dw in [d for d in r.dws if d[0] == n and not d[3]]:
                            if cluster.cpus[n] >= c:
                                break
                            release_dw(r, dw)
                            r.speed = r.dw_speed()
                            actions += 1
                cluster.take(placed)
                _tune_job(j, placed)
                cluster.give({n: (0, c) for n, (g, c) in placed.items()})
                cluster.take({n: (0, g * TRAINER_CPUS) for n, (g, _) in placed.items()})
                for n, c, _, _ in j.dws:
                    cluster.cpus[n] -= c
                j.placement = {n: (g, float(g * TRAINER_CPUS)) for n, (g, _) in placed.items()}
            j.start_s = now
            waiting.pop(0)
            running.append(j)

        if allocator is not None:
            actions += _grant(allocator, running, cluster)
        g_used, c_used = cluster.usage()
        usage.append((now, g_used, c_used))

    outcomes = [JobOutcome(j.submit_s, j.start_s, j.end_s, j.ideal_s) for j in jobs]
    return policy_metrics(outcomes, usage, actions)


def _tune_job(j: _Job, placed: Placement) -> None:
    """Job-level tuning (section 3.4.1) fed with what the job would measure on this model."""
    need = j.gpus * j.pre_cpus
    per_cpu = 1.0 / need
    # (ii) grow one data worker from 1 CPU: linear to dw_max, flat after (up to the 8 it got)
    measured = [min(1.0, min(k, j.dw_max) * per_cpu) for k in range(1, HW_RATIO - TRAINER_CPUS + 1)]
    j.dw_size = data_worker_size(measured, ideal=1.0)
    # (iii) trainer CPUs from 8 down: full speed while >= TRAINER_CPUS
    # one initial data worker per training worker, on its machine (section 3.4.1)
    j.dws = [(n, min(HW_RATIO - TRAINER_CPUS, math.ceil(j.pre_cpus)), True, True)
             for n, (g, _) in placed.items() for _ in range(g)]
    with_dw = j.dw_speed()
    trainer = trainer_cpus([(c, with_dw if c >= TRAINER_CPUS else with_dw * c / TRAINER_CPUS)
                            for c in range(HW_RATIO, 0, -1)])
    assert trainer == TRAINER_CPUS
    # (i) ``use_data_workers`` is not consulted: this speed model gives data workers no transfer
    # overhead, so after the cluster's grants they always reach the monolithic baseline.
    j.speed = with_dw
    j.gain_per_cpu = per_cpu


def _grant(allocator: DataWorkerAllocator, running: list[_Job], cluster: _Cluster) -> int:
    if not any(cluster.cpus.values()):
        return 0
    dist = dict.fromkeys(cluster.cpus, 0)
    remote = dict.fromkeys(cluster.cpus, 0)
    for r in running:
        if len(r.placement) > 1:
            for n in r.placement:
                dist[n] += 1
        for n, _, local, _ in r.dws:
            if not local:
                remote[n] += 1
    machines = [MachineCpus(n, cluster.cpus[n], dist[n], remote[n]) for n in cluster.cpus]
    snaps = [DataJob(r.job_id, r.gpus, tuple(r.placement), r.speed, r.gain_per_cpu,
                     float(sum(c for _, c, _, _ in r.dws)), r.remaining, r.dw_size, r.order)
             for r in running]
    grants = allocator.allocate(snaps, machines)
    by_id = {r.job_id: r for r in running}
    for g in grants:
        r = by_id[g.job_id]
        before = r.speed
        r.dws.append((g.machine, g.cpus, g.local, False))
        cluster.cpus[g.machine] -= g.cpus
        r.speed = r.dw_speed()
        if r.speed > before:  # the measured gain of this step is the estimate of the next
            r.gain_per_cpu = (r.speed - before) / g.cpus
    return len(grants)


def run(trace: Path, jobs: int, seed: int, policies: list[str],
        load: float | None = None) -> ScenarioResult:
    """Simulate each of ``policies`` on the same ``jobs`` jobs of ``trace`` (window by ``seed``).

    ``load``: stretch the arrivals to this offered load (``at_load``); None keeps Philly's times.

    Raises:
        ConfigError: an unknown policy, or a trace with fewer usable jobs.
    """
    return run_policies("goldminer", POLICIES, policies, __doc__ or "",
                        lambda policy: _simulate(_make_jobs(trace, jobs, seed, load), policy))
