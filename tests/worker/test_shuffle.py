"""Shuffle Units (tidal.worker.shuffle, Kale 3.5) in one process: real ZeroMQ sockets on
127.0.0.1, a real recorded stream (the file source). What is forwarded tiles the partition with
what is kept, a forwarded batch is never forwarded again, and a message that is not the job's,
of another round or of broken sizes is dropped."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from tidal.api import frames
from tidal.api.streams import pack_id, unpack_id
from tidal.data.api import StreamRecord
from tidal.data.streams.file import FileStreamSource
from tidal.worker.shuffle import Batch, ShuffleUnit

TOKEN = "secret-of-the-job"


class RoundStore:
    """The round's key-value store as the units use it (set, a blocking get); the real one is
    the master's (tidal.worker.store.MasterStore, tested with the master)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self.cond:
            self.values[key] = value.encode()
            self.cond.notify_all()

    def get(self, key: str) -> bytes:
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.values, 10)
            return self.values[key]


def decode(fields: list[dict[str, bytes]]) -> tuple[list[int], list[int]]:
    return [int(f["n"]) for f in fields], []


def reader(source: FileStreamSource, partition: int, batch: int) -> Any:
    position = [0]

    def read(block: bool) -> tuple[int, int, list[StreamRecord]] | None:
        records = source.read(partition, unpack_id(position[0]), batch, block_s=0.02 if block else 0.0)
        if not records:
            return None
        after, position[0] = position[0], pack_id(records[-1].id)
        return partition, after, records
    return read


@pytest.fixture
def units() -> Iterator[tuple[ShuffleUnit, ShuffleUnit]]:
    a = ShuffleUnit(TOKEN, lower=64, upper=128, batch_size=32, poll_s=0.01)
    b = ShuffleUnit(TOKEN, lower=64, upper=128, batch_size=32, poll_s=0.01)
    yield a, b
    a.close()
    b.close()


def drain(unit: ShuffleUnit, round_: int, into: list[Batch], stop: threading.Event, step_s: float) -> None:
    while not stop.is_set():
        batch = unit.take(round_, 0.05, 32)
        if batch is not None:
            into.append(batch)
            time.sleep(step_s)  # the step's training


