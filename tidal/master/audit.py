"""The exactly-once audit of a ledger: every epoch covers ``[0, N)`` once, no gap, no overlap.

A ledger is read in order. A line ``{"rollback_to_step": s}`` (written when a job resumes from a
checkpoint of step ``s``) voids every earlier line of a step above ``s``: those samples were
trained by steps the model no longer has, and are trained again after it. Read that way, the
ledger is the model's lineage, and each sample of each epoch must appear in it exactly once.

A stream job's ledger (``audit_stream``) has one line per committed step, worker and partition,
``{"step": s, "worker": w, "partition": p, "ids": [[first, last], ...]}``, each pair an inclusive
range of the partition's record ids (``"<ms>-<seq>"``, ordered as integer pairs); the same
rollback lines apply. Its lineage must cover each record of a partition exactly once, from the
partition's first record up to its highest committed id.
"""

from __future__ import annotations

import itertools
import json
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tidal.api import ConfigError
from tidal.api.streams import parse_id

T = TypeVar("T")
_Range = tuple[tuple[int, int], tuple[int, int], str, str]  # a stream ledger range: its ends as keys and as ids


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

    def parse(row: Any) -> tuple[int, tuple[int, int, int, int]]:
        step = int(row.get("step", -1))
        return step, (int(row["epoch"]), int(row["start"]), int(row["end"]), step)

    return _kept(lines, parse, "a range")


def _kept(lines: Iterable[str], parse: Callable[[Any], tuple[int, T]], what: str) -> list[T]:
    """What ``parse`` makes of every line still in the lineage, rollbacks applied; ``parse`` gives a
    line's step and its item, and raises ValueError, KeyError or TypeError for a line it refuses.

    Raises:
        ValueError: a line that is not JSON, or neither a rollback nor ``what``.
    """
    kept: list[tuple[int, T]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "rollback_to_step" in row:
                to = int(row["rollback_to_step"])
                kept = [k for k in kept if k[0] <= to]
                continue
            kept.append(parse(row))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"ledger line {number} is not {what} or a rollback: {line.strip()[:120]!r}") from exc
    return [item for _, item in kept]


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


@dataclass
class PartitionAudit:
    """One partition's records up to its highest committed id (``last``; None: nothing committed)
    against the ranges of the ledger. ``gaps`` and ``overlaps`` are ``(first id, last id, records)``
    runs of records covered by no range or by more than one; ``empty`` the ranges that cover no
    record; ``unknown`` the range ends that are no record's id."""

    partition: int
    ranges: int
    records: int  # in the span: the records from the first up to ``last``
    later: int  # records after ``last``: not committed yet, not audited
    last: str | None = None
    gaps: list[tuple[str, str, int]] = field(default_factory=list)
    overlaps: list[tuple[str, str, int]] = field(default_factory=list)
    empty: list[tuple[str, str]] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.gaps or self.overlaps or self.empty or self.unknown)

    def summary(self) -> str:
        if self.last is None:
            return f"partition {self.partition}: nothing committed ({self.later} records)"
        if self.ok:
            return (f"partition {self.partition}: {self.records} records up to {self.last} exactly once in "
                    f"{self.ranges} ranges" + (f" ({self.later} later ones not committed)" if self.later else ""))

        def few(shown: list[str]) -> str:
            return "[" + ", ".join(shown[:3]) + (", ...]" if len(shown) > 3 else "]")

        def runs(kind: str, items: list[tuple[str, str, int]]) -> str:
            return f"{len(items)} {kind} ({sum(n for *_, n in items)} records) " + few([f"{a}..{b}" for a, b, _ in items])

        parts = [runs(kind, items) for kind, items in (("gaps", self.gaps), ("overlaps", self.overlaps)) if items]
        if self.empty:
            parts.append(f"{len(self.empty)} ranges of no record " + few([f"{a}..{b}" for a, b in self.empty]))
        if self.unknown:
            parts.append(f"{len(self.unknown)} ids not in the stream " + few(self.unknown))
        return f"partition {self.partition} (up to {self.last}): " + ", ".join(parts)


