"""A stream job's data position: per partition, the last committed record (issue 18).

The stream counterpart of the shard table (``tidal.master.shards``). A record counts as consumed
only when the step that trained it is committed (DESIGN.md 4): ``commit`` moves a partition's
position to the last record of a range read right after it (``after == position``); a range
that repeats committed records is a protocol bug, refused like a shard commit that overlaps
its prefix. Ids are packed integers (``tidal.api.streams``); 0 is "nothing committed yet".

With global shuffling (``tidal.worker.shuffle``) a worker forwards some of its partitions' ranges
to others, which may train them after a later range of the same partition: a range read after a
record that is not committed yet waits ``ahead`` of the position until the ranges before it are
committed, and the position then moves past all of them. ``after`` is what keeps this exact:
a range is the partition's records in ``(after, last]``, so ranges chain without gaps or
overlaps whatever order they are committed in.

Partitions are assigned to the members of each round, round-robin in rank order (``assign``);
every worker reads its partitions after their committed positions, skipping the ranges committed
ahead (``skips``), so a killed worker's uncommitted records (and those forwarded to it and not
trained) are read again by whoever gets their partitions next. Positions are rebuilt from the
journal's ledger (``restore``, ``rollback``): a stream ledger row is ``(partition, first, last,
step, worker, after)``.

Pure state: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable

from tidal.master.shards import CommittedRange, ShardConflictError


class StreamTable:
    def __init__(self) -> None:
        self.positions: dict[int, int] = {}  # partition -> packed id of its last committed record (a prefix)
        # partition -> after -> last: ranges committed beyond a gap in the prefix (global shuffling:
        # a forwarded range trained before an earlier one); folded into the prefix once it closes
        self.ahead: dict[int, dict[int, int]] = {}
        self.partitions: set[int] = set()  # the partitions the latest worker's view holds
        self.records = 0  # records committed, over every partition (journaled with the meta)

    def see(self, partitions: Iterable[int]) -> tuple[list[int], list[int]]:
        """The partitions a worker sees now (it lists them before every rendezvous): they are the
        ones the next round assigns. Returns those new and those gone. A partition that is gone
        keeps its position (and the ranges committed ahead of it): if it comes back, it is read
        after them. An empty view changes nothing (a stream with no partition trains nothing)."""
        seen = set(partitions)
        if not seen:
            return [], []
        new, gone = sorted(seen - self.partitions), sorted(self.partitions - seen)
        self.partitions = seen
        return new, gone

    def assign(self, members: list[int]) -> dict[int, dict[int, int]]:
        """Each member's partitions (round-robin over the sorted partitions, in rank order) and
        their committed positions."""
        out: dict[int, dict[int, int]] = {w: {} for w in members}
        if not members:
            return out
        for i, p in enumerate(sorted(self.partitions)):
            out[members[i % len(members)]][p] = self.positions.get(p, 0)
        return out

    def skips(self, partitions: Iterable[int]) -> dict[int, list[list[int]]]:
        """The committed ranges beyond each partition's position, ``[after, last]`` in id order:
        a reader reads up to ``after``, then goes on after ``last``."""
        return {p: [[a, last] for a, last in sorted(self.ahead[p].items())] for p in partitions if self.ahead.get(p)}

    def commit(self, partition: int, after: int, first: int, last: int, samples: int = 0) -> bool:
        """Records ``first..last`` of ``partition``, read after ``after``, are consumed. False if
        they already were (idempotent). A range that continues the position moves it (and folds
        in the ranges committed beyond it that now continue it); one that starts beyond it
        waits in ``ahead`` until the gap closes.

        Raises:
            ShardConflictError: the range overlaps records already committed, or its ids are not
                in order.
        """
        at = self.positions.get(partition, 0)
        if last <= at:
            return False
        if not after < first <= last:
            raise ShardConflictError(f"records ({after}, {first}..{last}] of partition {partition} are not in order")
        beyond = self.ahead.setdefault(partition, {})
        if beyond.get(after) == last:
            return False
        if after < at or any(a < last and after < b for a, b in beyond.items()):
            raise ShardConflictError(f"records ({after}, {first}..{last}] of partition {partition} overlap what "
                                     f"is committed (position {at}, beyond it {sorted(beyond.items())})")
        if after == at:
            while last in beyond:  # the gap before ranges committed earlier has closed
                last = beyond.pop(last)
            self.positions[partition] = last
        else:
            beyond[after] = last
        if not beyond:
            del self.ahead[partition]
        self.records += samples
        return True

    def is_committed(self, partition: int, last: int) -> bool:
        """Whether the range ending at ``last`` is committed (in the prefix or beyond it)."""
        return last <= self.positions.get(partition, 0) or last in self.ahead.get(partition, {}).values()

    def restore(self, rows: Iterable[CommittedRange]) -> None:
        """Positions from the journal's ledger rows (a restarted master, or a rollback)."""
        self.positions.clear()
        self.ahead.clear()
        previous: dict[int, int] = {}
        for row in sorted(rows, key=lambda r: (r.epoch, r.start)):
            # a row journaled before ranges carried ``after`` (0) continues the one before it
            after = row.after if row.after or not previous.get(row.epoch) else previous[row.epoch]
            previous[row.epoch] = row.end
            self.commit(row.epoch, after, row.start, row.end)
