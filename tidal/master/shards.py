"""The data shard manager: dataset indices cut into shards, leased to workers, committed by step.

DLRover section 5.2 ("Dynamic data sharding") and DLRover-RM section 5.1: the dataset is not
partitioned by the number of workers; it is cut into many small shards of index ranges held in
a TODO queue. A worker leases one (TODO -> DOING(worker)), reads it in batches, and the range a
batch covered is committed only when the optimizer step that used it is committed. On a new
membership round every DOING shard goes back to the front of TODO from its first uncommitted
index, so nothing is lost and nothing is repeated; unlike DLRover, a shard is never dropped
after some number of retries.

Stragglers get smaller shards and smaller batches (DLRover-RM 5.1, "Handling Stragglers"):
``lease(..., size_factor=f)`` with f < 1 splits the head shard and scales its batch size, so
the slow worker's per-step work matches its peers' (gradients are weighted by sample count, so
uneven batches still average exactly).

Pure state: no I/O, no clock. The master journals what ``dirty()`` returns.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from tidal.api import ConfigError, PermanentError, Shard
from tidal.api.sharding import shard_starts

MAX_SHARDS_PER_EPOCH = 1_000_000


class ShardState(StrEnum):
    TODO = "todo"
    DOING = "doing"
    DONE = "done"


ALLOWED_TRANSITIONS: dict[ShardState, frozenset[ShardState]] = {
    ShardState.TODO: frozenset({ShardState.DOING, ShardState.DONE}),
    ShardState.DOING: frozenset({ShardState.TODO, ShardState.DONE}),
    ShardState.DONE: frozenset(),
}


class ShardConflictError(PermanentError):
    """A commit that does not continue its shard's committed prefix (a protocol bug, never data)."""


@dataclass
class ShardEntry:
    """One shard: indices ``[start, end)``; ``[start, done_to)`` is committed."""

    epoch: int
    start: int
    end: int
    done_to: int
    state: ShardState = ShardState.TODO
    worker: int | None = None
    batch_size: int = 1
    order: float = 0.0  # position in the TODO queue (smaller first); journaled for resume

    def move(self, new: ShardState) -> None:
        if new is self.state:
            return
        if new not in ALLOWED_TRANSITIONS[self.state]:
            raise PermanentError(f"shard {self.epoch}:{self.start} cannot go {self.state.value} -> {new.value}")
        self.state = new


@dataclass(frozen=True)
class DatasetConfig:
    size: int
    batch_size: int
    batches_per_shard: int
    shuffle: bool
    seed: int
    epochs: int | None = None  # how many epochs the job trains (None: a client that did not say)

    @property
    def shard_size(self) -> int:
        return self.batch_size * self.batches_per_shard


class CommittedRange(NamedTuple):
    """One ledger entry: ``[start, end)`` of ``epoch`` consumed by ``worker`` in step ``step``.

    In a stream job (``tidal.master.streams``) ``epoch`` is the partition, ``start`` and ``end``
    the first and last packed record ids (both included) and ``after`` the id the range was read
    after: the range is exactly the partition's records in ``(after, end]``. Dataset jobs leave
    ``after`` 0.
    """

    epoch: int
    start: int
    end: int
    step: int
    worker: int
    after: int = 0


@dataclass
class _Epoch:
    number: int
    shards: dict[int, ShardEntry] = field(default_factory=dict)
    starts: list[int] = field(default_factory=list)  # sorted keys of ``shards``
    todo: deque[int] = field(default_factory=deque)

    def add(self, entry: ShardEntry) -> None:
        self.shards[entry.start] = entry
        bisect.insort(self.starts, entry.start)

    def containing(self, index: int) -> ShardEntry | None:
        pos = bisect.bisect_right(self.starts, index) - 1
        if pos < 0:
            return None
        entry = self.shards[self.starts[pos]]
        return entry if entry.start <= index < entry.end else None


