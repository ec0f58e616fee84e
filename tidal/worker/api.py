"""Errors of the worker runtime and the dataset protocol the elastic loader reads."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from tidal.api import PermanentError, RetryableError, TidalError


class WorkerError(TidalError):
    """Base of the worker runtime's errors."""


class CollectiveError(WorkerError, RetryableError):
    """A collective failed (a peer died or left): the worker re-forms through the master."""


class MasterUnreachableError(WorkerError, PermanentError):
    """The master did not answer within the worker's patience (``TIDAL_MASTER_TIMEOUT``)."""


class WorkerGoneError(WorkerError, PermanentError):
    """The master declared this worker failed or finished; the process must exit."""


class FinishRefusedError(WorkerError, PermanentError):
    """The master refused ``finish``: by its ledger, samples of the job were never trained."""


class UsageError(WorkerError, PermanentError):
    """The training script used the API out of order (e.g. iterated before creating the state)."""


@runtime_checkable
class RangeDataset(Protocol):
    """A dataset that builds a whole batch from a contiguous index range (fast path)."""

    def __len__(self) -> int: ...

    def get_range(self, start: int, end: int) -> Any: ...
