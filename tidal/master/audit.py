"""The exactly-once audit of a ledger: every epoch covers ``[0, N)`` once, no gap, no overlap.

A ledger is read in order. A line ``{"rollback_to_step": s}`` (written when a job resumes from a
checkpoint of step ``s``) voids every earlier line of a step above ``s``: those samples were
trained by steps the model no longer has, and are trained again after it. Read that way, the
ledger is the model's lineage, and each sample of each epoch must appear in it exactly once.
"""

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
    """Check ``{"epoch", "start", "end", "step", ...}`` lines, rollbacks applied (``lineage``);
    ``epochs`` also demands that many epochs.

    Raises:
        ValueError: a line that is not JSON, or not a range or a rollback.
    """
    return audit_ranges(((r[0], r[1], r[2]) for r in lineage(lines)), dataset_size, epochs)


def lineage(lines: Iterable[str]) -> list[tuple[int, int, int, int]]:
    """``(epoch, start, end, step)`` of every range still in the model's lineage: each
    ``{"rollback_to_step": s}`` line drops the ranges before it of steps above ``s``."""
    kept: list[tuple[int, int, int, int]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "rollback_to_step" in row:
                to = int(row["rollback_to_step"])
                kept = [r for r in kept if r[3] <= to]
                continue
            kept.append((int(row["epoch"]), int(row["start"]), int(row["end"]), int(row.get("step", -1))))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"ledger line {number} is not a range or a rollback: {line.strip()[:120]!r}") from exc
    return kept


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
