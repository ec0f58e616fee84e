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


def test_a_range_commits_only_if_it_continues_the_partition() -> None:
    t = StreamTable()
    assert t.commit(0, 0, 5, 9, samples=3)
    assert t.positions == {0: 9} and t.records == 3
    assert not t.commit(0, 0, 5, 9, samples=3)  # the same range again: idempotent
    with pytest.raises(ShardConflictError):
        t.commit(0, 12, 14, 20)  # skips (9, 12]
    with pytest.raises(ShardConflictError):
        t.commit(0, 9, 9, 12)  # first not after the position read after
    assert t.commit(0, 9, 10, 12, samples=2) and t.records == 5 and t.is_committed(0, 12)
    assert t.commit(1, 0, 1, 1, samples=1) and t.partitions == {0, 1}


def test_partitions_are_assigned_round_robin_with_their_positions() -> None:
    t = StreamTable()
    assert t.discover([2, 0, 1]) and not t.discover([1])
    t.commit(1, 0, 3, 7)
    assert t.assign([5, 8]) == {5: {0: 0, 2: 0}, 8: {1: 7}}
    assert t.assign([4]) == {4: {0: 0, 1: 7, 2: 0}}
    assert t.assign([]) == {}


def test_positions_are_rebuilt_from_the_journal_rows() -> None:
    t = StreamTable()
    t.restore([CommittedRange(0, 1, 4, 0, 0), CommittedRange(1, 2, 6, 0, 1), CommittedRange(0, 5, 9, 1, 0)])
    assert t.positions == {0: 9, 1: 6} and t.partitions == {0, 1}
    t.restore([CommittedRange(0, 1, 4, 0, 0)])  # a rollback to step 0
    assert t.positions == {0: 4}
