"""Applying a step: the one place that reduces gradients, runs ``optimizer.step()`` and commits.

A step has one of two shapes, and ``StepRunner`` owns both:

* **plain** (one worker per process): the loader ``begin``s the step, the script computes the
  batch's gradient and calls ``job.step()``, which ``apply``s it: one all-reduce carries every
  worker's ``samples * gradient`` and its step header (tidal.worker.comm), the sum is scaled by
  ``1 / samples in the step`` (the gradient of the mean loss over the global batch, however
  the samples were split), then ``optimizer.step()`` and the commit. A worker without data
  takes part with zero samples (``empty``); when no worker had any, the epoch ends.
* **logical workers** (EasyScale ESTs, tidal.worker.logical): the loader ``begin_logical``s the
  step and, for each local EST, ``enter_est``s it (its random streams, the buffers the step
  started with) before yielding its batch; ``job.step()`` then ``stash``es that EST's
  gradient. After the last local EST the loader calls ``finish_logical``: the contributions
  are reduced in logical-rank order, module buffers follow EST 0, ``optimizer.step()``, and
  the gradients are released.

Either way an applied step is published in one move: the step count and the step's records
(who trained which range, for the master's exactly-once ledger) change together under the
host's lock, and then the state is committed. A broken collective applies nothing: the host
is told (``StepHost.collective_broke``) and re-forms, restoring the committed state. A re-form
asked for in any worker's header is acted on by every worker after the step is applied.

The runner holds no process group and knows nothing of the master: it is driven through
``StepComm`` (tidal.worker.comm.RoundComm, or an in-process fake in the tests) and reports to
a ``StepHost`` (tidal.worker.job.Job).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tidal.api import RetryableError, StepRecord
from tidal.api.streams import STEP_RANGES, Span
from tidal.worker.api import CollectiveError, StepHook, UsageError
from tidal.worker.comm import END, EPOCH, EXTRA, FIRST, HEADER_FIELDS, RANGE_FIELDS, REFORM, START, WORKER, N
from tidal.worker.logical import (
    GradientStash,
    Grads,
    Weighting,
    contributions_sent,
    enter_context,
    est_ranks,
    est_seed,
    folds,
    skip_empty_zero_grad,
)
from tidal.worker.state import State

REDUCTIONS = ("ordered", "allreduce")


class StepOutcome(enum.Enum):
    """What became of a step."""

    APPLIED = "applied"  # reduced, optimizer stepped, committed
    EPOCH_END = "epoch_end"  # no worker had samples: nothing to apply, the epoch is over
    BROKEN = "broken"  # a collective failed: nothing applied, the host re-forms


class StepComm(Protocol):
    """The collectives a step uses (implemented by tidal.worker.comm.RoundComm)."""

    def reduce_with_header(self, params: list[torch.nn.Parameter], weight: float, row: list[int]) -> torch.Tensor:
        """Sum ``weight * grad`` over the workers (kept until ``apply_reduced``); returns every
        worker's header row, ``[world_size, HEADER_FIELDS]``.

        Raises:
            CollectiveError: a peer died or left."""
        ...

    def apply_reduced(self, params: list[torch.nn.Parameter], scale: float) -> None:
        """Write the reduced gradient times ``scale`` into ``.grad``."""
        ...

    def reduce_in_logical_order(self, local: list[Grads], counts: list[int], after: float,
                                row: list[int]) -> tuple[Grads, list[list[int]]]:
        """Every process's contributions summed left to right in logical-rank order, times
        ``after``; and every process's header row.

        Raises:
            CollectiveError: a peer died or left."""
        ...

    def reduce_by_allreduce(self, local: list[Grads], after: float,
                            row: list[int]) -> tuple[Grads, list[list[int]]]:
        """As ``reduce_in_logical_order`` but summed by an all-reduce (not reproducible).

        Raises:
            CollectiveError: a peer died or left."""
        ...

    def broadcast_tensors(self, tensors: list[torch.Tensor], source: int) -> None:
        """In place: every member ends with rank ``source``'s values.

        Raises:
            CollectiveError: a peer died or left."""
        ...


@dataclass(frozen=True)
class AppliedStep:
    """A step this worker applied, as its host records it."""

    step: int
    mine: int  # samples this process trained in it (all of its ESTs)
    total: int  # samples in the step, over every worker
    records: list[StepRecord]  # every worker's ranges of the step ([] without a master's ledger)
    started: float  # clock when this worker began the step
    finished: float  # clock when it was applied
    collective_s: float  # from the reduction to the optimizer step included
    comm_s: float = 0.0  # the collectives alone (the reduction; logical workers: and the buffers' broadcast)


class StepHost(Protocol):
    """What the runner needs of the membership side (tidal.worker.job.Job)."""

    @property
    def reform_notice(self) -> bool:
        """The master asked this worker to re-form (sent in the step header to every worker)."""
        ...

    def step_applied(self, applied: AppliedStep) -> None:
        """Record an applied step; called under the runner's ``lock``, just after the state's
        step count moved to ``applied.step`` and before the commit."""
        ...

    def collective_broke(self, exc: CollectiveError) -> None:
        """A collective of the step failed: nothing was applied; leave the round and re-form."""
        ...

    def leave_for_rendezvous(self, why: str) -> None:
        """Leave the round after this step (a re-form asked for in some worker's header)."""
        ...


@dataclass
class PendingStep:
    """The step whose batch the script is computing (``epoch, start, end``: this worker's batch;
    logical workers: ``start = end = 0``, their batches are in ``LogicalStep``)."""

    step: int
    epoch: int
    start: int
    end: int
    mine: int
    started: float
    first: int = 0  # a stream job's first record (``begin_stream``)
    # a stream step's further ranges: (partition, after, first, last, records) each
    more: list[Span] = field(default_factory=list)


@dataclass
class LogicalStep:
    """One global step of logical workers in this process (see tidal.worker.logical)."""

    pending: PendingStep
    batches: list[tuple[int, int]]  # [start, end) of every logical rank
    weighting: Weighting
    total: int
    current: int | None = None  # the EST whose batch the script is computing
    buffers_start: list[torch.Tensor] | None = field(default=None, repr=False)
    buffers_est0: list[torch.Tensor] | None = field(default=None, repr=False)


class StepRunner:
    """The one owner of applying a step, for plain and logical workers alike.

    Args:
        state: what the steps change and commit.
        host: told of applied steps, broken collectives and re-forms (tidal.worker.job.Job).
        worker_id: this worker's id, sent in the step header.
        lock: held while the step count and the host's record of the step change together (a
            reporter thread reading both under it never sees a step without its records).
        logical: the number of logical workers, or None for one worker per process.
        ledger: build every worker's ``StepRecord``s (a master keeps a ledger; a local run not).
        reduction: logical workers' reduction, "ordered" (reproducible) or "allreduce" (not).
        clock: monotonic seconds, for the step's timings.

    Raises:
        UsageError: an unknown ``reduction``.
    """

    def __init__(self, state: State, host: StepHost, *, worker_id: int, lock: AbstractContextManager[Any],
                 logical: int | None = None, ledger: bool = False, reduction: str = "ordered",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if reduction not in REDUCTIONS:
            raise UsageError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
        self.state = state
        self.logical = logical
        self.est_seed = 0  # the seed of the ESTs' random streams (the loader's seed)
        self.idle_reform = False  # the last step had no samples anywhere and a re-form was asked for
        self.local_ests: list[int] = []  # the logical ranks this process runs in this round
        self._host = host
        self._worker_id = worker_id
        self._lock = lock
        self._ledger = ledger
        self._reduction = reduction
        self._clock = clock
        self._comm: StepComm | None = None
        self._rank = 0
        self._world_size = 1
        self._est_counts: list[int] = []
        self._pending: PendingStep | None = None
        self._lstep: LogicalStep | None = None
        self._stash = GradientStash()
        self._hook_broke: str | None = None  # why a hook broke the step in flight (see _before_reduce)
        self.hooks: list[StepHook] = []  # tidal.worker.api.StepHook: updated in step with the model
        if logical is not None and state.optimizer is not None:
            skip_empty_zero_grad(state.optimizer)  # called once per EST, after the stash emptied .grad

    # ------------------------------------------------------------------ rounds
    def enter_round(self, comm: StepComm, rank: int, world_size: int) -> None:
        """Steps from now on go through ``comm``, as ``rank`` of ``world_size``.

        Raises:
            UsageError: more processes than logical workers.
        """
        self.drop()
        self._comm, self._rank, self._world_size = comm, rank, world_size
        if self.logical is None:
            return
        if world_size > self.logical:
            raise UsageError(f"{world_size} processes for {self.logical} logical workers: "
                             "run with --workers MAX no larger than --logical-workers")
        self.local_ests = est_ranks(self.logical, world_size, rank)
        self._est_counts = contributions_sent(self.logical, world_size)

    def leave_round(self) -> None:
        """The round's collectives are gone: forget the step in flight and the communicator."""
        self.drop()
        self._comm = None

    def drop(self) -> None:
        """Forget the step in flight (a re-form: its samples go back to the queue)."""
        self._pending = None
        self._lstep = None
        self._hook_broke = None

    @property
    def pending(self) -> PendingStep | None:
        """The plain step whose batch the script is computing (None once ``job.step()`` ran)."""
        return self._pending

    @property
    def logical_step(self) -> LogicalStep | None:
        """The logical step in flight (None once finished or dropped)."""
        return self._lstep

    # ------------------------------------------------------------------ the script's job.step()
    def step(self) -> bool:
        """The script's ``job.step()``: apply the plain step, or stash the current EST's gradient.

        Returns False if the step was dropped (a re-form; its samples go back to the queue).

        Raises:
            UsageError: no batch from the loader is waiting for this call.
        """
        if self._lstep is not None:
            return self.stash()
        return self.apply() is StepOutcome.APPLIED

    # ------------------------------------------------------------------ plain steps
    def begin(self, epoch: int, start: int, end: int) -> PendingStep:
        """The step this worker is about to compute on ``[start, end)`` (nothing is exchanged
        before the reduction).

        Raises:
            UsageError: the previous batch's ``job.step()`` was never called.
        """
        if self._pending is not None:
            raise UsageError("call job.step() once for every batch of the elastic loader")
        self._pending = self._new_pending(epoch, start, end, end - start)
        return self._pending

    def begin_stream(self, spans: list[Span]) -> PendingStep:
        """The step this worker is about to compute on the records of ``spans``, each
        ``(partition, after, first, last, records)``: the packed ids ``first`` to ``last`` (both
        included) of one partition, read after ``after`` (tidal.api.streams); at most
        ``STEP_RANGES`` of them, each a range the master commits with the step.

        Raises:
            UsageError: the previous batch's ``job.step()`` was never called, or no span, or more
                than the step header holds.
        """
        if not 1 <= len(spans) <= STEP_RANGES:
            raise UsageError(f"a stream step trains 1 to {STEP_RANGES} ranges, got {len(spans)}")
        partition, after, first, last, _ = spans[0]
        pending = self.begin(partition, after, last)
        pending.mine, pending.first, pending.more = sum(s[4] for s in spans), first, list(spans[1:])
        return pending

    def apply(self) -> StepOutcome:
        """Reduce the pending step's gradient over the round, ``optimizer.step()``, commit.

        Raises:
            UsageError: no step is pending.
        """
        pending = self._pending
        if pending is None:
            raise UsageError("job.step() called without a batch from the elastic loader")
        self._pending = None
        return self._reduce_and_apply(pending)

    def empty(self, epoch: int) -> StepOutcome:
        """Take part in a step with no samples of our own (others may still have data)."""
        if self.state.optimizer is not None:
            self.state.optimizer.zero_grad(set_to_none=True)
        return self._reduce_and_apply(self._new_pending(epoch, 0, 0, 0))

    def end_epoch(self) -> None:
        """Move the committed data position to the next epoch (every worker, at the same step)."""
        self.state.epoch += 1
        self.state.epoch_step = 0
        self.state.commit()

    def _before_reduce(self, step: int, key: int, samples: int) -> None:
        """The hooks' part of a contribution. One that fails for a reason a re-form cures (a
        parameter server lost: ``RetryableError``) breaks the step: it is dropped before its
        reduction, so the peers' reduction fails too and every member re-forms."""
        for hook in self.hooks:
            try:
                hook.before_reduce(step, key, samples)
            except RetryableError as exc:
                self._hook_broke = self._hook_broke or f"{hook.name}: {exc}"

    def _raise_if_hook_broke(self) -> None:
        why, self._hook_broke = self._hook_broke, None
        if why is not None:
            raise CollectiveError(why)

    def _new_pending(self, epoch: int, start: int, end: int, mine: int) -> PendingStep:
        return PendingStep(self.state.applied_step + 1, epoch, start, end, mine, self._clock())

    def _reduce_and_apply(self, pending: PendingStep) -> StepOutcome:
        """One all-reduce carries the gradients and every worker's step header."""
        comm = self._round_comm()
        state = self.state
        params = state.trainable()
        self.idle_reform = False
        row = self._header_row(pending, pending.start, pending.end, pending.first)
        self._before_reduce(pending.step, self._rank, pending.mine)
        t0 = self._clock()
        try:
            self._raise_if_hook_broke()
            # each worker adds its samples' share; dividing by the step's total gives the mean
            headers = comm.reduce_with_header(params, float(pending.mine), row)
        except CollectiveError as exc:
            self._host.collective_broke(exc)
            return StepOutcome.BROKEN
        comm_s = self._clock() - t0
        rows = headers.tolist()
        total = sum(r[N] for r in rows)
        if total == 0:
            # nobody had samples (a dataset's epoch end, or a stream with nothing to read): a
            # re-form asked for now is the caller's to act on (every member saw the same header)
            self.idle_reform = any(r[REFORM] for r in rows)
            return StepOutcome.EPOCH_END
        comm.apply_reduced(params, 1.0 / total)
        if state.optimizer is not None:
            state.optimizer.step()
        records = [r for h in rows if h[N] > 0 for r in _header_records(pending.step, h)] if self._ledger else []
        for hook in self.hooks:
            hook.after_apply(pending.step, total)
        self._publish(pending, total, records, t0, comm_s)
        if any(r[REFORM] for r in rows):
            self._host.leave_for_rendezvous("re-form requested by the master")
        return StepOutcome.APPLIED

    # ------------------------------------------------------------------ logical workers
    def begin_logical(self, epoch: int, batches: list[tuple[int, int]]) -> LogicalStep:
        """The step this process is about to run for its logical workers; ``batches`` are every
        logical rank's ``[start, end)``. Nothing is exchanged: the step header rides in the
        reduction at the end of the step.

        Raises:
            UsageError: the job has no logical workers.
        """
        if self.logical is None:
            raise UsageError("begin_logical() on a job without logical workers")
        sizes = [e - s for s, e in batches]
        mine = sum(sizes[r] for r in self.local_ests)
        weighting = Weighting.of(sizes)
        self._stash.begin(weighting, fold=folds(self._rank))
        self._lstep = LogicalStep(self._new_pending(epoch, 0, 0, mine), batches, weighting, sum(sizes))
        return self._lstep

    def enter_est(self, logical_rank: int) -> None:
        """Context switch to EST ``logical_rank``: its random streams, and the buffers the step
        started with.

        Raises:
            UsageError: no logical step is in flight.
        """
        lstep = self._lstep
        if lstep is None:
            raise UsageError("enter_est() outside a logical step")
        buffers = self.state.buffers() if len(self.local_ests) > 1 else []  # alone: nothing to undo
        if buffers:
            if lstep.buffers_start is None:
                lstep.buffers_start = [b.detach().clone() for b in buffers]
            else:
                with torch.no_grad():
                    for b, saved in zip(buffers, lstep.buffers_start, strict=True):
                        b.copy_(saved)
        enter_context(self.est_seed, logical_rank, lstep.pending.step)
        lstep.current = logical_rank

    def stash(self) -> bool:
        """Keep the current EST's gradient for the step's reduction (``job.step()`` of an EST).

        Raises:
            UsageError: no EST's batch is waiting for this call.
        """
        lstep = self._lstep
        r = lstep.current if lstep is not None else None
        if lstep is None or r is None:
            raise UsageError("job.step() called twice for one batch")
        state = self.state
        s, e = lstep.batches[r]
        self._before_reduce(lstep.pending.step, r, e - s)
        self._stash.put(r, state.trainable())
        if r == 0 and len(self.local_ests) > 1 and state.buffers():  # the ESTs after it will change them
            lstep.buffers_est0 = [b.detach().clone() for b in state.buffers()]
        lstep.current = None
        return True

    def finish_logical(self) -> StepOutcome:
        """Reduce every EST's gradient in logical order, apply, commit (APPLIED or BROKEN).

        Raises:
            UsageError: no logical step is in flight.
        """
        lstep = self._lstep
        if lstep is None:
            raise UsageError("finish_logical() outside a logical step")
        self._lstep = None
        comm = self._round_comm()
        state = self.state
        params = state.trainable()
        for r in self.local_ests:
            s, e = lstep.batches[r]
            if e <= s:  # no data for this EST at this step
                self._stash.put_zeros(r, params)
        pending = lstep.pending
        row = self._header_row(pending, 0, 0, 0)
        t0 = self._clock()
        try:
            self._raise_if_hook_broke()
            local = self._stash.take()
            after = lstep.weighting.after
            if self._reduction == "allreduce":
                grads, rows = comm.reduce_by_allreduce(local, after, row)
            else:
                grads, rows = comm.reduce_in_logical_order(local, self._est_counts, after, row)
            # buffers follow EST 0, like DDP's follow rank 0; integer ones (counters, indices)
            # evolve the same everywhere, floating ones (BatchNorm statistics) are sent
            floating = [b for b in state.buffers() if b.is_floating_point()]
            if lstep.buffers_est0 is not None:
                with torch.no_grad():
                    for b, v in zip(state.buffers(), lstep.buffers_est0, strict=True):
                        b.copy_(v)
            comm.broadcast_tensors(floating, source=0)
        except CollectiveError as exc:
            self._host.collective_broke(exc)
            return StepOutcome.BROKEN
        comm_s = self._clock() - t0
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        if state.optimizer is not None:
            state.optimizer.step()
            # the gradient is spent (as DeepSpeed's engine.step() releases it): the script cannot
            # see it anyway, since this runs inside the loader before its next batch, and its
            # zero_grad() then finds nothing to clear (skip_empty_zero_grad)
            for p in params:
                p.grad = None
        state.epoch_step += 1
        records: list[StepRecord] = []
        if self._ledger:  # for the master's exactly-once ledger
            assert self.logical is not None
            holders = {r: rows[p][WORKER] for p in range(self._world_size)
                       for r in est_ranks(self.logical, self._world_size, p)}
            # built from values this worker computed itself: no validation needed on the hot path
            records = [StepRecord.model_construct(step=pending.step, worker=holders[r], epoch=pending.epoch,
                                                  start=s, end=e)
                       for r, (s, e) in enumerate(lstep.batches) if e > s]
        for hook in self.hooks:
            hook.after_apply(pending.step, lstep.total)
        self._publish(pending, lstep.total, records, t0, comm_s)
        if any(r[REFORM] for r in rows):
            self._host.leave_for_rendezvous("re-form requested by the master")
        return StepOutcome.APPLIED

    def est_contexts(self) -> list[dict[str, Any]]:
        """Every logical worker's context: what it needs to resume anywhere (tidal.worker.logical)."""
        step = self.state.applied_step + 1
        return [{"logical_rank": r, "seed": self.est_seed, "next_step": step,
                 "stream_seed": est_seed(self.est_seed, r, step)} for r in range(self.logical or 0)]

    # ------------------------------------------------------------------ publishing
    def _round_comm(self) -> StepComm:
        if self._comm is None:
            raise RuntimeError("a step outside a round (the host calls enter_round first)")
        return self._comm

    def _header_row(self, pending: PendingStep, start: int, end: int, first: int) -> list[int]:
        """This worker's row of the step header (``tidal.worker.comm``), every slot filled."""
        row = [pending.mine, int(self._host.reform_notice), pending.epoch, start, end, self._worker_id, first]
        for span in pending.more:
            row += span
        return row + [0] * (HEADER_FIELDS - len(row))

    def _publish(self, pending: PendingStep, total: int, records: list[StepRecord], t0: float,
                 comm_s: float) -> None:
        finished = self._clock()
        applied = AppliedStep(step=pending.step, mine=pending.mine, total=total, records=records,
                              started=pending.started, finished=finished, collective_s=finished - t0,
                              comm_s=comm_s)
        with self._lock:  # the step count and its records move together
            self.state.applied_step = pending.step
            self._host.step_applied(applied)
        self.state.commit()


def _header_records(step: int, h: list[int]) -> list[StepRecord]:
    """The records of one worker's header row: its first range (the samples the further ranges do
    not hold), then each further range that holds records."""
    more = [h[i:i + RANGE_FIELDS] for i in range(EXTRA, HEADER_FIELDS, RANGE_FIELDS) if h[i + RANGE_FIELDS - 1] > 0]
    first = h[N] - sum(m[4] for m in more)
    records = [StepRecord(step=step, worker=h[WORKER], epoch=h[EPOCH], start=h[START], end=h[END], first=h[FIRST],
                          samples=first)] if first > 0 else []
    return records + [StepRecord(step=step, worker=h[WORKER], epoch=p, start=after, end=last, first=first_id,
                                 samples=count) for p, after, first_id, last, count in more]
