"""A stream job's data position: per partition, the last committed record (issue 18).

The stream counterpart of the shard table (``tidal.master.shards``). A record counts as consumed
only when the step that trained it is committed (DESIGN.md 4): ``commit`` moves a partition's
position to the last record of a committed range, and only if the range was read right after
the position (``after == committed``): a range that skips or repeats records is a protocol bug,
refused like a shard commit that does not continue its prefix. Ids are packed integers
(``tidal.api.streams``); 0 is "nothing committed yet".

Partitions are assigned to the members of each round, round-robin in rank order (``assign``);
every worker reads its partitions after their committed positions, so a killed worker's
uncommitted records are read again by whoever gets its partitions next. Positions are rebuilt
from the journal's ledger (``restore``, ``rollback``): a stream ledger row is ``(partition,
first, last, step, worker)``.

Pure state: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable

from tidal.master.shards import CommittedRange, ShardConflictError


class StreamTable:
    def __init__(self) -> None:
        self.positions: dict[int, int] = {}  # partition -> packed id of its last committed record
        self.partitions: set[int] = set()  # every partition a worker has seen
        self.records = 0  # records committed, over every partition (journaled with the meta)

    def discover(self, partitions: Iterable[int]) -> bool:
        """Partitions a worker sees; whether any is new (the next round assigns it)."""
        new = set(partitions) - self.partitions
        self.partitions |= new
        return bool(new)

    def assign(self, members: list[int]) -> dict[int, dict[int, int]]:
        """Each member's partitions (round-robin over the sorted partitions, in rank order) and
        their committed positions."""
        out: dict[int, dict[int, int]] = {w: {} for w in members}
        if not members:
            return out
        for i, p in enumerate(sorted(self.partitions)):
            out[members[i % len(members)]][p] = self.positions.get(p, 0)
        return out

    def commit(self, partition: int, after: int, first: int, last: int, samples: int = 0) -> bool:
        """Records ``first..last`` of ``partition``, read after ``after``, are consumed. False if
        they already were (idempotent).

        Raises:
            ShardConflictError: the range does not continue the partition's committed position.
        """
        at = self.positions.get(partition, 0)
        if last <= at:
            return False
        if after != at or not after < first <= last:
            raise ShardConflictError(f"records ({after}, {first}..{last}] of partition {partition} do not continue "
                                     f"its committed position {at}")
        self.positions[partition] = last
        self.partitions.add(partition)
        self.records += samples
        return True

    def is_committed(self, partition: int, last: int) -> bool:
        return last <= self.positions.get(partition, 0)

    def restore(self, rows: Iterable[CommittedRange]) -> None:
        """Positions from the journal's ledger rows (a restarted master, or a rollback)."""
        self.positions.clear()
        for row in rows:
            self.positions[row.epoch] = max(self.positions.get(row.epoch, 0), row.end)
            self.partitions.add(row.epoch)
