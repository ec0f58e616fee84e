"""What every cluster scenario returns, and the Philly trace reader they share."""

from __future__ import annotations

import csv
import math
import random
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
    # for --plot: (time_s, gpu_util, cpu_util) samples and per-job JCTs
    timeline: list[tuple[float, float, float]] = field(default_factory=list, repr=False)
    jcts: list[float] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out.pop("timeline")
        out.pop("jcts")
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
