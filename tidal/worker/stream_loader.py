"""The elastic stream loader: batches read from the partitions the master assigns, one step at a time.

``job.loader(stream=URL, batch_size=B, decode=fn)`` in a job run with ``tidal run --stream URL``.
Each round the master gives this worker some partitions and, for each, the last committed record
(``Job.stream_assignment``); the loader reads after it. Every step takes up to B records of its
partitions (in turn, round-robin, up to ``STEP_RANGES`` partitions a step;
``tidal.worker.stream_reader``), decodes them with the script's ``decode(list of field dicts) ->
(batch, malformed positions)`` and yields the batch; the step's header carries, per partition, the
position read after and the first and last record (``StepRunner.begin_stream``), so the master
commits exactly what the step trained. A re-form
drops what was read and not committed: the next round reads again from the committed positions,
going past the ranges committed beyond them (``Job.stream_skip``; see global shuffling below).

With ``--global-shuffle LOWER:UPPER`` (``TIDAL_STREAM_SHUFFLE``) the reading moves into the
worker's Shuffle Unit (``tidal.worker.shuffle``, Kale 3.5): a thread fills a local queue from the
worker's partitions and forwards the overflow to workers that accept it; each step takes the
next batch of that queue, its own or forwarded.

A worker with nothing to read takes part in the step with no samples (after waiting up to
``poll_s`` for a record); when no worker has any, the step applies nothing and the loop polls
again. Malformed records (``decode`` says which) are logged with their ids, counted for the
master and skipped; they are committed with the step (they never come back), and count in the
step's sample weight. Every ``discover_s`` (every ``IDLE_DISCOVER_S`` while it has nothing to
read) the loader lists the stream's partitions: one that appears or disappears makes the round
re-form after the next step (``Job.ask_reform``), and the master assigns the new set (a partition
that disappears keeps its committed position: if it comes back, it is read after it). When the
master ends the job (``--stop-when-drained``), the loop calls ``job.finish()`` and stops.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from tidal.api.streams import STEP_RANGES, pack_id, parse_id, unpack_id
from tidal.data.api import StreamSource
from tidal.data.streams import open_source
from tidal.worker.api import UsageError
from tidal.worker.shuffle import READ_POLL_S, ShuffleUnit
from tidal.worker.step import StepRunner
from tidal.worker.stream_reader import READER_ENV, Decode, PartitionReader, Picked, ReadAhead, Run, Taken

log = logging.getLogger(__name__)

BACKLOG_EVERY_S = 1.0
#: a worker with nothing to read lists the partitions this often (``discover_s`` otherwise): a
#: partition deleted while it held records reads as drained, and with ``--stop-when-drained 3`` the
#: master once ended the job as drained 3 s later, before the 5-s listing saw the partition gone
IDLE_DISCOVER_S = 1.0
#: a round's first steps are not measured for the capacity it reports: a worker that just joined
#: runs its first steps slowly (its first collectives, buffers allocated), and the members that
#: stayed measured part of their window at the old count. Summed over the members, a live round of
#: 6 workers right after 3 -> 6 read as the capacity of 3, kale believed F(6) = F(3) and held 7
#: workers for the last 9 hours of a WorldCup98 day (bench/RESULTS.md, fifteenth live run)
ROUND_WARMUP_STEPS = 2
#: ... unless it trains nothing that long after the round began: a worker with nothing to train
#: has no capacity to measure (-1), and a 0 would hold back every measurement of the job
ROUND_WARMUP_IDLE_S = 5.0


class StreamHost(Protocol):
    """What the loader needs of its job (``tidal.worker.job.Job``)."""

    @property
    def worker_id(self) -> int: ...

    @property
    def generation(self) -> int: ...

    @property
    def steps(self) -> StepRunner: ...

    @property
    def stop_requested(self) -> bool: ...

    @property
    def token(self) -> str: ...

    round: int
    rank: int
    world_size: int
    stream_assignment: dict[int, int]
    stream_skip: dict[int, list[list[int]]]
    stream_partitions: list[int]
    stream_view: Callable[[], list[int]] | None

    def round_store(self) -> Any: ...

    def ensure_round(self) -> None: ...

    def leave_for_rendezvous(self, why: str) -> None: ...

    def ask_reform(self, why: str) -> None: ...

    def finish(self) -> None: ...

    def note_stream(self, lag: dict[int, int], oldest_ms: dict[int, int], busy: float, malformed: int,
                    shuffle: tuple[int, int, int] = (-1, 0, 0), capacity: float = -1.0, *,
                    batch: int = 0, queue_upper: int = 0, appended: dict[int, int] | None = None,
                    intake_spread: float = -1.0) -> None: ...

    @property
    def stream_committed(self) -> dict[int, int]: ...


class StreamLoader:
    def __init__(self, job: StreamHost, stream: str | StreamSource, batch_size: int, decode: Decode, *,
                 poll_s: float = 0.2, discover_s: float = 5.0, shuffle: tuple[int, int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if batch_size < 1:
            raise UsageError("batch_size must be >= 1")
        self.job = job
        self.source: StreamSource = open_source(stream) if isinstance(stream, str) else stream
        self.batch_size = batch_size
        self.decode = decode
        self.poll_s = poll_s
        self.discover_s = discover_s
        self.clock = clock
        self.malformed = 0
        self._generation = -1
        self._positions: dict[int, int] = {}  # partition -> packed id read up to (this round)
        self.reader = PartitionReader(self.source, batch_size)  # its order and skips: this round's
        self._turn = 0
        self._next_discover = 0.0
        self._next_backlog = 0.0
        self._busy_s, self._busy_since = 0.0, clock()
        self._measured_s: float
        self._measured_records: int
        self._warmup: int
        self._round_began: float
        self._restart_measuring()
        self.trim = os.environ.get("TIDAL_STREAM_TRIM") == "1"  # tidal run --trim-after-commit
        self._trimmed: dict[int, int] = {}
        # the next batch is read and decoded while this one trains (tidal.worker.stream_reader)
        self._ahead = ReadAhead(self.reader, decode, use_process=os.environ.get(READER_ENV, "process") == "process")
        self._ahead_key: Any = None
        self._backlog0: dict[int, int] = {}  # per partition, at the round's start
        self._appended0: dict[int, int] = {}
        self._taken: dict[int, int] = {}  # records read since the round's start
        self._counting: Future[tuple[dict[int, int], dict[int, int]]] | None = None
        self._counter: ThreadPoolExecutor | None = None
        if shuffle is None and os.environ.get("TIDAL_STREAM_SHUFFLE"):  # tidal run --global-shuffle LOWER:UPPER
            lower, _, upper = os.environ["TIDAL_STREAM_SHUFFLE"].partition(":")
            shuffle = (int(lower), int(upper))
        self.shuffle = shuffle
        self._unit: ShuffleUnit | None = None

    def __iter__(self) -> Iterator[Any]:
        """The batches of this worker; ``job.step()`` must follow each one. However the loop
        ends (finished, scaled in, an error), the loader's threads and sockets are closed.

        Raises:
            UsageError: ``job.state()`` was not called, logical workers (not supported on streams
                yet), or ``job.step()`` was not called once for a batch.
        """
        try:
            yield from self._batches()
        finally:
            self.close()

    def _batches(self) -> Iterator[Any]:
        job = self.job
        steps = job.steps
        if steps.logical is not None:
            raise UsageError("logical workers do not read streams yet: run without --logical-workers")
        job.stream_partitions = self.source.partitions()  # the master assigns what the workers see
        job.stream_view = self.source.partitions  # looked at again before every rendezvous
        self._next_discover = self.clock() + self.discover_s
        while True:
            job.ensure_round()
            if self._generation != job.generation:
                self._new_round()
            if job.stop_requested:
                self.close()
                job.finish()
                return
            if steps.pending is not None:
                raise UsageError("call job.step() once for every batch of the elastic loader")
            if self.clock() >= self._next_discover:
                self._next_discover = self.clock() + self.discover_s
                seen = self.source.partitions()
                new, gone = sorted(set(seen) - set(job.stream_partitions)), sorted(set(job.stream_partitions) - set(seen))
                if new or gone:  # every member re-forms after the next step, and the master assigns them
                    job.stream_partitions = seen
                    job.ask_reform(f"stream partitions changed (new: {new}, gone: {gone})")
            taken: Taken | None
            if self._unit is not None:  # global shuffling: the local queue, filled by the unit's reader
                queued = self._unit.take_runs(job.round, self.poll_s, self.batch_size, STEP_RANGES)
                taken = None if not queued else \
                    Taken.decoded([(b.partition, b.after, b.records) for b in queued], self.decode)
            else:
                taken = self._take_ahead()
                if taken is None:
                    picked = self._read()
                    taken = None if picked is None else Taken.decoded(picked, self.decode)
            if taken is None or self.clock() >= self._next_backlog:
                # the backlog and the oldest waiting record: at most once a second, and when idle
                now = self.clock()
                busy = self._busy_s / (now - self._busy_since) if now > self._busy_since else -1.0
                # the rate while busy, from the same steps as the busy share: the rate over busy
                # share from the report's smoothed rate lagged a ramp (the first seconds of a
                # stream read its capacity a fifth low, and kale sized for that all day)
                # (0: the round's first steps are not over, no capacity yet; -1: no step to measure)
                warming = self._warmup > 0 and (self._busy_s > 0 or now - self._round_began < ROUND_WARMUP_IDLE_S)
                capacity = (self._measured_records / self._measured_s if self._measured_s > 0
                            else 0.0 if warming else -1.0)
                self._busy_s, self._busy_since = 0.0, now
                self._measured_s, self._measured_records = 0.0, 0
                self._next_backlog = now + BACKLOG_EVERY_S
                counted = self._lag()
                if counted is not None:
                    unit = self._unit
                    shuffle = (-1, 0, 0) if unit is None else (unit.queued, unit.forwarded_out, unit.forwarded_in)
                    job.note_stream(counted[0], counted[1], min(1.0, busy), self.malformed, shuffle, capacity,
                                    batch=self.batch_size, queue_upper=0 if self.shuffle is None else self.shuffle[1],
                                    appended=counted[2],
                                    intake_spread=-1.0 if unit is None else unit.intake_spread())
                if self.trim:
                    self._trim(job.stream_committed)
            if taken is None:
                self._next_discover = min(self._next_discover, self.clock() + IDLE_DISCOVER_S)
                steps.empty(0)  # nobody may have a record (nothing is applied then): poll again
                if steps.idle_reform:  # a drained job still re-forms (a scale-in, say)
                    job.leave_for_rendezvous("re-form requested by the master")
                continue
            if taken.bad_ids:
                self.malformed += len(taken.bad_ids)
                log.warning("worker %d: %d malformed records skipped in partitions %s: %s", job.worker_id,
                            len(taken.bad_ids), sorted({s[0] for s in taken.spans}), ", ".join(taken.bad_ids[:5]))
            if self._unit is None:
                for partition, after, _, last, count in taken.spans:
                    self._took(self._positions, partition, after, last, count)
                self._start_ahead()
            pending = steps.begin_stream(taken.spans)
            began = self.clock()
            yield taken.batch
            # busy for the share of the step's batch it filled: a worker that keeps up trains a few
            # records every step, and counting such a step as busy would read as saturation
            busy_s = (self.clock() - began) * min(1.0, taken.count / self.batch_size)
            self._busy_s += busy_s
            if self._warmup > 0:
                self._warmup -= 1
            else:
                self._measured_s += busy_s
                self._measured_records += taken.count
            if steps.pending is pending:
                raise UsageError("call job.step() once for every batch of the elastic loader")

    # One batch ahead: once a batch is handed out, the next is read and decoded (by the reader
    # process, or a thread) while the script trains on it. It is taken only if nothing moved
    # meanwhile (same round, same positions); otherwise it is dropped and read again.
    def _ahead_now(self) -> Any:
        return self._generation, self._turn, tuple(sorted(self._positions.items()))

    def _start_ahead(self) -> None:
        self._ahead_key = self._ahead_now()
        self._ahead.start(self._positions, self._turn)

    def _take_ahead(self) -> Taken | None:
        """The batch read ahead, if it still follows what was handed out."""
        if self._ahead_key is None:
            return None
        key, self._ahead_key = self._ahead_key, None
        if key != self._ahead_now():
            self._ahead.discard()
            return None
        got = self._ahead.take()
        if got is None or got[0] is None:
            return None
        self._turn = got[1]
        return got[0]

    def _read(self) -> Picked | None:
        """Up to a batch of records of the partitions, in turn; None when none has any (having
        waited up to ``poll_s`` on one)."""
        picked, self._turn = self.reader.next_records(self._positions, self._turn, self.poll_s)
        return picked

    def _took(self, positions: dict[int, int], partition: int, after: int, last: int, count: int) -> None:
        """This worker read ``count`` records of ``partition`` after ``after`` up to ``last``: its
        position moves there, and the backlog it follows counts them (a range committed ahead
        that it went past was never in the backlog: ``PartitionReader.uncommitted``)."""
        positions[partition] = last
        self._taken[partition] = self._taken.get(partition, 0) + count

    # ------------------------------------------------------------------ rounds and global shuffling
    def _restart_measuring(self) -> None:
        """A round's capacity window from nothing: the steps past its first ROUND_WARMUP_STEPS,
        their seconds (weighted as ``_busy_s`` is) and the records they trained."""
        self._measured_s, self._measured_records = 0.0, 0
        self._warmup = ROUND_WARMUP_STEPS
        self._round_began = self.clock()

    def _new_round(self) -> None:
        """A new round: its partitions, their committed positions and the ranges committed beyond
        them; with global shuffling, the unit's reader starts on them."""
        job = self.job
        if self._unit is not None:
            self._unit.stop_round()  # its reader must not move the new round's positions
        self._generation = job.generation
        self._restart_measuring()  # the capacity is this round's, from its steady steps
        self._next_backlog = 0.0  # say so at once: the last capacity noted was the old round's
        self._positions = dict(job.stream_assignment)
        self.reader.skips = {p: [list(r) for r in ranges] for p, ranges in job.stream_skip.items()}
        self.reader.order, self._turn = sorted(self._positions), 0
        self._count_backlog()
        if self.shuffle is not None:
            if self._unit is None:
                self._unit = ShuffleUnit(job.token, *self.shuffle, batch_size=self.batch_size,
                                         poll_s=min(self.poll_s, READ_POLL_S))
            positions = self._positions
            self._unit.start_round(job.round, job.rank, job.world_size, job.round_store(),
                                   lambda block: self._shuffle_read(positions, block))

    def _shuffle_read(self, positions: dict[int, int], block: bool) -> Run | None:
        """The unit's reader (its own thread): the next batch of one of this worker's partitions
        (the unit's local queue holds batches of one partition; its ``take_runs`` joins them)."""
        picked, self._turn = self.reader.next_records(positions, self._turn, self.poll_s if block else 0.0, runs=1)
        if picked is None:
            return None
        partition, after, records = picked[0]
        self._took(positions, partition, after, pack_id(records[-1].id), len(records))
        return picked[0]

    def close(self) -> None:
        """Stop the background threads and close the shuffle unit's sockets (once the loop ends)."""
        if self._unit is not None:
            self._unit.close()
            self._unit = None
        self._ahead.close()
        self._ahead_key = None
        if self._counter is not None:
            self._counter.shutdown(wait=False, cancel_futures=True)
        self._counter = None
        self._counting = None

    def _trim(self, committed: dict[int, int]) -> None:
        """``--trim-after-commit``: delete this worker's partitions' records up to the committed
        position the master last reported (never past it: those may still be trained again)."""
        for p, pos in committed.items():
            if p in self._positions and pos > self._trimmed.get(p, 0):
                self.source.trim(p, unpack_id(pos))
                self._trimmed[p] = pos

    def _count_backlog(self) -> None:
        """A new round's partitions: count what waits after their positions once, in the
        background (``lag`` may walk the stream: seconds for a backlog of millions, which must
        not stall the round); ``_lag`` then follows it from the records appended since, O(1)."""
        positions = dict(self._positions)
        self._taken = {}

        def count() -> tuple[dict[int, int], dict[int, int]]:
            # the count first, then the appended total: records arriving in between are then
            # left out of both, never counted twice (which would keep a drained job from stopping)
            lag = {p: self.reader.uncommitted(p, pos) for p, pos in positions.items()}
            return lag, {p: self.source.appended(p) for p in positions}

        if self._counter is None:  # its own thread: the read-ahead must not wait behind a count
            self._counter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-stream-count")
        self._counting = self._counter.submit(count)

    def _lag(self) -> tuple[dict[int, int], dict[int, int], dict[int, int]] | None:
        """Records waiting after what this worker has read, per partition it reads, and the
        arrival time (ms, from the id) of the oldest of them, per partition where one waits; with
        global shuffling, plus what waits in its local queue; and the records ever appended to
        each (the master's arrival rate); None while the round's first count runs."""
        if self._counting is not None:
            if not self._counting.done():
                return None
            try:
                self._backlog0, self._appended0 = self._counting.result()
            except Exception as exc:  # the stream unavailable: count again at the next call
                log.debug("worker %d: counting the backlog failed: %s", self.job.worker_id, exc)
                self._count_backlog()
                return None
            self._counting = None
        lag: dict[int, int] = {}
        oldest: dict[int, int] = {}
        appended: dict[int, int] = {}
        for p, pos in self._positions.items():
            appended[p] = self.source.appended(p)
            arrived = appended[p] - self._appended0.get(p, 0)
            lag[p] = max(0, self._backlog0.get(p, 0) + arrived - self._taken.get(p, 0))
            if lag[p]:
                _, head = self.reader.read_partition(p, pos, limit=1)  # past the ranges committed ahead
                if head:
                    oldest[p] = parse_id(head[0].id)[0]  # a Redis id's first part: its arrival, ms
        if self._unit is not None:  # read, not trained: what waits in the local queue (forwarded too)
            queued, queued_oldest = self._unit.waiting()
            for p, n in queued.items():
                lag[p] = lag.get(p, 0) + n
            for p, ms in queued_oldest.items():
                oldest[p] = min(oldest.get(p, ms), ms)
        return lag, oldest, appended
