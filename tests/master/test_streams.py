"""A stream job's positions (tidal.master.streams) and its packed record ids (tidal.api.streams)."""

from __future__ import annotations

import pytest

from tidal.api import ConfigError
from tidal.api.streams import SEQ_BITS, pack_id, parse_id, unpack_id
from tidal.master.shards import CommittedRange, ShardConflictError
from tidal.master.streams import StreamTable


def test_packed_ids_keep_the_order_of_ids_and_round_trip() -> None:
    ids = ["0-0", "0-1", "9-5", "10-0", "1795407700856-0", "1795407700856-171", "1795407700857-0"]
    packed = [pack_id(i) for i in ids]
    assert packed == sorted(packed) and len(set(packed)) == len(ids)
    assert [unpack_id(p) for p in packed] == ids
    assert parse_id("10-0") > parse_id("9-5")
    for bad in ("", "12", "a-1", "1-b", "-1", "1--1", "\u0661-1"):  # the last: an Arabic-Indic digit (isdigit, not ASCII)
        with pytest.raises(ConfigError):
            pack_id(bad)
    with pytest.raises(ConfigError, match="does not fit"):
        pack_id(f"1-{1 << SEQ_BITS}")


def test_a_range_that_continues_the_partition_moves_its_position() -> None:
    t = StreamTable()
    assert t.commit(0, 0, 5, 9, samples=3)
    assert t.positions == {0: 9} and t.records == 3
    assert not t.commit(0, 0, 5, 9, samples=3)  # the same range again: idempotent
    with pytest.raises(ShardConflictError):
        t.commit(0, 9, 9, 12)  # first not after the position read after
    with pytest.raises(ShardConflictError):
        t.commit(0, 4, 5, 12)  # repeats (4, 9]
    assert t.commit(0, 9, 10, 12, samples=2) and t.records == 5 and t.is_committed(0, 12)
    assert t.commit(1, 0, 1, 1, samples=1) and t.positions == {0: 12, 1: 1}


def test_partitions_are_assigned_round_robin_with_their_positions() -> None:
    t = StreamTable()
    assert t.see([2, 0, 1]) == ([0, 1, 2], []) and t.see([1, 2, 0]) == ([], [])
    t.commit(1, 0, 3, 7)
    assert t.assign([5, 8]) == {5: {0: 0, 2: 0}, 8: {1: 7}}
    assert t.assign([4]) == {4: {0: 0, 1: 7, 2: 0}}
    assert t.assign([]) == {}


def test_a_partition_that_disappears_is_not_assigned_and_keeps_its_position() -> None:
    t = StreamTable()
    t.see([0, 1, 2])
    t.commit(1, 0, 3, 7)
    assert t.see([0, 2]) == ([], [1]) and t.assign([5, 8]) == {5: {0: 0}, 8: {2: 0}}
    assert t.commit(1, 7, 8, 9)  # a range of it forwarded before it went, trained after: still committed
    assert t.partitions == {0, 2} and t.positions[1] == 9
    assert t.see([]) == ([], []) and t.partitions == {0, 2}  # an empty view changes nothing
    assert t.see([0, 1, 2]) == ([1], []) and t.assign([4]) == {4: {0: 0, 1: 9, 2: 0}}  # back, after its position


def test_positions_are_rebuilt_from_the_journal_rows() -> None:
    t = StreamTable()
    t.restore([CommittedRange(0, 1, 4, 0, 0), CommittedRange(1, 2, 6, 0, 1), CommittedRange(0, 5, 9, 1, 0)])
    assert t.positions == {0: 9, 1: 6}
    t.restore([CommittedRange(0, 1, 4, 0, 0)])  # a rollback to step 0
    assert t.positions == {0: 4}


def test_ranges_committed_beyond_a_gap_wait_until_it_closes() -> None:
    # global shuffling: (10, 20] forwarded and trained after (20, 30] of the same partition
    t = StreamTable()
    assert t.commit(0, 0, 1, 10, samples=4)
    assert t.commit(0, 20, 21, 30, samples=3)  # beyond the gap (10, 20]
    assert t.positions == {0: 10} and t.ahead == {0: {20: 30}} and t.skips([0]) == {0: [[20, 30]]}
    assert t.is_committed(0, 30) and not t.is_committed(0, 20)
    assert not t.commit(0, 20, 21, 30, samples=3)  # the same range again: idempotent
    assert t.commit(0, 35, 36, 40) and t.skips([0, 1]) == {0: [[20, 30], [35, 40]]}
    for overlapping in [(25, 26, 33), (15, 16, 22), (5, 6, 12), (18, 19, 50)]:
        with pytest.raises(ShardConflictError):
            t.commit(0, *overlapping)
    assert t.commit(0, 10, 11, 20, samples=2)  # the gap closes: the position passes (20, 30] too
    assert t.positions == {0: 30} and t.ahead == {0: {35: 40}} and t.records == 9
    assert t.commit(0, 30, 31, 35)
    assert t.positions == {0: 40} and t.ahead == {} and t.skips([0]) == {}


def test_positions_and_ranges_ahead_are_rebuilt_from_rows_that_carry_after() -> None:
    rows = [CommittedRange(0, 1, 10, 0, 0, 0), CommittedRange(0, 21, 30, 1, 1, 20),
            CommittedRange(0, 11, 20, 2, 0, 10), CommittedRange(0, 41, 50, 2, 1, 40)]
    t = StreamTable()
    t.restore(rows)
    assert t.positions == {0: 30} and t.ahead == {0: {40: 50}}
    t.restore([r for r in rows if r.step <= 1])  # a rollback to step 1: (20, 30] is beyond a gap again
    assert t.positions == {0: 10} and t.ahead == {0: {20: 30}}
    # rows journaled before ranges carried ``after`` continue the one before them
    t.restore([CommittedRange(0, 1, 4, 0, 0), CommittedRange(0, 5, 9, 1, 0)])
    assert t.positions == {0: 9} and t.ahead == {}
