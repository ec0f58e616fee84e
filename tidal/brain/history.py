"""History of finished jobs: what DLRover-RM's warm start learns from (DLRover-RM 4.3, stage 1).

A ``JobRecord`` keeps a finished job's metadata (the features similarity is computed on: model
kind, user, dataset, sizes) and the configuration it ended with, plus its fitted
resource-performance coefficients. ``HistoryStore`` is the interface; ``InMemoryHistory`` is the
implementation the brain and tests use; the SQLite one lives outside the brain
(``tidal.history``) because the brain does no I/O. Both pass the same
contract suite (``tests/brain/test_history.py``).

Similarity (Algorithm 1, line 2: "calculates the similarity in each type of feature"): per
feature, 1 for equal categorical values and ``1 - |a - b| / max(|a|, |b|)`` for numbers (0 for a
feature only one side has); the job's similarity is the mean over the new job's features.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["HistoryStore", "InMemoryHistory", "JobRecord", "similarity", "top_k"]

Feature = str | float


@dataclass(frozen=True)
class JobRecord:
    """One finished job.

    Attributes:
        job_id: unique id (adding the same id again replaces the record).
        finished_s: when it finished (the caller's clock; ties in similarity go to the newer).
        features: metadata the warm start compares (strings compare for equality).
        config: the final configuration, by resource name (``workers``, ``ps``, ``worker_cpu``...).
        params: fitted coefficients of the job's resource-performance model (may be empty).
    """

    job_id: str
    finished_s: float
    features: Mapping[str, Feature]
    config: Mapping[str, float]
    params: Mapping[str, float] = field(default_factory=dict)


class HistoryStore(Protocol):
    """Finished jobs, queried by similarity."""

    def add(self, record: JobRecord) -> None:
        """Store (or replace, by ``job_id``) a record."""
        ...

    def records(self) -> list[JobRecord]:
        """All records, oldest ``finished_s`` first."""
        ...

    def __len__(self) -> int: ...


def similarity(a: Mapping[str, Feature], b: Mapping[str, Feature]) -> float:
    """Mean per-feature similarity of ``b`` to ``a`` over ``a``'s features, in [0, 1]."""
    if not a:
        return 0.0
    total = 0.0
    for key, va in a.items():
        if key not in b:
            continue
        vb = b[key]
        if isinstance(va, str) or isinstance(vb, str):
            total += 1.0 if va == vb else 0.0
        else:
            fa, fb = float(va), float(vb)
            scale = max(abs(fa), abs(fb))
            total += 1.0 if scale == 0 else max(0.0, 1.0 - abs(fa - fb) / scale)
    return total / len(a)


def top_k(store: HistoryStore, features: Mapping[str, Feature], k: int,
          min_similarity: float = 0.0) -> list[tuple[float, JobRecord]]:
    """The ``k`` records most similar to ``features``, most similar first (newer wins ties)."""
    scored = [(similarity(features, r.features), r) for r in store.records()]
    scored = [(s, r) for s, r in scored if s >= min_similarity]
    scored.sort(key=lambda sr: (sr[0], sr[1].finished_s), reverse=True)
    return scored[:k]


class InMemoryHistory:
    """A ``HistoryStore`` in a dict (the brain's default; the simulator's too)."""

    def __init__(self, records: Sequence[JobRecord] = ()) -> None:
        self._records: dict[str, JobRecord] = {}
        for r in records:
            self.add(r)

    def add(self, record: JobRecord) -> None:
        self._records.pop(record.job_id, None)
        self._records[record.job_id] = record

    def records(self) -> list[JobRecord]:
        return sorted(self._records.values(), key=lambda r: r.finished_s)

    def __len__(self) -> int:
        return len(self._records)