def test_overflow_goes_to_the_idle_worker_and_every_record_is_taken_once(
        tmp_path: Path, units: tuple[ShuffleUnit, ShuffleUnit]) -> None:
    a, b = units
    source = FileStreamSource(f"file://{tmp_path}/clicks")
    source.append(0, [{"n": str(i).encode()} for i in range(3000)])
    source.append(1, [{"n": b"-1"}])  # b's partition: one record
    store = RoundStore()
    a.start_round(4, 0, 2, store, reader(source, 0, 32))
    b.start_round(4, 1, 2, store, reader(source, 1, 32))
    taken_a: list[Batch] = []
    taken_b: list[Batch] = []
    stop = threading.Event()
    threads = [threading.Thread(target=drain, args=(a, 4, taken_a, stop, 0.004)),
               threading.Thread(target=drain, args=(b, 4, taken_b, stop, 0.0))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(len(x.records) for x in taken_a + taken_b) < 3001 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    ranges = sorted((x.after, x.last) for x in taken_a + taken_b if x.partition == 0)
    position = 0
    for after, last in ranges:  # the batches tile the partition: no gap, no overlap
        assert after == position
        position = last
    assert unpack_id(position) == source.last_id(0)
    numbers = sorted(n for x in taken_a + taken_b if x.partition == 0 for n in decode([r.fields for r in x.records])[0])
    assert numbers == list(range(3000))
    forwarded = [x for x in taken_b if x.forwarded]
    assert forwarded and all(x.partition == 0 for x in forwarded)
    deadline = time.monotonic() + 5  # a sender counts a batch once its send returned: maybe after the take
    while a.forwarded_out < b.forwarded_in and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.forwarded_in == sum(len(x.records) for x in forwarded) == a.forwarded_out
    # never forwarded again: what b received it trains itself. Once its queue of received records
    # passes its upper threshold it may forward what it reads next, its own partition's one record
    back = [x for x in taken_a if x.forwarded]
    assert all(x.partition == 1 for x in back), back
    assert b.forwarded_out == sum(len(x.records) for x in back) <= 1
    source.close()


def test_a_read_past_the_upper_threshold_keeps_what_fits_and_forwards_the_rest(
        units: tuple[ShuffleUnit, ShuffleUnit]) -> None:
    """With somebody accepting, a queue never holds more than ``upper``: of a read of 50 records
    into an empty queue of upper 30, 30 stay and the next 20 go to the other worker, as the range
    after the last one kept (the two tile the read)."""
    a, b = units
    a.upper, a.lower = 30, 10
    records = [StreamRecord(0, f"1-{i}", {"n": str(i).encode()}) for i in range(1, 51)]
    fed = iter([(0, 0, records)] + [None] * 10**6)
    store = RoundStore()
    b.start_round(3, 1, 2, store, lambda block: None)
    deadline = time.monotonic() + 10
    a.start_round(3, 0, 2, store, lambda block: next(fed) if a._receivers() or time.monotonic() > deadline else None)
    kept = a.take(3, 5.0, 64)
    got = b.take(3, 5.0, 64)
    assert kept is not None and (kept.after, kept.last, len(kept.records)) == (0, pack_id("1-30"), 30)
    assert got is not None and got.forwarded and (got.after, got.last, len(got.records)) == \
        (pack_id("1-30"), pack_id("1-50"), 20)
    # the sender counts a batch once its send returned, which may be after the receiver took it
    deadline = time.monotonic() + 5
    while a.forwarded_out < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.forwarded_out == b.forwarded_in == 20 and a.queued == 0


def test_a_step_takes_what_reached_the_partition_while_the_reader_waited(tmp_path: Path) -> None:
    """The reader, caught up, waits for a step (here a whole second); a step that finds less than
    its batch queued has it read first, and trains the records that came meanwhile."""
    source = FileStreamSource(f"file://{tmp_path}/clicks")
    source.append(0, [{"n": str(i).encode()} for i in range(10)])
    unit = ShuffleUnit(TOKEN, lower=64, upper=128, batch_size=32, poll_s=1.0)
    try:
        unit.start_round(1, 0, 1, None, reader(source, 0, 32))
        deadline = time.monotonic() + 10
        while unit.queued < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # the reader has gone to wait for a step
        source.append(0, [{"n": str(i).encode()} for i in range(10, 15)])
        runs = unit.take_runs(1, 0.5, 32, 4)
        assert [n for b in runs for n in decode([r.fields for r in b.records])[0]] == list(range(15))
        assert unit.queued == 0
        # nothing new: the next step finds nothing, as before
        assert unit.take_runs(1, 0.1, 32, 4) == []
    finally:
        unit.close()
        source.close()


def test_a_short_read_has_the_reader_read_its_other_partitions_before_it_waits(tmp_path: Path) -> None:
    """After one partition's short read the reader reads the others at once (a sweep) and waits
    for a step (here a whole second) only once a read finds nothing: a second partition is not
    left unread for a wait while the queue holds a batch and no step asks for a top-up."""
    source = FileStreamSource(f"file://{tmp_path}/clicks")
    for p in (0, 1):
        source.append(p, [{"n": str(10 * p + i).encode()} for i in range(5)])
    reads = [reader(source, 0, 32), reader(source, 1, 32)]
    turn = [0]

    def read(block: bool) -> tuple[int, int, list[StreamRecord]] | None:
        for i in range(2):  # one partition's records a read, in turn (as PartitionReader, runs=1)
            got = reads[(turn[0] + i) % 2](False)
            if got is not None:
                turn[0] = (turn[0] + i + 1) % 2
                return got
        return None

    unit = ShuffleUnit(TOKEN, lower=64, upper=128, batch_size=32, poll_s=1.0)
    try:
        unit.start_round(1, 0, 1, None, read)
        deadline = time.monotonic() + 0.5  # well within the reader's wait
        while unit.queued < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert unit.queued == 10, "the second partition waited for the reader's wait"
        runs = unit.take_runs(1, 0.1, 32, 4)
        assert sorted(n for b in runs for n in decode([r.fields for r in b.records])[0]) == \
            [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    finally:
        unit.close()
        source.close()


def test_the_intake_spread_is_what_the_partitions_brought_between_steps(tmp_path: Path) -> None:
    """``intake_spread``: the coefficient of variation of the records read between two takes
    (what the queue model's ``spread`` is): 10 and 30 records in turn are a mean of 20 and a
    standard deviation of 10; not measured before ``INTAKE_MIN`` steps, nor in a new round."""
    from tidal.worker.shuffle import INTAKE_MIN

    source = FileStreamSource(f"file://{tmp_path}/clicks")
    unit = ShuffleUnit(TOKEN, lower=64, upper=128, batch_size=64, poll_s=0.01)
    try:
        unit.start_round(1, 0, 1, None, reader(source, 0, 64))
        n = 0
        for k in range(2 * INTAKE_MIN):
            if k < INTAKE_MIN or k % 2 == 0:  # an even count of steps: as many 30s as 10s
                assert unit.intake_spread() == (-1.0 if k < INTAKE_MIN else pytest.approx(0.5))
            amount = 10 if k % 2 else 30
            source.append(0, [{"n": str(n + i).encode()} for i in range(amount)])
            n += amount
            deadline = time.monotonic() + 10
            while unit.queued < amount and time.monotonic() < deadline:
                time.sleep(0.005)
            assert len([r for b in unit.take_runs(1, 1.0, 64, 4) for r in b.records]) == amount
        assert unit.intake_spread() == pytest.approx(0.5)
        unit.start_round(2, 0, 1, None, reader(source, 0, 64))
        assert unit.intake_spread() == -1.0
    finally:
        unit.close()
        source.close()


def test_messages_not_of_the_job_or_of_the_round_or_of_broken_sizes_are_dropped(
        units: tuple[ShuffleUnit, ShuffleUnit]) -> None:
    a, _ = units
    a.start_round(2, 0, 1, None, lambda block: None)
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(a.address)

    def batch(token: str = TOKEN, round_: int = 2, data: bytes = b"12", lengths: tuple[int, ...] = (1, 1),
              ids: tuple[int, ...] = (5, 6), after: int = 4) -> list[Any]:
        tensors = {"ids": torch.tensor(ids), "shape": torch.zeros(len(ids), dtype=torch.int32),
                   "lengths": torch.tensor(lengths), "data": torch.tensor(list(data), dtype=torch.uint8)}
        meta = {"kind": "batch", "token": token, "round": round_, "rank": 1, "partition": 3, "after": after,
                "names": [["n"]]}
        return frames.encode(tensors, meta=meta)

    for bad in [batch(token="guess"), batch(round_=1), batch(lengths=(1, 2)), batch(data=b"123"),
                batch(ids=(6, 5)), batch(after=5), [b"not json"]]:
        push.send_multipart(bad)
    push.send_multipart(batch())
    got = a.take(2, 5.0, 32)
    assert got is not None and got.forwarded and (got.after, got.last) == (4, 6)
    assert [r.fields for r in got.records] == [{"n": b"1"}, {"n": b"2"}]
    assert a.take(2, 0.3, 32) is None  # every other message was dropped
    push.close()


def test_a_full_queue_stops_accepting_until_it_falls_below_lower(units: tuple[ShuffleUnit, ShuffleUnit]) -> None:
    a, _ = units
    records = [StreamRecord(0, f"1-{i}", {"n": b"1"}) for i in range(1, 41)]
    fed = iter([(0, 0, records[:20]), (0, pack_id("1-20"), records[20:])] + [None] * 10**6)
    a.upper, a.lower = 30, 10
    a.start_round(1, 0, 1, None, lambda block: next(fed))
    deadline = time.monotonic() + 10
    while a.queued < 40 and time.monotonic() < deadline:  # nobody else accepts: it keeps both
        time.sleep(0.01)
    assert a.queued == 40 and not a.accepting
    assert a.take(1, 1, 20) is not None and not a.accepting  # 20 left: not below lower yet
    assert a.take(1, 1, 20) is not None and a.accepting


def test_a_reader_goes_past_the_ranges_committed_ahead_of_its_position(tmp_path: Path) -> None:
    from tidal.worker.stream_reader import PartitionReader

    source = FileStreamSource(f"file://{tmp_path}/clicks")
    ids = [pack_id(i) for i in source.append(0, [{"n": str(i).encode()} for i in range(10)])]
    reader = PartitionReader(source, batch_size=4)
    # committed ahead of the position (nothing): records 2-3 and 6-7 (as [after, last])
    reader.skips = {0: [[ids[1], ids[3]], [ids[5], ids[7]]]}
    read: list[int] = []
    position = 0
    while True:
        after, records = reader.read_partition(0, position)
        if not records:
            break
        assert after == position or (position, after) in [(ids[1], ids[3]), (ids[5], ids[7])]
        read += [int(r.fields["n"]) for r in records]
        position = pack_id(records[-1].id)
    assert read == [0, 1, 4, 5, 8, 9]
    source.close()


def test_small_batches_that_continue_each_other_are_taken_as_one(units: tuple[ShuffleUnit, ShuffleUnit]) -> None:
    a, _ = units
    rec = [StreamRecord(0, f"1-{i}", {"n": b"1"}) for i in range(1, 21)]
    other = [StreamRecord(1, "1-7", {"n": b"2"})]
    fed = iter([(0, 0, rec[:5]), (1, 0, other), (0, pack_id("1-5"), rec[5:10]), (0, pack_id("1-10"), rec[10:15]),
                (0, pack_id("1-15"), rec[15:])] + [None] * 10**6)
    a.start_round(1, 0, 1, None, lambda block: next(fed))
    deadline = time.monotonic() + 10
    while a.queued < 21 and time.monotonic() < deadline:
        time.sleep(0.01)
    # 5 + 5 records of partition 0 and 2 of the third batch, split to fill the step (skipping the
    # batch that did not fit left steps of a few records: RESULTS, Kale live, eighth run); not
    # partition 1's, which would be a second run
    first = a.take(1, 1, 12)
    assert first is not None and (first.partition, first.after, first.last, len(first.records)) == \
        (0, 0, pack_id("1-12"), 12)
    second = a.take(1, 1, 12)
    assert second is not None and second.partition == 1 and len(second.records) == 1
    third = a.take(1, 1, 12)  # the split batch's rest, then the last batch: every record once
    assert third is not None and (third.after, third.last, len(third.records)) == (pack_id("1-12"), pack_id("1-20"), 8)
    assert [r.id for r in first.records + third.records] == [f"1-{i}" for i in range(1, 21)] and a.queued == 0


def test_a_step_takes_several_partitions_runs_up_to_its_batch(units: tuple[ShuffleUnit, ShuffleUnit]) -> None:
    """``take_runs``: the queue's batches in order, each joined to the run it continues or
    starting a new one, while they fit the batch and the runs allowed."""
    a, _ = units
    p0 = [StreamRecord(0, f"1-{i}", {"n": b"0"}) for i in range(1, 9)]
    p1 = [StreamRecord(1, f"2-{i}", {"n": b"1"}) for i in range(1, 4)]
    p2 = [StreamRecord(2, f"3-{i}", {"n": b"2"}) for i in range(1, 3)]
    fed = iter([(0, 0, p0[:4]), (1, 0, p1), (0, pack_id("1-4"), p0[4:]), (2, 0, p2)] + [None] * 10**6)
    a.start_round(1, 0, 1, None, lambda block: next(fed))
    deadline = time.monotonic() + 10
    while a.queued < 17 and time.monotonic() < deadline:
        time.sleep(0.01)
    runs = a.take_runs(1, 1, 12, 2)  # 4 of p0, 3 of p1, 4 of p0 joined to the first; p2 is a third run
    assert [(r.partition, r.after, r.last, len(r.records)) for r in runs] == \
        [(0, 0, pack_id("1-8"), 8), (1, 0, pack_id("2-3"), 3)]
    assert a.queued == 2
    [rest] = a.take_runs(1, 1, 12, 2)
    assert (rest.partition, len(rest.records)) == (2, 2) and a.queued == 0
    assert a.take_runs(1, 0.05, 12, 2) == []


def test_a_step_takes_the_oldest_records_first_whatever_order_they_were_queued_in(
        units: tuple[ShuffleUnit, ShuffleUnit]) -> None:
    """A batch queued after others can hold older records (one forwarded here waited at its
    reader; a sweep reads the partitions in turn): a step that cannot take all takes the oldest,
    and a partition's batches stay in order."""
    a, _ = units
    young = [StreamRecord(0, f"5-{i}", {"n": b"0"}) for i in range(1, 9)]
    old = [StreamRecord(1, f"2-{i}", {"n": b"1"}) for i in range(1, 9)]
    fed = iter([(0, 0, young[:4]), (1, 0, old[:4]), (0, pack_id("5-4"), young[4:]), (1, pack_id("2-4"), old[4:])]
               + [None] * 10**6)
    a.start_round(1, 0, 1, None, lambda block: next(fed))
    deadline = time.monotonic() + 10
    while a.queued < 16 and time.monotonic() < deadline:
        time.sleep(0.01)
    runs = a.take_runs(1, 1, 10, 8)  # partition 1's 8 records, then partition 0's 2 oldest
    assert [(r.partition, r.after, r.last, len(r.records)) for r in runs] == \
        [(1, 0, pack_id("2-8"), 8), (0, 0, pack_id("5-2"), 2)]
    [rest] = a.take_runs(1, 1, 10, 8)
    assert (rest.partition, rest.after, rest.last, len(rest.records)) == (0, pack_id("5-2"), pack_id("5-8"), 6)
    assert a.queued == 0


@pytest.mark.parametrize("arrive", [[40, 16, 40, 32], [30]])
def test_a_worker_its_partitions_saturate_accepts_nothing_though_a_take_leaves_its_queue_short(
        arrive: list[int]) -> None:
    """A worker whose partitions bring about a batch a step holds few records for a moment after
    each take; once its last ``SATURATION_STEPS`` steps brought ``SATURATION_SHARE`` of a batch a
    step or more it must not accept then (others' records would take its own's place), though
    some of those steps found less than a batch queued, or none passed the upper threshold; once
    a step finds its queue empty it accepts again. Steps of 32 records; 40, 16, 40, 32 ... arrive
    (32 a step on average; the step after 16 finds 24), or 30 every step."""
    from tidal.worker.shuffle import SATURATION_SHARE, SATURATION_STEPS

    assert sum(arrive) / len(arrive) >= SATURATION_SHARE * 32
    lock = threading.Lock()
    pending: list[list[StreamRecord]] = []
    n = 0

    def read(block: bool) -> tuple[int, int, list[StreamRecord]] | None:
        with lock:
            if not pending:
                return None
            chunk = pending.pop(0)
        return 0, pack_id(f"1-{int(chunk[0].id.split('-')[1]) - 1}"), chunk

    unit = ShuffleUnit(TOKEN, lower=24, upper=32, batch_size=32, poll_s=0.01)
    try:
        unit.start_round(1, 0, 1, None, read)
        left = 0
        for k in range(SATURATION_STEPS + 4):
            brought = arrive[k % len(arrive)]
            with lock:
                pending.append([StreamRecord(0, f"1-{n + i + 1}", {"n": b"1"}) for i in range(brought)])
                n += brought
            deadline = time.monotonic() + 10
            while unit.queued < left + brought and time.monotonic() < deadline:
                time.sleep(0.005)
            took = len([r for b in unit.take_runs(1, 1.0, 32, 4) for r in b.records])
            assert took == min(32, left + brought)
            left = left + brought - took
            assert unit.queued == left < 24  # short, below lower
            assert unit.accepting == (k < SATURATION_STEPS - 1), k
        while left > 0:  # what is left, then nothing: a step finds its queue empty
            left -= len([r for b in unit.take_runs(1, 1.0, 32, 4) for r in b.records])
        assert not unit.take_runs(1, 0.1, 32, 4)
        assert unit.accepting
    finally:
        unit.close()


def test_a_partitions_overflow_goes_to_one_receiver_while_it_accepts(
        units: tuple[ShuffleUnit, ShuffleUnit]) -> None:
    """Eight reads past a full queue, with two workers accepting: every piece goes to the same
    one, where they continue each other and a step takes them as one range (picked at random for
    each piece, they continued each other nowhere)."""
    a, b = units
    c = ShuffleUnit(TOKEN, lower=64, upper=128, batch_size=32, poll_s=0.01)
    try:
        a.upper, a.lower = 30, 10
        records = [StreamRecord(0, f"1-{i}", {"n": str(i).encode()}) for i in range(1, 111)]
        chunks = [records[:30]] + [records[30 + 10 * k: 40 + 10 * k] for k in range(8)]
        fed = iter([(0, 0 if k == 0 else pack_id(records[19 + 10 * k].id), chunk) for k, chunk in enumerate(chunks)]
                   + [None] * 10**6)
        store = RoundStore()
        b.start_round(3, 1, 3, store, lambda block: None)
        c.start_round(3, 2, 3, store, lambda block: None)
        deadline = time.monotonic() + 10
        a.start_round(3, 0, 3, store,
                      lambda block: next(fed) if len(a._receivers()) == 2 or time.monotonic() > deadline else None)
        while a.forwarded_out < 80 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.forwarded_out == 80
        while b.forwarded_in + c.forwarded_in < 80 and time.monotonic() < deadline:
            time.sleep(0.01)
        receiver = b if b.forwarded_in else c
        assert receiver.forwarded_in == 80
        runs = receiver.take_runs(3, 1.0, 128, 1)
        assert [(r.after, r.last, len(r.records)) for r in runs] == [(pack_id("1-30"), pack_id("1-110"), 80)]
    finally:
        c.close()


def test_a_sender_forwards_no_more_than_a_receivers_credit_until_it_hears_again(
        tmp_path: Path, units: tuple[ShuffleUnit, ShuffleUnit]) -> None:
    """A reader catching up on a backlog reads faster than a receiver's "not accepting" travels:
    what one word of "accepting" lets through is the receiver's upper threshold (its credit), so
    a receiver that does not take holds at most that past its threshold; once it takes, its word
    renews the credit, and every record is still taken once."""
    a, b = units
    source = FileStreamSource(f"file://{tmp_path}/clicks")
    source.append(0, [{"n": str(i).encode()} for i in range(5000)])
    store = RoundStore()
    b.start_round(2, 1, 2, store, lambda block: None)
    a.start_round(2, 0, 2, store, reader(source, 0, 32))
    time.sleep(1.0)  # nobody takes: a holds its upper threshold, b what its credit let through
    assert 128 <= a.queued <= 128 + 32  # a whole read kept when a refusal came as it read
    assert 128 <= b.forwarded_in <= 128 + 128 + 32, b.forwarded_in  # its connect word may renew it once
    taken: list[Batch] = []
    stop = threading.Event()
    threads = [threading.Thread(target=drain, args=(u, 2, taken, stop, 0.002)) for u in (a, b)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(len(x.records) for x in taken) < 5000 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    numbers = sorted(n for x in taken for n in decode([r.fields for r in x.records])[0])
    assert numbers == list(range(5000))
    assert b.forwarded_in > 1000  # the credit was renewed as b took: the overflow went on to it
    source.close()
