"""The elastic data loader: batches from shards leased from the master, one step at a time.

Each iteration (1) leases a shard when the current one is used up, (2) exchanges the step
header with the round's other workers (samples, range, the master's re-form notice), and
(3) yields the batch. A worker whose shards ran out while others still have data takes part
in the step with zero samples (gradients are weighted by samples), and when no worker has any
data left the epoch ends for all of them at the same step. A re-form in the middle drops the
uncommitted batch: the master puts its range back in the TODO queue.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from tidal.api import DatasetRequest, LeaseRequest, LeaseResponse, Shard, StaleRoundError
from tidal.api.sharding import shard_starts
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


class ElasticDataLoader:
    """Iterate batches of ``dataset`` for ``epochs`` epochs, elastically.

    Args:
        dataset: ``get_range(start, end)`` builds a batch from an index range (fast path);
            otherwise ``dataset[i]`` items are combined by ``collate_fn``.
        batch_size: samples per worker per step (a straggler may get fewer).
        batches_per_shard: shard size in batches (DLRover-RM uses 64 to 256 at cluster scale).
        shuffle, seed: shuffle the order of shards in each epoch, reproducibly.
    """

    def __init__(self, job: LoaderHost, dataset: Any, batch_size: int, epochs: int = 1, *, shuffle: bool = True,
                 seed: int = 0, batches_per_shard: int = 16, collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
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
            epoch = state.epoch
            if epoch >= self.epochs:
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
            batch = self._fetch(start, end)
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
                self._declare_dataset()
                continue  # declaring may have found the round stale
            if state.epoch >= self.epochs:
                job.finish()
                return
            if state.epoch_step >= schedule.steps_per_epoch:
                steps.end_epoch()
                continue
            if order_epoch != state.epoch:
                order_epoch, order = state.epoch, schedule.order(state.epoch)
            batches = [schedule.batch(order, state.epoch_step, r) for r in range(logical)]
            lstep = steps.begin_logical(state.epoch, batches)
            for r in steps.local_ests:
                start, end = batches[r]
                if end <= start:
                    continue
                steps.enter_est(r)
                yield self._fetch(start, end)
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

    def _fetch(self, start: int, end: int) -> Any:
        if hasattr(self.dataset, "get_range"):
            return self.dataset.get_range(start, end)
        from torch.utils.data import default_collate

        collate = self.collate_fn or default_collate
        return collate([self.dataset[i] for i in range(start, end)])