@dataclass
class StreamAudit:
    partitions: list[PartitionAudit]

    @property
    def ok(self) -> bool:
        committed = [p for p in self.partitions if p.last is not None]
        return bool(committed) and all(p.ok for p in committed)

    def summary(self) -> str:
        if all(p.last is None for p in self.partitions):
            return "FAILED: the ledger is empty"
        return ("PASSED: " if self.ok else "FAILED: ") + "; ".join(p.summary() for p in self.partitions)


def _parse_id(record_id: Any) -> tuple[int, int]:
    """``tidal.api.streams.parse_id`` with the ValueError a ledger line's parser raises."""
    try:
        return parse_id(record_id)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def _stream_commit(row: Any) -> tuple[int, tuple[int, list[_Range]]]:
    """A stream ledger line: its step, and ``(partition, [(first key, last key, first, last), ...])``."""
    partition = int(row["partition"])
    pairs = row["ids"]
    if partition < 0 or not isinstance(pairs, list):
        raise ValueError("not a partition and its ids")
    ranges = []
    for pair in pairs:
        first, last = pair
        lo, hi = _parse_id(first), _parse_id(last)
        if lo > hi:
            raise ValueError(f"range {first}..{last} ends before it starts")
        ranges.append((lo, hi, first, last))
    return int(row["step"]), (partition, ranges)


def audit_stream(lines: Iterable[str], records: Mapping[int, Sequence[str]]) -> StreamAudit:
    """Check a stream job's ledger lines, rollbacks applied, against ``records``: each partition's
    record ids in id order, as read from the stream. A stream trimmed since (``--trim-after-commit``)
    no longer holds what the ledger names, and fails.

    Raises:
        ValueError: a line that is not JSON, or neither a stream commit nor a rollback; or records
            that are not ids in increasing order.
    """
    by_partition: dict[int, list[_Range]] = defaultdict(list)
    for partition, ranges in _kept(lines, _stream_commit, "a stream commit"):
        by_partition[partition].extend(ranges)
    return StreamAudit([_audit_partition(p, by_partition.get(p, []), records.get(p, ()))
                        for p in sorted(set(by_partition) | set(records))])


def _audit_partition(partition: int, ranges: list[_Range], ids: Sequence[str]) -> PartitionAudit:
    """Sorts the ranges by their first id and sweeps the records once (a bisection per range)."""
    try:  # ids the stream gave: no need of _parse_id's checks, a third of the time for 10^6 of them
        keys = [(int(ms), int(seq)) for ms, _, seq in (i.partition("-") for i in ids)]
    except ValueError as exc:
        raise ValueError(f"partition {partition}'s records are not stream record ids") from exc
    if any(a >= b for a, b in itertools.pairwise(keys)):
        raise ValueError(f"partition {partition}'s records are not in increasing id order")
    spans = sorted(ranges)
    if not spans:
        return PartitionAudit(partition, 0, 0, len(keys))
    _, top, _, highest = max(spans, key=lambda s: s[1])
    result = PartitionAudit(partition, len(spans), 0, 0, highest)
    covered = 0  # records [0, covered) lie in some range already swept
    twice: list[list[int]] = []  # [start, end) runs of records covered more than once
    for lo, hi, first, last in spans:
        i, j = bisect_left(keys, lo), bisect_right(keys, hi)
        if i == j:
            result.empty.append((first, last))
            continue
        result.unknown.extend(end for end, key, at in ((first, lo, i), (last, hi, j - 1)) if keys[at] != key)
        if i > covered:
            result.gaps.append((ids[covered], ids[i - 1], i - covered))
        elif i < covered:  # records [i, min(j, covered)) are in an earlier range too
            if twice and i <= twice[-1][1]:  # i never decreases: runs merge into maximal ones
                twice[-1][1] = max(twice[-1][1], min(j, covered))
            else:
                twice.append([i, min(j, covered)])
        covered = max(covered, j)
    end = bisect_right(keys, top)  # the span: the first record up to the highest committed id
    if end > covered:  # only ranges of no record reached that far
        result.gaps.append((ids[covered], ids[end - 1], end - covered))
    result.overlaps = [(ids[a], ids[b - 1], b - a) for a, b in twice]
    result.records, result.later = end, len(keys) - end
    return result
