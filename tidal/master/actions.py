"""What the master's decisions return and its executor applies (STYLE.md 2).

The decisions (``tidal.master.rounds``, ``tidal.master.liveness``) are pure functions over a
view of the master's state and the time; they never change state and never do I/O. The job
master applies their actions in one place (``JobMaster._execute``), where state, the journal and
the backend are touched. A test of a decision builds a view, calls it with a fake time and looks
at the actions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FailWorker:
    """Declare a worker failed; ``kill``: the backend request tag to kill its process with (a
    worker that missed heartbeats or hangs may still run)."""

    worker_id: int
    why: str
    kill: str | None = None


@dataclass(frozen=True)
class StartReform:
    cause: str


@dataclass(frozen=True)
class FormRound:
    """Close the rendezvous: ``members`` in rank order train from ``resume_step`` on, with the
    state of ``source``; ``leaving`` were at the rendezvous but are not needed (scale-in)."""

    members: list[int]
    leaving: list[int]
    source: int
    resume_step: int
    has_state: bool  # some member holds a model (else every member starts from scratch)
    sync_state: bool  # members hold different states: the source's is broadcast
    failed_rounds: int  # rounds in a row that failed before a step, this one not counted
    round_failure: str
    # no member holds the model: roll the data back to the flash checkpoint of ``resume_step``
    # (-1: none, from scratch), which the source loads
    restore: bool = False


@dataclass(frozen=True)
class FailJob:
    reason: str


@dataclass(frozen=True)
class SetStraggler:
    """DLRover-RM 5.1: a worker much slower than its peers gets smaller shards and batches."""

    worker_id: int
    straggler: bool
    size_factor: float
    message: str


@dataclass(frozen=True)
class SlowSince:
    """Note when a worker began to look slow (``since`` None: it is not slow now)."""

    worker_id: int
    since: float | None


Action = FailWorker | StartReform | FormRound | FailJob | SetStraggler | SlowSince
