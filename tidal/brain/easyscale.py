"""EasyScale's scheduler (Li et al., "EasyScale", section 3.4): intra-job planner, inter-job allocator.

A job declares ``max_p`` logical workers (EasyScaleThreads, ESTs); whatever GPUs it holds, it
trains exactly those ``max_p`` ESTs, several per GPU where it has fewer GPUs. Two levels:

* ``IntraJobPlanner`` (one per job, the companion module's plan database made a function):
  Role-1 maps the ESTs onto the GPUs the job holds with the waste model (Eq. 1a-1d,
  ``map_ests``); Role-2 proposes the top-k *incremental* plans (``+d`` GPUs of one type) with
  their estimated speedup (``propose``); Role-3 falls back to the previous GPUs when the
  throughput measured after a scale-out is lower than before (``fallback``).
* ``InterJobAllocator`` (the cluster scheduler): non-elastic jobs first (they have priority
  and may reclaim GPUs from elastic jobs), then queued elastic jobs in submission order with one
  GPU each (``min GPUs = 0`` in the paper, so a job needs no gang; we give it the smallest
  start, reclaiming one GPU from the elastic job that loses least if none is free), then the
  free GPUs go to the proposals with the highest speedup per GPU (ties: more GPUs). It is a
  ``ClusterAllocator`` (``tidal.brain.api``): ``allocate(jobs, machines) -> [GpuGrant]``; it
  shares GPUs by type (placement is not its concern), so the machines' free GPUs are pooled
  per type.

Decisions here are pure: the snapshot (``ElasticJob``) carries what the job master would
observe, including the measured throughputs the fallback compares.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from tidal.api import ConfigError
from tidal.brain.yarn import Machine

__all__ = [
    "ElasticJob",
    "EstPlan",
    "GangJob",
    "GpuGrant",
    "InterJobAllocator",
    "IntraJobPlanner",
    "PlanDatabase",
    "Proposal",
    "estimated_throughput",
    "map_ests",
    "waste",
]


def _used(counts: Mapping[str, int]) -> dict[str, int]:
    return {t: n for t, n in counts.items() if n > 0}


def _delta(held: Mapping[str, int], target: Mapping[str, int]) -> dict[str, int]:
    """GPUs of each type that going from ``held`` to ``target`` adds (> 0) or gives back (< 0)."""
    return {t: target.get(t, 0) - held.get(t, 0) for t in set(target) | set(held)}


def waste(max_p: int, counts: Mapping[str, int], ests_per_gpu: Mapping[str, int],
          capability: Mapping[str, float]) -> float:
    """Wasted computing capability of an EST-to-GPU mapping, in mini-batches/s (Eq. 1a-1c).

    Args:
        max_p: ``maxP``, the job's number of ESTs (fixed by the developer).
        counts: ``N_i``, GPUs of type ``i`` in the plan.
        ests_per_gpu: ``A_i``, the most ESTs one GPU of type ``i`` runs (>= 1 where N_i > 0).
        capability: ``C_i``, mini-batches/s one GPU of type ``i`` computes for this job.

    Terms:
        * Eq. 1a: ``nEST = sum_i N_i * A_i`` must be ``>= maxP``; the surplus ``nEST - maxP``
          are EST slots that run nothing.
        * Eq. 1b: ``f_overload = max_{i, N_i > 0} A_i / C_i``: seconds per step of the slowest
          GPU type; in synchronous SGD every GPU waits for it.
        * Eq. 1c: ``waste = sum_{i, N_i > 0} N_i * (C_i - A_i / f_overload)
          + (nEST - maxP) / f_overload``: capability a GPU of type ``i`` leaves idle while it
          waits for the bottleneck (``C_i - A_i / f``), plus the empty slots of the surplus.
          The printed Eq. 1c sums the first term once per *type*; the waste is per GPU, so we
          weight it by ``N_i`` (identical for one GPU per type and for homogeneous plans).
          With the weight, Eq. 1d reduces to ``maxP / f_overload``: the step pace of the
          bottleneck, which is what a synchronous job achieves.

    Raises:
        ConfigError: a used type without capability or with ``A_i < 1``, or ``nEST < maxP``.
    """
    used = _used(counts)
    if not used:
        raise ConfigError("a plan needs at least one GPU")
    for t in used:
        if capability.get(t, 0.0) <= 0 or ests_per_gpu.get(t, 0) < 1:
            raise ConfigError(f"GPU type {t!r} needs C_i > 0 and A_i >= 1")
    n_est = sum(n * ests_per_gpu[t] for t, n in used.items())  # Eq. 1a
    if n_est < max_p:
        raise ConfigError(f"nEST {n_est} < maxP {max_p} (Eq. 1a)")
    f_overload = max(ests_per_gpu[t] / capability[t] for t in used)  # Eq. 1b
    idle = sum(n * (capability[t] - ests_per_gpu[t] / f_overload) for t, n in used.items())
    return idle + (n_est - max_p) / f_overload  # Eq. 1c


def estimated_throughput(max_p: int, counts: Mapping[str, int], ests_per_gpu: Mapping[str, int],
                         capability: Mapping[str, float]) -> float:
    """Eq. 1d: ``throughput = sum_i N_i * C_i - waste`` in mini-batches/s (divide by maxP for steps/s)."""
    total = sum(n * capability[t] for t, n in _used(counts).items())
    return total - waste(max_p, counts, ests_per_gpu, capability)


@dataclass(frozen=True)
class EstPlan:
    """An EST-to-GPU mapping: ``N_i`` GPUs of type ``i``, each running at most ``A_i`` ESTs."""

    max_p: int
    counts: tuple[tuple[str, int], ...]  # (type, N_i), sorted by type
    ests_per_gpu: tuple[tuple[str, int], ...]  # (type, A_i)
    throughput: float  # Eq. 1d, mini-batches/s

    @property
    def gpus(self) -> int:
        return sum(n for _, n in self.counts)

    def count_of(self) -> dict[str, int]:
        return dict(self.counts)


def map_ests(max_p: int, counts: Mapping[str, int], capability: Mapping[str, float]) -> EstPlan:
    """Role-1: the mapping of ``max_p`` ESTs onto ``counts`` GPUs with the least waste.

    Water-filling: every used GPU gets one EST (``A_i >= 1``); while ``nEST < maxP`` the type
    whose next EST finishes earliest (smallest ``(A_i + 1) / C_i``) gets one more per GPU.
    The bottleneck ``f_overload`` of the result is the smallest any integer mapping reaches,
    hence (Eq. 1d = maxP / f) the highest estimated throughput. GPUs beyond ``max_p`` could
    run nothing: a plan never has more GPUs than ESTs.

    Raises:
        ConfigError: no GPUs, more GPUs than ESTs, or a type without capability.
    """
    used = _used(counts)
    if not used or sum(used.values()) > max_p:
        raise ConfigError(f"a plan needs 1..{max_p} GPUs, got {sum(used.values())}")
    a = dict.fromkeys(used, 1)
    while sum(used[t] * a[t] for t in used) < max_p:
        t = min(used, key=lambda k: ((a[k] + 1) / capability[k], k))
        a[t] += 1
    tput = estimated_throughput(max_p, used, a, capability)
    return EstPlan(max_p, tuple(sorted(used.items())), tuple(sorted(a.items())), tput)


@dataclass(frozen=True)
class ElasticJob:
    """What the intra-job scheduler of one elastic job sees.

    Attributes:
        job_id: the job.
        order: submission order (smaller first).
        max_p: ESTs (the job never holds more GPUs than this).
        capability: ``C_i`` per GPU type, mini-batches/s (profiled / from history).
        allocation: GPUs held now, by type.
        heterogeneous: may mix GPU types (EasyScale-D2 possible); otherwise one type only.
        previous: GPUs held before the last scale-out (``None`` when the last change was not one).
        measured: throughput measured on ``allocation`` (steps/s), ``None`` when not yet measured.
        measured_previous: throughput measured on ``previous``.
        banned: plans (sorted ``(type, N_i)`` pairs) measured slower than the plan before
            them; never proposed again (the companion module's database update on a bias).
        measured_plans: throughput (steps/s) measured on each plan the job has run, keyed like
            ``banned``: the companion module's database of plans, corrected by what the
            framework reported. Estimates use it (``PlanDatabase``).
        attained_s: seconds the job has trained so far, pauses excluded (its attained service;
            ``InterJobAllocator``'s ``preempt_after_s`` orders and preempts by it).
    """

    job_id: str
    order: float
    max_p: int
    capability: Mapping[str, float]
    allocation: Mapping[str, int] = field(default_factory=dict)
    heterogeneous: bool = True
    previous: Mapping[str, int] | None = None
    measured: float | None = None
    measured_previous: float | None = None
    banned: frozenset[tuple[tuple[str, int], ...]] = frozenset()
    measured_plans: Mapping[tuple[tuple[str, int], ...], float] = field(default_factory=dict)
    attained_s: float = 0.0

    @property
    def gpus(self) -> int:
        return sum(self.allocation.values())


@dataclass(frozen=True)
class Proposal:
    """Role-2: ``add`` GPUs (one type) would take the job from ``current`` to ``plan``.

    ``speedup`` is the estimated throughput ratio new / current (``inf`` from zero GPUs).
    An *upgrade* also gives ``release`` GPUs back (same count, a slower type). A *return* to a
    plan the job has run (``IntraJobPlanner.propose``) may add and release several types:
    ``add`` then names the type with the largest increase and counts every GPU added, and
    ``release`` likewise; ``plan`` is what the allocator applies in every case.
    """

    job_id: str
    add: tuple[str, int]
    plan: EstPlan
    speedup: float
    release: tuple[str, int] | None = None  # an upgrade gives these GPUs back

    @property
    def gpus(self) -> int:
        return self.add[1]

    @property
    def speedup_per_gpu(self) -> float:
        """Relative throughput gain per added GPU, ``(speedup - 1) / added`` (``inf`` when a
        return to a measured plan adds none)."""
        return (self.speedup - 1.0) / self.add[1] if self.add[1] else math.inf


class PlanDatabase:
    """The companion module's database of one job's plans (section 3.4), from a snapshot.

    The paper's module estimates each plan from performance models and updates the database
    "once it has monitored significant biases between the estimated throughput and the
    reported throughput". Here a plan's throughput (mini-batches/s) is

    * what was measured on it, where the job has run it (``ElasticJob.measured_plans``);
    * else Eq. 1d times the bias (measured over Eq. 1d) of the measured plan over the same
      GPU types nearest in GPU count: plans over the same types share what Eq. 1 leaves out
      (a mix spread over servers pays synchronisation a one-server plan does not);
    * else Eq. 1d times ``held_bias``: the bias measured on the plan the job holds (given,
      or from the snapshot; where that was not measured, the median over its measured plans).

    Without the measurements a job that left a fast one-server plan for a slow mix would be
    told that going back gains little and stay on the mix, and every other mix it was offered
    would be tried, measured slower and fallen back from, one by one.
    """

    def __init__(self, job: ElasticJob, held_bias: float | None = None) -> None:
        self.job = job
        self._by_types: dict[tuple[str, ...], list[tuple[int, float]]] = {}
        ratios: dict[tuple[tuple[str, int], ...], float] = {}
        for counts, rate in job.measured_plans.items():
            ratios[counts] = rate * job.max_p / map_ests(job.max_p, dict(counts), job.capability).throughput
            self._by_types.setdefault(tuple(t for t, _ in counts), []).append(
                (sum(n for _, n in counts), ratios[counts]))
        if held_bias is None:
            held = tuple(sorted(_used(job.allocation).items()))
            ordered = sorted(ratios.values())
            held_bias = ratios.get(held, ordered[len(ordered) // 2] if ordered else 1.0)
        self.held_bias = held_bias

    def estimate(self, counts: Mapping[str, int]) -> EstPlan:
        """The least-waste mapping of ``counts`` (Role-1) with its throughput as above."""
        job = self.job
        plan = map_ests(job.max_p, _used(counts), job.capability)
        measured = job.measured_plans.get(plan.counts)
        if measured is not None:
            return replace(plan, throughput=measured * job.max_p)
        same = self._by_types.get(tuple(t for t, _ in plan.counts))
        bias = min(same, key=lambda g: (abs(g[0] - plan.gpus), g[0]))[1] if same else self.held_bias
        return replace(plan, throughput=plan.throughput * bias)


class IntraJobPlanner:
    """Roles 1-3 of EasyScale's intra-job scheduler over an ``ElasticJob`` snapshot.

    Args:
        top_k: proposals kept per job (ranked by estimated throughput improvement).
        increments: the homogeneous GPU increments tried (``+d`` GPUs of one type).
        heterogeneous: ``False`` confines every job to one GPU type (EasyScale-homo).
    """

    name = "easyscale-intra"

    def __init__(self, top_k: int = 3, increments: Sequence[int] = (1, 2, 4, 8),
                 heterogeneous: bool = True) -> None:
        if top_k < 1 or not increments or min(increments) < 1:
            raise ConfigError("top_k and increments must be >= 1")
        self.top_k = top_k
        self.increments = tuple(sorted(set(increments)))
        self.heterogeneous = heterogeneous

    def plan(self, job: ElasticJob) -> EstPlan | None:
        """Role-1: the best mapping on the GPUs the job holds (``None`` without GPUs), with
        its throughput as ``PlanDatabase`` rates it."""
        return PlanDatabase(job).estimate(job.allocation) if job.gpus else None

    @staticmethod
    def bias(job: ElasticJob) -> float:
        """Measured over estimated (Eq. 1d) throughput on the plan the job holds; where that
        plan was not measured, the median over the job's measured plans; 1 before any."""
        return PlanDatabase(job).held_bias

    def _types(self, job: ElasticJob) -> list[str]:
        held = [t for t, n in job.allocation.items() if n > 0]
        if held and not (self.heterogeneous and job.heterogeneous):
            return held
        return sorted(job.capability)

    def propose(self, job: ElasticJob, free: Mapping[str, int], bias: float | None = None) -> list[Proposal]:
        """Role-2: the top-k ``+d`` GPUs of one type that fit ``free``, by estimated gain
        (``PlanDatabase``; ``bias`` overrides the held plan's), with the upgrades and returns
        below competing for the same k.

        Plans with no estimated gain, above ``max_p`` GPUs or in the job's ``banned`` set
        are not proposed.
        """
        db = PlanDatabase(job, bias)
        current = db.estimate(job.allocation) if job.gpus else None
        base = current.throughput if current else 0.0
        out: list[Proposal] = []
        for t in self._types(job):
            for d in self.increments:
                if d > free.get(t, 0) or job.gpus + d > job.max_p:
                    break
                counts = dict(job.allocation)
                counts[t] = counts.get(t, 0) + d
                plan = db.estimate(counts)
                if plan.throughput <= base * (1 + 1e-9) or plan.counts in job.banned:
                    continue
                speedup = math.inf if base == 0 else plan.throughput / base
                out.append(Proposal(job.job_id, (t, d), plan, speedup))
        if current is not None:
            out.extend(self._upgrades(job, free, base, db))
            out.extend(self._returns(job, free, base, current, db))
        # a plan that another proposal matches with fewer GPUs is dominated (lower speedup per
        # GPU): never the allocator's pick, it would only take a top-k slot from its dominator
        out = [p for p in out if not any(q.plan.gpus < p.plan.gpus
                                         and q.plan.throughput >= p.plan.throughput * (1 - 1e-9)
                                         for q in out)]
        out.sort(key=lambda p: (-(p.plan.throughput - base), p.add[0]))  # equal gain: equal GPUs now
        return out[:self.top_k]

    def _upgrades(self, job: ElasticJob, free: Mapping[str, int], base: float, db: PlanDatabase) -> list[Proposal]:
        """Plans of the same size on faster GPUs: a job that started on a slow type moves up.

        Our extension of Role-2's "explore new configurations" (the paper's proposals are
        incremental only): without it a job that started on a T4 stays there for good. A
        heterogeneous job swaps ``d`` GPUs of its slowest type (an increment, or all of them:
        while one slow GPU holds an EST it can bound the step); a homogeneous one moves all
        of its GPUs to one faster type.
        """
        held = {t: n for t, n in job.allocation.items() if n > 0}
        slow = min(held, key=lambda t: (job.capability[t], t))
        whole = not (self.heterogeneous and job.heterogeneous)
        sizes = [held[slow]] if whole else sorted(
            {d for d in self.increments if d <= held[slow]} | {held[slow]})
        if whole and len(held) > 1:
            return []
        out = []
        for t in sorted(job.capability):
            if job.capability[t] <= job.capability[slow]:
                continue
            for d in sizes:
                if d > free.get(t, 0):
                    break
                counts = dict(held)
                counts[slow] -= d
                counts[t] = counts.get(t, 0) + d
                plan = db.estimate(counts)
                if plan.throughput > base * (1 + 1e-9) and plan.counts not in job.banned:
                    out.append(Proposal(job.job_id, (t, d), plan, plan.throughput / base, (slow, d)))
        return out

    def _returns(self, job: ElasticJob, free: Mapping[str, int], base: float, current: EstPlan,
                 db: PlanDatabase) -> list[Proposal]:
        """Plans the job has run and measured faster than its estimate of the plan it holds,
        reachable with its GPUs and the free ones (our extension, with ``_upgrades``): a job
        that grew from a fast plan into a slower one (GPUs reclaimed from it, then regrown on
        other types) goes back when the GPUs it needs are free again. Incremental and upgrade
        plans only ever add to the plan held, so none of them leads back."""
        held = current.count_of()
        mixes = self.heterogeneous and job.heterogeneous
        out = []
        for counts, rate in job.measured_plans.items():
            if counts == current.counts or counts in job.banned or (len(counts) > 1 and not mixes):
                continue
            delta = _delta(held, dict(counts))
            if any(n > free.get(t, 0) for t, n in delta.items()) or rate * job.max_p <= base * (1 + 1e-9):
                continue
            plan = db.estimate(dict(counts))  # measured: the rate above
            gain = max(delta, key=lambda t: (delta[t], t))
            loss = min(delta, key=lambda t: (delta[t], t))
            added = sum(n for n in delta.values() if n > 0)
            released = -sum(n for n in delta.values() if n < 0)
            out.append(Proposal(job.job_id, (gain, added), plan, plan.throughput / base,
                                (loss, released) if released else None))
        return out

    def fallback(self, job: ElasticJob) -> dict[str, int] | None:
        """Role-3: the previous GPUs if the last scale-out was measured slower, else ``None``."""
        if (job.previous is not None and job.measured is not None
                and job.measured_previous is not None and job.measured < job.measured_previous):
            return dict(job.previous)
        return None


@dataclass(frozen=True)
class GangJob:
    """A non-elastic job: ``gpus`` GPUs of one of ``types`` (in preference order), all or none."""

    job_id: str
    order: float
    gpus: int
    types: tuple[str, ...]
    allocation: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuGrant:
    """The new GPUs of a job whose allocation changes, by type (empty: all reclaimed)."""

    job_id: str
    gpus: dict[str, int]


class InterJobAllocator:
    """EasyScale's cluster scheduler: greedy acceptance by speedup per GPU.

    ``allocate(jobs, machines)`` returns a ``GpuGrant`` with the new allocation of every job
    whose GPUs change, in the order of ``jobs``; a job without a grant keeps its GPUs. The
    machines' free GPUs are pooled by type: the scheduler counts GPUs of each type, so one
    ``Machine`` per server or one per type (named as the caller likes) give the same grants.
    Steps:

    1. Non-elastic jobs (priority) in submission order: a queued one starts on the first of its
       types with enough GPUs free or reclaimable from elastic jobs (newest elastic jobs give up
       GPUs first, down to zero); it stops the line (FIFO) if none has.
    2. Queued elastic jobs in submission order get their best one-GPU start; with no GPU free,
       one is reclaimed from the elastic job holding >= 2 GPUs that loses the least estimated
       throughput (relative) by giving it up.
    3. While GPUs are free: all running elastic jobs propose (``IntraJobPlanner.propose``);
       the proposal with the highest speedup per GPU is accepted (ties: more GPUs, then
       the earlier job); one accepted proposal per job and round, rounds repeat until nothing fits.

    With ``preempt_after_s`` (our extension; None, the default, is the paper's FIFO) elastic jobs
    are ranked by the service they have had (``ElasticJob.attained_s``, least first, then
    submission) wherever the steps above say submission order, and in step 2 a queued job that
    finds no GPU free or reclaimable takes every GPU of the elastic job that has trained longest,
    if that job has trained ``preempt_after_s`` longer than it and at least that long: the
    preempted job goes back to the queue, where its attained service ranks it. This is
    Tiresias's least-attained-service discipline (NSDI'19), which needs no job durations: with
    FIFO, one-GPU jobs arriving at a full cluster wait behind jobs that run for days, although an
    EasyScale job is scaled to zero and back in seconds (the paper's non-elastic jobs already
    reclaim elastic ones down to zero, step 1).
    """

    name = "easyscale-inter"

    def __init__(self, planner: IntraJobPlanner, preempt_after_s: float | None = None) -> None:
        if preempt_after_s is not None and not preempt_after_s >= 0:
            raise ConfigError(f"preempt_after_s must not be negative, got {preempt_after_s:g}")
        self.planner = planner
        self.preempt_after_s = preempt_after_s

    def allocate(self, jobs: Sequence[ElasticJob | GangJob], machines: Sequence[Machine]) -> list[GpuGrant]:
        avail: dict[str, int] = {}
        for m in machines:
            avail[m.gpu_type] = avail.get(m.gpu_type, 0) + m.gpus
        alloc: dict[str, dict[str, int]] = {j.job_id: dict(_used(j.allocation)) for j in jobs}
        elastic = sorted((j for j in jobs if isinstance(j, ElasticJob)), key=lambda j: j.order)
        if self.preempt_after_s is not None:  # least attained service first: that rank is the order
            ranked_jobs = sorted(elastic, key=lambda j: (j.attained_s, j.order))
            elastic = [replace(j, order=k) for k, j in enumerate(ranked_jobs)]
        gangs = sorted((j for j in jobs if isinstance(j, GangJob)), key=lambda j: j.order)
        by_id = {j.job_id: j for j in elastic}
        # each job's estimates are corrected by the bias measured on the plan it holds now
        bias = {e.job_id: self.planner.bias(e) for e in elastic}

        # 1. non-elastic jobs first, FIFO, reclaiming from the newest elastic jobs
        for g in gangs:
            if alloc[g.job_id]:
                continue
            for t in g.types:
                held = sum(alloc[e.job_id].get(t, 0) for e in elastic)
                if avail.get(t, 0) + held < g.gpus:
                    continue
                for e in reversed(elastic):
                    need = g.gpus - avail.get(t, 0)
                    if need <= 0:
                        break
                    take = min(need, alloc[e.job_id].get(t, 0))
                    if take:
                        alloc[e.job_id][t] -= take
                        avail[t] = avail.get(t, 0) + take
                avail[t] -= g.gpus
                alloc[g.job_id] = {t: g.gpus}
                break
            else:
                break

        # 2. queued elastic jobs: one GPU each, FIFO
        for e in elastic:
            if _used(alloc[e.job_id]):
                continue
            types = self.planner._types(ElasticJob(e.job_id, e.order, e.max_p, e.capability,
                                                   heterogeneous=e.heterogeneous))
            ranked = sorted(types, key=lambda t: (-e.capability[t], t))
            start = next((t for t in ranked if avail.get(t, 0) > 0), None)
            if start is None:
                start = self._reclaim_one(elastic, alloc, ranked, avail)
            if start is None and self.preempt_after_s is not None:
                start = self._preempt(e, elastic, alloc, ranked, avail, self.preempt_after_s)
            if start is None:
                break  # nothing left to start anyone with; later jobs wait too (FIFO)
            avail[start] -= 1
            alloc[e.job_id] = {start: 1}

        # 3. proposals by speedup per GPU while GPUs are free
        while any(n > 0 for n in avail.values()):
            proposals: list[Proposal] = []
            for e in elastic:
                counts = _used(alloc[e.job_id])
                if not counts:
                    continue
                snap = ElasticJob(e.job_id, e.order, e.max_p, e.capability, counts,
                                  e.heterogeneous, banned=e.banned, measured_plans=e.measured_plans)
                proposals.extend(self.planner.propose(snap, avail, bias[e.job_id]))
            if not proposals:
                break
            proposals.sort(key=lambda p: (-p.speedup_per_gpu, -p.gpus, by_id[p.job_id].order))
            accepted: set[str] = set()
            for p in proposals:
                new = p.plan.count_of()
                delta = _delta(alloc[p.job_id], new)
                if p.job_id in accepted or any(n > avail.get(t, 0) for t, n in delta.items()):
                    continue
                # a proposal computed before another acceptance may no longer be the job's best
                for t, n in delta.items():
                    avail[t] = avail.get(t, 0) - n
                alloc[p.job_id] = _used(new)
                accepted.add(p.job_id)
            if not accepted:
                break

        changed: list[GpuGrant] = []
        for j in jobs:
            new = _used(alloc[j.job_id])
            if new != _used(j.allocation):
                changed.append(GpuGrant(j.job_id, new))
        return changed

    @staticmethod
    def _preempt(queued: ElasticJob, elastic: Sequence[ElasticJob], alloc: dict[str, dict[str, int]],
                 types: Sequence[str], avail: dict[str, int], after_s: float) -> str | None:
        """Free every GPU of the elastic job that has trained longest, at least ``after_s`` and
        ``after_s`` longer than ``queued``, holding a GPU of one of ``types``; the first of
        ``types`` then free, or None when no job may be preempted."""
        floor = max(after_s, queued.attained_s + after_s)
        victims = [e for e in elastic if e.attained_s >= floor and any(alloc[e.job_id].get(t, 0) for t in types)]
        if not victims:
            return None
        victim = max(victims, key=lambda e: (e.attained_s, e.order))
        for t, n in _used(alloc[victim.job_id]).items():
            avail[t] = avail.get(t, 0) + n
        alloc[victim.job_id] = {}
        return next(t for t in types if avail.get(t, 0) > 0)

    def _reclaim_one(self, elastic: Sequence[ElasticJob], alloc: dict[str, dict[str, int]],
                     types: Sequence[str], avail: dict[str, int]) -> str | None:
        """Take one GPU of one of ``types`` from the elastic job that loses least (relative)."""
        best: tuple[float, float, str, str] | None = None
        for e in elastic:
            counts = _used(alloc[e.job_id])
            if sum(counts.values()) < 2:
                continue
            before = map_ests(e.max_p, counts, e.capability).throughput
            for t in types:
                if counts.get(t, 0) < 1:
                    continue
                after_counts = dict(counts)
                after_counts[t] -= 1
                after = map_ests(e.max_p, _used(after_counts), e.capability).throughput
                loss = (before - after) / before
                key = (loss, -e.order, e.job_id, t)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        _, _, victim, t = best
        alloc[victim][t] -= 1
        avail[t] = avail.get(t, 0) + 1
        return t
