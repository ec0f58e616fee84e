"""Which step every member of a round has applied, and the minimum of them, in O(log n).

The master finalizes a step when every live member has reported applying it. With thousands
of workers reporting every second, recomputing ``min`` over all of them per report is
quadratic; a heap with lazy deletion keeps each report logarithmic.
"""

from __future__ import annotations

import heapq


class MemberProgress:
    def __init__(self, members: list[int] | None = None) -> None:
        self._steps: dict[int, int | None] = {m: None for m in members or []}
        self._missing = len(self._steps)  # members that have not reported yet
        self._heap: list[tuple[int, int]] = []

    def update(self, worker: int, step: int) -> None:
        if worker not in self._steps:
            return
        old = self._steps[worker]
        if old is None:
            self._missing -= 1
        if old is None or step > old:
            self._steps[worker] = step
            heapq.heappush(self._heap, (step, worker))

    def remove(self, worker: int) -> None:
        if worker in self._steps and self._steps.pop(worker) is None:
            self._missing -= 1

    def minimum(self) -> int | None:
        """The step every member has applied; None while someone has not reported."""
        if self._missing or not self._steps:
            return None
        heap = self._heap
        while heap and self._steps.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # an older report of a worker, or a worker that left
        return heap[0][0] if heap else None
