"""The exactly-once audit of a ledger: every epoch covers ``[0, N)`` once, no gap, no overlap."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class EpochAudit:
    epoch: int
    ranges: int
    samples: int
    gaps: list[tuple[int, int]] = field(default_factory=list)
    overlaps: list[tuple[int, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.gaps and not self.overlaps


@dataclass
class LedgerAudit:
    dataset_size: int
    epochs: list[EpochAudit]

    @property
    def ok(self) -> bool:
        return bool(self.epochs) and all(e.ok for e in self.epochs)

    def summary(self) -> str:
        if not self.epochs:
            return "FAILED: the ledger is empty"
        parts = []
        for e in self.epochs:
            if e.ok:
                parts.append(f"epoch {e.epoch}: [0, {self.dataset_size}) exactly once in {e.ranges} ranges")
            else:
                parts.append(f"epoch {e.epoch}: {len(e.gaps)} gaps {e.gaps[:3]}, {len(e.overlaps)} overlaps {e.overlaps[:3]}")
        return ("PASSED: " if self.ok else "FAILED: ") + "; ".join(parts)


def audit_ledger(lines: Iterable[str], dataset_size: int, epochs: int | None = None) -> LedgerAudit:
    """Check ``{"epoch", "start", "end", ...}`` lines; ``epochs`` also demands that many epochs."""
    rows = (json.loads(line) for line in lines if line.strip())
    return audit_ranges(((int(r["epoch"]), int(r["start"]), int(r["end"])) for r in rows), dataset_size, epochs)


def audit_ranges(ranges: Iterable[tuple[int, int, int]], dataset_size: int, epochs: int | None = None) -> LedgerAudit:
    """The same audit over ``(epoch, start, end)`` triples (the master's journal)."""
    by_epoch: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for epoch, start, end in ranges:
        by_epoch[epoch].append((start, end))
    wanted = range(epochs) if epochs is not None else sorted(by_epoch)
    out = []
    for epoch in wanted:
        spans = sorted(by_epoch.get(epoch, []))
        result = EpochAudit(epoch, len(spans), sum(e - s for s, e in spans))
        pos = 0
        for start, end in spans:
            if start > pos:
                result.gaps.append((pos, start))
            elif start < pos:
                result.overlaps.append((start, min(pos, end)))
            pos = max(pos, end)
        if pos < dataset_size:
            result.gaps.append((pos, dataset_size))
        out.append(result)
    return LedgerAudit(dataset_size, out)
