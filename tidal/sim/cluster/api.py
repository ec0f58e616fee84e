"""What every cluster scenario returns, and the Philly trace reader they share."""

from __future__ import annotations

import csv
import heapq
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from tidal.api import ConfigError


@dataclass
class PolicyMetrics:
    """The metrics of one policy over one scenario run (``--json`` writes these fields)."""

    avg_jct_s: float
    median_jct_s: float
    makespan_s: float
    avg_queue_s: float
    gpu_util: float  # time-average fraction of GPUs busy, 0..1 (0 for CPU-only clusters)
    cpu_util: float  # time-average fraction of CPUs busy, 0..1
    completion_rate: float  # jobs that did not fail, 0..1
    scaling_actions: int = 0
    extra: dict[str, float] = field(default_factory=dict)  # scenario-specific numbers
    #: mean over every job of its duration at the ideal speed: no policy that completes every
    #: job has a lower average JCT (a bound on any policy's average-JCT gain over another)
    avg_ideal_s: float = math.nan
    #: the cluster's capacity too (``srpt_mean_flow_s``): no policy has a lower average JCT than the
    #: larger of this and ``avg_ideal_s`` (None where a scenario does not compute it)
    avg_capacity_s: float | None = None
    # for --plot: (time_s, gpu_util, cpu_util) samples and per-job JCTs
    timeline: list[tuple[float, float, float]] = field(default_factory=list, repr=False)
    jcts: list[float] = field(default_factory=list, repr=False)
    # for --jobs-out: one dict per job (scenarios that record them), to see where the time goes
    jobs: list[dict[str, object]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        for bulky in ("timeline", "jcts", "jobs"):
            out.pop(bulky)
        return out


@dataclass
class ScenarioResult:
    scenario: str
    policies: dict[str, PolicyMetrics]
    notes: list[str] = field(default_factory=list)  # where each number came from


@dataclass(frozen=True)
class PhillyJob:
    submit_s: float  # seconds after the window's start
    duration_s: float  # as run on Philly with num_gpus GPUs
    num_gpus: int


def load_philly(path: Path, jobs: int, seed: int, max_gpus: int | None = None,
                min_duration_s: float = 60.0) -> list[PhillyJob]:
    """A window of ``jobs`` consecutive submissions (sorted by time) starting at a seeded offset.

    EasyScale and GoldMiner sample a window of the trace; jobs shorter than ``min_duration_s``
    (failed at start) and, if given, larger than ``max_gpus`` are skipped.
    """
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    parsed: list[tuple[float, float, int]] = []
    for row in rows:
        try:
            t = datetime.fromisoformat(row["timestamp"]).timestamp()
            d, g = float(row["duration"]), int(float(row["num_gpus"]))
        except (KeyError, ValueError):
            continue
        if d >= min_duration_s and g >= 1 and (max_gpus is None or g <= max_gpus) and math.isfinite(d):
            parsed.append((t, d, g))
    if len(parsed) < jobs:
        raise ConfigError(f"{path} has only {len(parsed)} usable jobs, {jobs} asked")
    parsed.sort()
    start = random.Random(seed).randrange(0, len(parsed) - jobs + 1)
    window = parsed[start:start + jobs]
    t0 = window[0][0]
    return [PhillyJob(t - t0, d, g) for t, d, g in window]


def check_load(load: float) -> float:
    """``load`` if it is a usable offered load (positive, finite).

    Raises:
        ConfigError: it is not.
    """
    if not (load > 0 and math.isfinite(load)):
        raise ConfigError(f"load must be a positive number, got {load}")
    return load


def offered_load(jobs: list[PhillyJob], capacity_gpus: int) -> float:
    """GPU-seconds the jobs ran on Philly over what ``capacity_gpus`` supply during their arrivals."""
    span = max((j.submit_s for j in jobs), default=0.0)
    work = sum(j.duration_s * j.num_gpus for j in jobs)
    return work / (capacity_gpus * span) if span > 0 else math.inf


def at_load(jobs: list[PhillyJob], load: float, capacity_gpus: int) -> list[PhillyJob]:
    """The same jobs with their arrival times stretched so they offer ``load`` x the capacity.

    Philly served ~2,500 GPUs; any window of its arrivals asks a 64-GPU cluster for several times
    its capacity (5-15x for 500 jobs). The papers' experiments ran trace samples their clusters
    could serve (GoldMiner section 5.6: the hardware-ratio baseline has "near-zero queuing").
    Stretching time keeps the order, the gaps' relative sizes (bursts stay bursts), the sizes
    and the durations of the jobs; only the arrival rate changes.

    Raises:
        ConfigError: ``load`` not positive, or all jobs arrive at once (no span to stretch).
    """
    check_load(load)
    now = offered_load(jobs, capacity_gpus)
    if not math.isfinite(now):
        raise ConfigError("the window's jobs all arrive at once; its load cannot be set")
    factor = now / load
    return [PhillyJob(j.submit_s * factor, j.duration_s, j.num_gpus) for j in jobs]


# --- shared by the easyscale and goldminer scenarios: outcomes -> PolicyMetrics ---------------


@dataclass(frozen=True)
class JobOutcome:
    """One job of a run: ``start_s`` when it first got resources, ``end_s`` when it finished.

    ``end_s is None`` counts as failed (never finished); ``ideal_s`` is its duration at the
    ideal speed, a lower bound of its JCT.
    """

    submit_s: float
    start_s: float | None
    end_s: float | None
    ideal_s: float


def srpt_mean_flow_s(jobs: list[tuple[float, float]], speed: float) -> float:
    """The mean flow time of shortest-remaining-work-first on one machine doing ``speed`` units of
    work a second, for ``jobs`` of ``(submit_s, work)``: a lower bound of the average JCT of any
    schedule on a cluster whose GPUs do at most ``speed`` units a second together, when each job
    needs at least ``work`` of them whatever its placement. Spreading the cluster's work over jobs
    as any schedule does (several at once, each at its own rate) is a schedule of that one machine
    shared fractionally, and SRPT completes at least as many jobs by every time as any such
    schedule (the classic exchange argument), so its total flow time is the least. It ignores
    how fast a job can go (``avg_ideal_s`` has that) and charges the queue a full cluster makes."""
    if not jobs:
        return math.nan
    if not speed > 0:
        raise ValueError(f"speed must be positive, got {speed}")
    order = sorted(jobs)
    now, k, flow = 0.0, 0, 0.0
    queue: list[tuple[float, int, float]] = []  # (remaining work, index, submit)
    while k < len(order) or queue:
        if not queue:
            now = max(now, order[k][0])
        while k < len(order) and order[k][0] <= now:
            heapq.heappush(queue, (order[k][1], k, order[k][0]))
            k += 1
        left, i, submit = heapq.heappop(queue)
        arrival = order[k][0] if k < len(order) else math.inf
        done = now + left / speed
        if done <= arrival:
            now = done
            flow += done - submit
        else:  # preempted (or not) at the next arrival: the shortest remaining goes on
            heapq.heappush(queue, (left - (arrival - now) * speed, i, submit))
            now = arrival
    return flow / len(jobs)


def policy_metrics(outcomes: list[JobOutcome], usage: list[tuple[float, float, float]],
                   scaling_actions: int = 0, extra: dict[str, float] | None = None,
                   max_points: int = 2000) -> PolicyMetrics:
    """Aggregate a run: JCTs, makespan, queuing, time-average utilization and a bounded timeline.

    Args:
        outcomes: every job of the run.
        usage: ``(time_s, gpu_util, cpu_util)`` each time the usage changed (a step function,
            sorted by time); averaged over ``[first submit, last finish]``.
        max_points: the timeline is resampled evenly to at most this many points.
    """
    done = [o for o in outcomes if o.end_s is not None]
    jcts = [o.end_s - o.submit_s for o in done if o.end_s is not None]
    t0 = min((o.submit_s for o in outcomes), default=0.0)
    t1 = max((o.end_s for o in done if o.end_s is not None), default=t0)
    queues = [(o.start_s if o.start_s is not None else t1) - o.submit_s for o in outcomes]
    gpu_area = cpu_area = 0.0
    for (ta, ga, ca), (tb, _, _) in zip(usage, [*usage[1:], (t1, 0.0, 0.0)], strict=True):
        lo, hi = max(ta, t0), min(tb, t1)
        if hi > lo:
            gpu_area += ga * (hi - lo)
            cpu_area += ca * (hi - lo)
    span = max(t1 - t0, 1e-9)
    timeline: list[tuple[float, float, float]] = []
    if usage:
        step = max(span / max_points, 1.0)
        i, t = 0, t0
        while t <= t1 + 1e-9 and len(timeline) < max_points + 1:
            while i + 1 < len(usage) and usage[i + 1][0] <= t:
                i += 1
            timeline.append((t, usage[i][1], usage[i][2]))
            t += step
    ordered = sorted(jcts)
    n = len(ordered)
    median = 0.0 if n == 0 else (ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2)
    return PolicyMetrics(
        avg_jct_s=sum(jcts) / n if n else math.inf,
        median_jct_s=median,
        makespan_s=t1 - t0,
        avg_queue_s=sum(queues) / len(queues) if queues else 0.0,
        gpu_util=gpu_area / span,
        cpu_util=cpu_area / span,
        completion_rate=n / len(outcomes) if outcomes else 1.0,
        scaling_actions=scaling_actions,
        extra=dict(extra or {}),
        avg_ideal_s=sum(o.ideal_s for o in outcomes) / len(outcomes) if outcomes else math.nan,
        timeline=timeline,
        jcts=jcts,
    )


def run_policies(scenario: str, known: list[str], policies: list[str], notes: str,
                 simulate: Callable[[str], PolicyMetrics]) -> ScenarioResult:
    """Run ``simulate(policy)`` for each policy (each on its own fresh copy of the jobs).

    Raises:
        ConfigError: an unknown policy.
    """
    unknown = [p for p in policies if p not in known]
    if unknown:
        raise ConfigError(f"unknown {scenario} policies {unknown}; known: {', '.join(known)}")
    result = ScenarioResult(scenario, {}, notes=[notes])
    for policy in policies:
        result.policies[policy] = simulate(policy)
    return result