class ShardManager:
    """Shard tables for every epoch of one job's dataset."""

    def __init__(self) -> None:
        self.config: DatasetConfig | None = None
        self._epochs: dict[int, _Epoch] = {}
        self._dirty: dict[tuple[int, int], ShardEntry] = {}
        # samples in committed ranges over every epoch, kept as commits come (the planner reads it
        # every second: a scan of up to a million shards per epoch would not do)
        self.samples_done = 0

    # ----------------------------------------------------------------- configuration
    def configure(self, config: DatasetConfig) -> None:
        """Fix the dataset on the first lease; later leases must agree with it."""
        if self.config is None:
            if config.size <= 0:
                raise ConfigError("dataset size must be positive")
            shards = -(-config.size // config.shard_size)
            if shards > MAX_SHARDS_PER_EPOCH:
                raise ConfigError(f"{shards} shards per epoch is over the limit of {MAX_SHARDS_PER_EPOCH}; "
                                  "use larger batches or more batches per shard")
            self.config = config
            return
        if config != self.config:
            raise ConfigError(f"dataset mismatch: this job has {self.config}, a worker asked for {config}")

    def _epoch(self, number: int) -> _Epoch:
        table = self._epochs.get(number)
        if table is not None:
            return table
        if self.config is None:
            raise ConfigError("no dataset configured yet")
        cfg = self.config
        table = _Epoch(number)
        for position, start in enumerate(shard_starts(cfg.size, cfg.shard_size, cfg.shuffle, cfg.seed, number)):
            end = min(start + cfg.shard_size, cfg.size)
            entry = ShardEntry(number, start, end, start, batch_size=cfg.batch_size, order=float(position))
            table.add(entry)
            table.todo.append(start)
            self._dirty[(number, start)] = entry
        self._epochs[number] = table
        return table

    # ----------------------------------------------------------------- transitions
    def lease(self, worker: int, epoch: int, size_factor: float = 1.0) -> Shard | None:
        """TODO -> DOING(worker). Returns None when the epoch has no TODO shard left."""
        table = self._epoch(epoch)
        assert self.config is not None
        while table.todo:
            entry = table.shards[table.todo.popleft()]
            if entry.state is not ShardState.TODO:
                continue
            batch = self.config.batch_size
            if size_factor < 1.0:
                batch = max(1, round(batch * size_factor))
                want = max(batch, round((entry.end - entry.done_to) * size_factor))
                cut = entry.done_to + want
                if cut < entry.end:
                    self._split(table, entry, cut)
            entry.move(ShardState.DOING)
            entry.worker = worker
            entry.batch_size = batch
            self._dirty[(epoch, entry.start)] = entry
            return Shard(epoch=epoch, start=entry.done_to, end=entry.end, batch_size=batch)
        return None

    def _split(self, table: _Epoch, entry: ShardEntry, cut: int) -> None:
        """Cut ``entry`` at ``cut``; the tail becomes a TODO shard at the head of the queue."""
        # the tail goes to the head of the queue: its order lies between the leased shard's and
        # the current head's, so a restarted master rebuilds the same queue
        head = table.shards[table.todo[0]].order if table.todo else entry.order + 1.0
        tail = ShardEntry(entry.epoch, cut, entry.end, cut, batch_size=entry.batch_size,
                          order=(entry.order + head) / 2)
        entry.end = cut
        table.add(tail)
        table.todo.appendleft(cut)
        self._dirty[(entry.epoch, entry.start)] = entry
        self._dirty[(tail.epoch, tail.start)] = tail

    def commit(self, epoch: int, start: int, end: int) -> bool:
        """Mark ``[start, end)`` consumed. Returns False if it was already committed (idempotent).

        Raises:
            ShardConflictError: the range is not the next uncommitted part of one shard.
        """
        table = self._epoch(epoch)
        entry = table.containing(start)
        if entry is None or end > entry.end or end <= start:
            raise ShardConflictError(f"range [{start}, {end}) of epoch {epoch} is not inside one shard")
        if end <= entry.done_to:
            return False
        if start != entry.done_to:
            raise ShardConflictError(
                f"range [{start}, {end}) of epoch {epoch} does not continue shard "
                f"[{entry.start}, {entry.end}) committed to {entry.done_to}"
            )
        self.samples_done += end - entry.done_to
        entry.done_to = end
        if end == entry.end:
            entry.move(ShardState.DONE)
            entry.worker = None
            # Progress inside a shard is not journaled here: the committed ranges go to the
            # ledger anyway, and ``restore`` replays them. Only the state change is.
            self._dirty[(epoch, entry.start)] = entry
        return True

    def is_committed(self, epoch: int, start: int, end: int) -> bool:
        table = self._epochs.get(epoch)
        entry = table.containing(start) if table else None
        return entry is not None and end <= entry.done_to

    def release(self, worker: int | None = None) -> int:
        """DOING -> TODO (front of the queue, from the first uncommitted index). Returns how many."""
        released = 0
        for table in self._epochs.values():
            back: list[ShardEntry] = []
            for entry in table.shards.values():
                if entry.state is ShardState.DOING and (worker is None or entry.worker == worker):
                    entry.move(ShardState.TODO)
                    entry.worker = None
                    back.append(entry)
                    self._dirty[(entry.epoch, entry.start)] = entry
            # Leases pop the queue in ``order``, so a DOING shard's order is below every queued
            # one: putting them back sorted keeps the queue sorted by order, which is what a
            # restarted master rebuilds.
            for entry in sorted(back, key=lambda e: e.order, reverse=True):
                table.todo.appendleft(entry.start)
            released += len(back)
        return released

    # ----------------------------------------------------------------- views
    def counts(self) -> list[tuple[int, int, int, int, int, int]]:
        """Per epoch: (epoch, todo, doing, done, samples_done, samples_total)."""
        out = []
        for number in sorted(self._epochs):
            table = self._epochs[number]
            by_state = {s: 0 for s in ShardState}
            done_samples = 0
            for entry in table.shards.values():
                by_state[entry.state] += 1
                done_samples += entry.done_to - entry.start
            total = self.config.size if self.config else 0
            out.append((number, by_state[ShardState.TODO], by_state[ShardState.DOING], by_state[ShardState.DONE], done_samples, total))
        return out

    def unconsumed(self, extra: Iterable[tuple[int, int, int]] = ()) -> dict[int, int]:
        """Samples not yet committed, per epoch that has any (DESIGN.md 4, "No false success").

        Every epoch the dataset declares counts (one nobody leased yet is wholly unconsumed);
        ``extra`` are ``(epoch, start, end)`` ranges to count as committed on top (a finishing
        worker's records of steps the master has not finalized yet), used only if they continue
        a shard's committed prefix, as a commit would.
        """
        out: dict[int, int] = {}
        for epoch, start, end in self.uncovered(extra):
            out[epoch] = out.get(epoch, 0) + end - start
        return out

    def uncovered(self, extra: Iterable[tuple[int, int, int]] = ()) -> Iterator[tuple[int, int, int]]:
        """The ``(epoch, start, end)`` ranges ``unconsumed`` counts, in shard order."""
        if self.config is None:
            return
        more: dict[int, dict[int, int]] = {}
        for epoch, start, end in extra:
            if end > start:
                ranges = more.setdefault(epoch, {})
                ranges[start] = max(end, ranges.get(start, end))
        last = max(self._epochs, default=-1) + 1
        epochs = self.config.epochs if self.config.epochs is not None else last
        for number in range(max(epochs, last)):
            ranges = more.get(number, {})
            if number not in self._epochs and not ranges:
                yield (number, 0, self.config.size)
                continue
            # an epoch nobody leased yet (logical workers commit without leasing): its table is
            # a pure function of the dataset, built here to place the ranges on its shards
            table = self._epoch(number)
            for shard_start in table.starts:
                entry = table.shards[shard_start]
                pos = entry.done_to
                while pos < entry.end and pos in ranges:
                    pos = min(ranges[pos], entry.end)
                if pos < entry.end:
                    yield (number, pos, entry.end)

    def entries(self) -> list[ShardEntry]:
        return [e for t in self._epochs.values() for e in t.shards.values()]

    def dirty(self) -> list[ShardEntry]:
        """Entries changed since the last call (for the journal)."""
        out = list(self._dirty.values())
        self._dirty.clear()
        return out

    # ----------------------------------------------------------------- resume
    def rollback(self, committed: Iterable[CommittedRange]) -> None:
        """Go back to the data position of a checkpoint: ``committed`` are the ledger rows of the
        steps the checkpoint's model includes, and they alone count as consumed. Every shard
        returns to TODO from the end of its committed prefix (DONE when whole), in queue order;
        every entry is dirty (the journal must have the whole table again).
        """
        entries = self.entries()
        for entry in entries:
            # the one transition back from DONE: those samples were trained by steps the model lost
            entry.done_to, entry.state, entry.worker = entry.start, ShardState.TODO, None
        self.restore(self.config, entries, committed)
        self._dirty = {(e.epoch, e.start): e for e in entries}

    def restore(self, config: DatasetConfig | None, entries: list[ShardEntry],
                committed: Iterable[CommittedRange] = ()) -> None:
        """Rebuild from journaled entries and the ledger of committed ranges (a restarted master).

        An entry's journaled ``done_to`` may lag: ``commit`` journals a shard only when it
        completes, and the ranges committed before that are in the ledger, which is replayed here.
        """
        self.config = config
        self._epochs.clear()
        entries = sorted(entries, key=lambda e: (e.epoch, e.order))
        for entry in entries:
            self._epochs.setdefault(entry.epoch, _Epoch(entry.epoch)).add(entry)
        for c in committed:
            table = self._epochs.get(c.epoch)
            found = table.containing(c.start) if table else None
            if found is not None and found.done_to < c.end <= found.end:
                found.done_to = c.end
        self.samples_done = sum(entry.done_to - entry.start for entry in entries)
        for entry in entries:
            if entry.done_to == entry.end and entry.state is not ShardState.DONE:
                entry.move(ShardState.DONE)
                entry.worker = None
            if entry.state is ShardState.TODO:
                self._epochs[entry.epoch].todo.append(entry.start)
        self._dirty.clear()
