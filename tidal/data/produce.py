"""Write records into a stream at a traffic trace's rate (``tidal produce``).

The trace gives arrivals per interval (WorldCup98 requests per minute, say); ``speedup`` compresses
time (an interval of I seconds lasts I / speedup seconds), ``peak`` rescales the counts so that the
busiest interval arrives at that many records per second. Within an interval arrivals are spread
evenly: every ``tick_s`` the producer appends the records due by then, so the stream's arrival
rate follows the trace at that resolution.

Partitions are uneven when asked (Kale 2.3: a topic's partitions differ in traffic): partition
``p`` receives the share ``(p + 1) ** -skew`` of all records, normalised (0: even; 2 puts 70% on
the first of 4). Records go to the partition furthest behind its share, so the split is exact
at every tick, not just on average.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tidal.api import ConfigError
from tidal.data.api import StreamSource

MakeRecords = Callable[[int, int], list[dict[str, bytes]]]  # (first sample index, count) -> records


def partition_shares(partitions: int, skew: float) -> np.ndarray:
    if partitions < 1:
        raise ConfigError("a stream needs at least one partition")
    if not math.isfinite(skew) or skew < 0:
        raise ConfigError(f"skew must be a finite number >= 0, got {skew}")
    weights = np.arange(1, partitions + 1, dtype=np.float64) ** -skew
    return weights / weights.sum()


def arrival_rates(counts: np.ndarray, interval_s: float, speedup: float, peak: float | None) -> np.ndarray:
    """Records per real second in each trace interval."""
    if not math.isfinite(speedup) or speedup <= 0:
        raise ConfigError(f"speedup must be a positive number, got {speedup}")
    rates = counts / (interval_s / speedup)
    if peak is not None:
        if not math.isfinite(peak) or peak <= 0:
            raise ConfigError(f"peak must be a positive rate, got {peak}")
        top = float(rates.max())
        if top <= 0:
            raise ConfigError("the trace has no arrivals to scale to a peak")
        rates = rates * (peak / top)
    return rates


@dataclass
class Produced:
    records: int = 0
    per_partition: list[int] = field(default_factory=list)
    first_ids: list[str | None] = field(default_factory=list)
    last_ids: list[str | None] = field(default_factory=list)
    seconds: float = 0.0
    next_index: int = 0


def produce(source: StreamSource, rates: np.ndarray, interval_real_s: float, shares: np.ndarray,
            make_records: MakeRecords, *, limit: int | None = None, first_index: int = 0, tick_s: float = 0.05,
            batch: int = 1000, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep,
            progress: Callable[[Produced, float], None] | None = None, progress_every_s: float = 2.0) -> Produced:
    """Append records at ``rates`` (per real second, one per interval of ``interval_real_s``)
    until the trace ends or ``limit`` records are written. ``progress(done, t)`` is called about
    every ``progress_every_s`` seconds."""
    partitions = len(shares)
    done = Produced(per_partition=[0] * partitions, first_ids=[None] * partitions, last_ids=[None] * partitions,
                    next_index=first_index)
    # cumulative arrivals at every interval boundary: due(t) is piecewise linear between them
    bounds = np.concatenate([[0.0], np.cumsum(rates * interval_real_s)])
    duration = len(rates) * interval_real_s
    total = math.floor(bounds[-1]) if limit is None else min(limit, math.floor(bounds[-1]))
    start = clock()
    next_progress = start + progress_every_s
    while done.records < total:
        now = clock() - start
        k = min(int(now / interval_real_s), len(rates) - 1) if interval_real_s > 0 else len(rates) - 1
        due = bounds[k] + rates[k] * (now - k * interval_real_s) if now < duration else bounds[-1]
        want = min(total, math.floor(due)) - done.records
        while want > 0:
            n = min(want, batch)
            _append(source, done, shares, make_records, n)
            want -= n
        if progress is not None and clock() >= next_progress:
            progress(done, clock() - start)
            next_progress += progress_every_s
        if done.records >= total:
            break
        sleep(tick_s)
    done.seconds = clock() - start
    return done


def _append(source: StreamSource, done: Produced, shares: np.ndarray, make_records: MakeRecords, n: int) -> None:
    """``n`` records split over the partitions furthest behind their shares."""
    counts = np.array(done.per_partition, dtype=np.float64)
    target = (done.records + n) * shares
    take = np.zeros(len(shares), dtype=np.int64)
    for _ in range(n):  # n is at most ``batch``: a few thousand comparisons
        p = int(np.argmax(target - counts - take))
        take[p] += 1
    for p, k in enumerate(take.tolist()):
        if not k:
            continue
        ids = source.append(p, make_records(done.next_index, k))
        done.next_index += k
        done.per_partition[p] += k
        done.records += k
        if done.first_ids[p] is None:
            done.first_ids[p] = ids[0]
        done.last_ids[p] = ids[-1]
