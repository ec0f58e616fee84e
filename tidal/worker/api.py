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


class StepHook(Protocol):
    """Something beside the model that a step must update in step with it: the parameter
    servers' embedding tables (tidal.ps.embedding) register one with ``job.add_step_hook``.

    ``before_reduce`` runs once per contribution (a worker's batch, or a logical worker's), after
    its backward pass and before the step's reduction; an exception from it ends the script
    (a parameter server that refuses or does not answer). ``after_apply`` runs once the step is
    applied, before it is committed: what it writes into ``state.extras`` is committed with the
    step, restored on a re-form and sent to new workers. A checkpoint holds ``checkpoint_tree()``
    under ``hooks/{name}``. A hook whose ``before_reduce`` raises ``RetryableError`` (its
    parameter server is lost) breaks the step: it is dropped and the round re-forms."""

    name: str

    def before_reduce(self, step: int, key: int, samples: int) -> None: ...

    def after_apply(self, step: int, total: int) -> None: ...

    def checkpoint_tree(self) -> dict[str, Any]:
        """What a checkpoint holds of it beside the model (tensors in a canonical order)."""
        ...

    def restore_tree(self, tree: dict[str, Any] | None, step: int) -> None:
        """Go back to a checkpoint of ``step`` (``tree``: its ``checkpoint_tree()``; None: the
        fresh state of a job resumed from scratch). The source of a resuming round calls it
        before the model is sent to the members; an exception fails the resume."""
        ...


@runtime_checkable
class RangeDataset(Protocol):
    """A dataset that builds a whole batch from a contiguous index range (fast path)."""

    def __len__(self) -> int: ...

    def get_range(self, start: int, end: int) -> Any: ...
