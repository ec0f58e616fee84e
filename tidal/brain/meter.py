"""Throughput per worker count, measured the same way by the job master and the job simulator.

``ThroughputMeter.measure(now, workers, committed, ready)`` is called once per decision interval
with the samples committed so far. An interval counts for ``workers`` when the job ran with that
many throughout (``ready``: nothing starting or re-forming) and it is not the first interval
after a change (that one holds the re-form's pause and the first steps after it). The points it
keeps are what a ``JobObservation`` carries in ``throughput``. Pure: time comes as ``now``.
"""

from __future__ import annotations

from tidal.api import ThroughputPoint

__all__ = ["ThroughputMeter"]


class ThroughputMeter:
    def __init__(self) -> None:
        # workers -> [samples, seconds] measured at that count
        self.points: dict[int, list[float]] = {}
        self._mark: tuple[int, float, float] | None = None  # (workers, time, committed) of the open interval
        self._skip = True  # the first interval after a change is not measured

    def measure(self, now: float, workers: int, committed: float, ready: bool) -> None:
        """Close the interval since the previous call (see the module's docstring)."""
        key = workers if ready and workers > 0 else 0
        mark = self._mark
        if mark is not None and mark[0] == key and key and now > mark[1] and committed >= mark[2]:
            if self._skip:
                self._skip = False
            else:
                acc = self.points.setdefault(key, [0.0, 0.0])
                acc[0] += committed - mark[2]
                acc[1] += now - mark[1]
        elif mark is None or mark[0] != key:
            self._skip = True
        self._mark = (key, now, committed)

    def throughput(self) -> list[ThroughputPoint]:
        """One point per count measured, fewest workers first."""
        return [ThroughputPoint(workers=w, samples_per_s=s / t, seconds=round(t, 3))
                for w, (s, t) in sorted(self.points.items()) if t > 0]
