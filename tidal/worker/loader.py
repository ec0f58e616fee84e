"""The elastic data loader: batches from shards leased from the master, one step at a time.

Each iteration (1) leases a shard when the current one is used up, (2) exchanges the step
header with the round's other workers (samples, range, the master's re-form notice), and
(3) yields the batch. A worker whose shards ran out while others still have data takes part
in the step with zero samples (gradients are weighted by samples), and when no worker has any
data left the epoch ends for all of them at the same step. A re-form in the middle drops the
uncommitted batch: the master puts its range back in the TODO queue.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from tidal.api import DATA_ERROR_EXIT, DatasetRequest, LeaseRequest, LeaseResponse, Shard, StaleRoundError
from tidal.api.sharding import shard_starts
from tidal.data.batches import BatchError, BatchShape, build_batch, flatten
from tidal.data.dispatch import Dispatcher
from tidal.data.partition import resolve_preprocess
from tidal.data.worker import loader_key
from tidal.worker.api import UsageError
from tidal.worker.logical import BatchSchedule
from tidal.worker.step import StepOutcome, StepRunner

if TYPE_CHECKING:
    from tidal.worker.client import MasterClient


class LoaderHost(Protocol):
    """What the loader needs of its job (``Job``, tidal.worker's job module): the round, the steps."""

    @property
    def worker_id(self) -> int: ...

    @property
    def client(self) -> MasterClient | None:
        """The master's control plane; None for a local run (no master: the loader leases itself)."""
        ...

    @property
    def round(self) -> int: ...

    @property
    def generation(self) -> int:
        """Bumped on every new round: the loader's leases of an earlier round are void."""
        ...

    @property
    def steps(self) -> StepRunner:
        """The owner of applying steps.

        Raises:
            UsageError: the job's state was not created yet."""
        ...

    def ensure_round(self) -> None:
        """Block until this worker is a member of a round with its state in place."""
        ...

    def leave_for_rendezvous(self, why: str) -> None:
        """Leave the round now (the committed state is restored); ``ensure_round`` re-forms."""
        ...

    def finish(self) -> None:
        """Training is over: tell the master."""
        ...

    def data_worker_addresses(self) -> list[str]:
        """The job's data workers now (``tidal run --data-workers``; updated by the reports)."""
        ...

    def note_data_feed(self, feed: Dispatcher) -> None:
        """The loader's dispatcher, whose counters the reports carry."""
        ...

    def threads_wanted(self) -> int:
        """Torch threads the master asks this trainer to use (0: as it is)."""
        ...


class ElasticDataLoader:
    """Iterate batches of ``dataset`` for ``epochs`` epochs, elastically.

    Args:
        dataset: ``get_range(start, end)`` builds a batch from an index range (fast path);
            otherwise ``dataset[i]`` items are combined by ``collate_fn``.
        batch_size: samples per worker per step (a straggler may get fewer).
        batches_per_shard: shard size in batches (DLRover-RM uses 64 to 256 at cluster scale).
        shuffle, seed: shuffle the order of shards in each epoch, reproducibly.
        preprocess: the stateless part of building a batch, ``fn(raw batch) -> batch`` (a function
            or an ``nn.Module`` without trainable parameters). With ``tidal run --data-workers``
            the job's data workers run it (tidal.data.worker), else this process does; the
            batches are the same either way. ``"auto"``: cut it off the model's forward
            (tidal.data.partition; ``fallback`` where that cannot be done).
        prefetch: with data workers, batches in flight (default ``TIDAL_DATA_PREFETCH``, else two
            per data worker).
    """

    def __init__(self, job: LoaderHost, dataset: Any, batch_size: int, epochs: int = 1, *, shuffle: bool = True,
                 seed: int = 0, batches_per_shard: int = 16, collate_fn: Callable[[list[Any]], Any] | None = None,
                 preprocess: Callable[[Any], Any] | str | None = None, fallback: Callable[[Any], Any] | None = None,
                 prefetch: int | None = None) -> None:
        if batch_size < 1 or epochs < 0 or batches_per_shard < 1:
            raise UsageError("batch_size and batches_per_shard must be >= 1 and epochs >= 0")
        self.job = job
        self.dataset = dataset
        self.size = len(dataset)
        if self.size < 1:
            raise UsageError("the dataset is empty")
        self.batch_size = batch_size
        self.epochs = epochs
        self.shuffle = shuffle
        self.seed = seed
        self.batches_per_shard = batches_per_shard
        self.collate_fn = collate_fn
        self._generation = -1
        self._shard: Shard | None = None
        self._pos = 0
        self._empty_epoch = -1
        self._local_queue: list[int] = []
        self._local_epoch = -1
        self._pool: ThreadPoolExecutor | None = None
        self._prefetch: Future[Shard | None] | None = None
        self._prefetch_key = (-1, -1)
        self._prefetch_at = 1
        self._jitter = random.Random(job.worker_id * 7919 + seed)
        try:
            self.preprocess = resolve_preprocess(preprocess, fallback, lambda: job.steps.state.model, _say)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        preprocess = self.preprocess
        self._shape = BatchShape()
        self.dispatcher: Dispatcher | None = None
        if job.client is not None and os.environ.get("TIDAL_DATA_WORKERS"):
            if prefetch is None:
                prefetch = int(os.environ.get("TIDAL_DATA_PREFETCH", "0") or 0)
            if prefetch < 0:
                raise UsageError(f"prefetch must be >= 0, got {prefetch}")
            self.dispatcher = Dispatcher(os.environ.get("TIDAL_TOKEN", ""), loader_key(self.size, preprocess),
                                         self._build, job.data_worker_addresses, prefetch=prefetch)
            job.note_data_feed(self.dispatcher)

    @property
    def epoch(self) -> int:
        return self.job.steps.state.epoch

    def __iter__(self) -> Iterator[Any]:
        """The batches of this worker; ``job.step()`` must follow each one.

        Raises:
            UsageError: ``job.state()`` was not called, or ``job.step()`` was not called once
                for a batch.
            tidal.worker.api.WorkerGoneError, SystemExit: the master ended this worker's
                training (see ``Job.ensure_round``).
        """
        steps = self.job.steps
        if steps.logical is not None:
            yield from self._iter_logical(steps, steps.logical)
            return
        job = self.job
        state = steps.state
        while True:
            job.ensure_round()
            if self._generation != job.generation:
                self._generation = job.generation
                self._shard, self._empty_epoch, self._local_epoch = None, -1, -1
                self._drop_prefetch()
                if self.dispatcher is not None:
                    self.dispatcher.reset()
            epoch = state.epoch
            if epoch >= self.epochs:
                self._close_dispatcher()
                job.finish()
                return
            if steps.pending is not None:
                raise UsageError("call job.step() once for every batch of the elastic loader")
            span = self._next_range(epoch)
            if span is None:
                continue  # the round went stale while leasing: re-form
            start, end = span
            if end <= start:
                if steps.empty(epoch) is StepOutcome.EPOCH_END:
                    steps.end_epoch()  # nobody had data left: every worker moves on at this step
                continue
            batch = self._fetch(start, end, self._upcoming(epoch))
            # the step begins once its batch is here: the fetch counts as data wait, not compute
            pending = steps.begin(epoch, start, end)
            yield batch
            if steps.pending is pending:
                raise UsageError("call job.step() once for every batch of the elastic loader")

    def _iter_logical(self, steps: StepRunner, logical: int) -> Iterator[Any]:
        """N logical workers in a fixed data order (tidal.worker.logical): no leases."""
        job = self.job
        state = steps.state
        schedule = BatchSchedule(self.size, self.batch_size, logical, self.shuffle, self.seed)
        steps.est_seed = self.seed
        order_epoch, order = -1, []
        while True:
            job.ensure_round()
            if self._generation != job.generation:
                self._generation = job.generation
                if self.dispatcher is not None:
                    self.dispatcher.reset()
                self._declare_dataset()
                continue  # declaring may have found the round stale
            if state.epoch >= self.epochs:
                self._close_dispatcher()
                job.finish()
                return
            if state.epoch_step >= schedule.steps_per_epoch:
                steps.end_epoch()
                continue
            if order_epoch != state.epoch:
                order_epoch, order = state.epoch, schedule.order(state.epoch)
            batches = [schedule.batch(order, state.epoch_step, r) for r in range(logical)]
            lstep = steps.begin_logical(state.epoch, batches)
            ests = list(steps.local_ests)
            for i, r in enumerate(ests):
                start, end = batches[r]
                if end <= start:
                    continue
                steps.enter_est(r)
                yield self._fetch(start, end, self._upcoming_logical(schedule, order, state.epoch,
                                                                     state.epoch_step, ests, i))
                if steps.logical_step is not lstep:
                    break  # the step was dropped by a re-form
                if lstep.current is not None:
                    raise UsageError("call job.step() once for every batch of the elastic loader")
            else:
                steps.finish_logical()

    def _declare_dataset(self) -> None:
        job = self.job
        if job.client is None:
            return
        req = DatasetRequest(worker_id=job.worker_id, round=job.round, dataset_size=self.size,
                             batch_size=self.batch_size, batches_per_shard=1, shuffle=self.shuffle, seed=self.seed,
                             epochs=self.epochs)
        try:
            job.client.post_raw("/v1/dataset", req)
        except StaleRoundError:
            job.leave_for_rendezvous("stale round while declaring the dataset")

    def _next_range(self, epoch: int) -> tuple[int, int] | None:
        """The next batch's ``[start, end)`` ((0, 0) when this worker has no data this epoch)."""
        if self._shard is None or self._pos >= self._shard.end:
            self._shard = None
            if self._empty_epoch == epoch:
                return (0, 0)
            try:
                shard = self._take_prefetched(epoch)
            except StaleRoundError:
                self.job.leave_for_rendezvous("stale round while leasing")
                return None
            if shard is None:
                self._empty_epoch = epoch
                return (0, 0)
            self._shard, self._pos = shard, shard.start
            batches = -(-(shard.end - shard.start) // shard.batch_size)
            self._prefetch_at = self._jitter.randint(1, max(1, batches // 2))
            if self.dispatcher is not None:  # lease early enough to dispatch the next shard's batches
                self._prefetch_at = max(self._prefetch_at, self.dispatcher.window() + 1)
        assert self._shard is not None
        start = self._pos
        end = min(start + self._shard.batch_size, self._shard.end)
        self._pos = end
        left = -(-(self._shard.end - end) // self._shard.batch_size)
        if left <= self._prefetch_at and self._prefetch is None and self.job.client is not None:
            self._start_prefetch(epoch)
        return (start, end)

    # Leases are fetched in the background while the current shard still has batches, at a
    # random point of its second half: the training loop does not wait for the master, and the
    # workers of a lockstep job do not all ask at the same step.
    def _start_prefetch(self, epoch: int) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-lease")
        self._prefetch = self._pool.submit(self._lease, epoch)
        self._prefetch_key = (self.job.generation, epoch)

    def _take_prefetched(self, epoch: int) -> Shard | None:
        future, self._prefetch = self._prefetch, None
        if future is not None and self._prefetch_key == (self.job.generation, epoch):
            return future.result()
        # none, or one from an earlier round (the master released it when the round closed)
        return self._lease(epoch)

    def _drop_prefetch(self) -> None:
        if self._prefetch is not None:
            self._prefetch.cancel()
            self._prefetch = None

    def _lease(self, epoch: int) -> Shard | None:
        job = self.job
        shard_size = self.batch_size * self.batches_per_shard
        if job.client is None:
            if self._local_epoch != epoch:
                self._local_epoch = epoch
                self._local_queue = shard_starts(self.size, shard_size, self.shuffle, self.seed, epoch)[::-1]
            if not self._local_queue:
                return None
            start = self._local_queue.pop()
            return Shard(epoch=epoch, start=start, end=min(start + shard_size, self.size), batch_size=self.batch_size)
        req = LeaseRequest(worker_id=job.worker_id, round=job.round, epoch=epoch, dataset_size=self.size,
                           batch_size=self.batch_size, batches_per_shard=self.batches_per_shard,
                           shuffle=self.shuffle, seed=self.seed, epochs=self.epochs)
        resp = job.client.post("/v1/shards/lease", req, LeaseResponse)
        return resp.shard if resp.status == "ok" else None

    # ------------------------------------------------------------------ batches
    def _close_dispatcher(self) -> None:
        """The data is trained: close the sockets to the data workers."""
        if self.dispatcher is not None:
            self.dispatcher.close()
            self.dispatcher = None

    def _fetch(self, start: int, end: int, upcoming: Iterator[tuple[Hashable, int, int]]) -> Any:
        """The batch of ``[start, end)``: from the data workers when the job has them, else built
        here. A batch that cannot be built ends the job with the range (``DATA_ERROR_EXIT``)."""
        if self.dispatcher is not None:
            self._apply_threads()
        try:
            if self.dispatcher is None:
                return self._build(None, start, end)
            key = (self.job.generation, self.epoch, start, end)
            batch = self.dispatcher.take(key, start, end, upcoming)
            self._check(batch, start, end)
            return batch
        except BatchError as exc:
            if self.job.client is None:
                raise
            print(f"tidal: {exc}; at training step {self.job.steps.state.applied_step + 1} (epoch {self.epoch})",
                  file=sys.stderr, flush=True)
            raise SystemExit(DATA_ERROR_EXIT) from exc

    def _apply_threads(self) -> None:
        """The tuner's CPUs for this trainer (GoldMiner 3.4.1 (iii)), set between two batches in
        the training thread (never with logical workers: the master does not tune them there)."""
        import torch

        wanted = self.job.threads_wanted()
        if wanted and wanted != torch.get_num_threads():
            torch.set_num_threads(wanted)

    def _build(self, step: int | None, start: int, end: int) -> Any:
        """Build here (``step``: the dispatcher's id of the batch, if it dispatched it)."""
        batch = build_batch(self.dataset, start, end, self.preprocess, self.collate_fn)
        if self.preprocess is not None:
            self._check(batch, start, end)
        return batch

    def _check(self, batch: Any, start: int, end: int) -> None:
        """The batch holds tensors only, shaped and typed like the first one (BatchError if not)."""
        try:
            skeleton, tensors = flatten(batch)
        except BatchError as exc:
            raise BatchError(f"the batch of samples [{start}, {end}) cannot be used: {exc}") from None
        self._shape.check(skeleton, tensors, start, end)

    def _upcoming(self, epoch: int) -> Iterator[tuple[Hashable, int, int]]:
        """The ranges this worker will train next: the rest of its shard, then the next shard once
        its lease is here (for the dispatcher to send out ahead)."""
        gen = self.job.generation
        shard, pos = self._shard, self._pos
        if shard is not None:
            yield from _ranges(gen, epoch, pos, shard.end, shard.batch_size)
        future = self._prefetch
        if future is not None and future.done() and self._prefetch_key == (gen, epoch) and future.exception() is None:
            nxt = future.result()
            if nxt is not None:
                yield from _ranges(gen, epoch, nxt.start, nxt.end, nxt.batch_size)

    def _upcoming_logical(self, schedule: BatchSchedule, order: list[int], epoch: int, epoch_step: int,
                          ests: list[int], done: int) -> Iterator[tuple[Hashable, int, int]]:
        """The logical workers' ranges of this process after EST ``ests[done]`` of this step, to
        the end of the epoch."""
        gen = self.job.generation
        for k in range(epoch_step, schedule.steps_per_epoch):
            for i, r in enumerate(ests):
                if k == epoch_step and i <= done:
                    continue
                start, end = schedule.batch(order, k, r)
                if end > start:
                    yield (gen, epoch, start, end), start, end


def _say(message: str) -> None:
    print(f"tidal: {message}", file=sys.stderr, flush=True)


def _ranges(gen: int, epoch: int, start: int, end: int, batch_size: int) -> Iterator[tuple[Hashable, int, int]]:
    while start < end:
        stop = min(start + batch_size, end)
        yield (gen, epoch, start, stop), start, stop
        start = stop
