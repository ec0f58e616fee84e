"""ShardManager: the shard state machine, lease order, prefix commits, release, stragglers, resume.

Pure state, no I/O: every test drives a real ShardManager directly.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal.api import ConfigError, PermanentError, Shard
from tidal.api.sharding import shard_starts
from tidal.master.shards import (
    ALLOWED_TRANSITIONS,
    CommittedRange,
    DatasetConfig,
    ShardConflictError,
    ShardEntry,
    ShardManager,
    ShardState,
)

pytestmark = pytest.mark.speed_free

S = ShardState


def make(size: int = 100, batch: int = 4, per_shard: int = 5, shuffle: bool = False, seed: int = 0) -> ShardManager:
    m = ShardManager()
    m.configure(DatasetConfig(size, batch, per_shard, shuffle, seed))
    return m


def state_of(m: ShardManager, epoch: int, start: int) -> ShardState:
    (entry,) = [e for e in m.entries() if e.epoch == epoch and e.start == start]
    return entry.state


def drain(m: ShardManager, epoch: int, worker: int = 0, factor: float = 1.0) -> list[Shard]:
    """Lease until the epoch is empty (without committing)."""
    out = []
    while (shard := m.lease(worker, epoch, factor)) is not None:
        out.append(shard)
        assert len(out) < 10_000
    return out


def copy_entries(m: ShardManager) -> list[ShardEntry]:
    """What a journal would hand back: fresh objects, not the live ones."""
    return [dataclasses.replace(e) for e in m.entries()]


# ----------------------------------------------------------------------------- transition table
def test_transition_table_is_the_documented_one() -> None:
    assert ALLOWED_TRANSITIONS[S.TODO] == {S.DOING, S.DONE}
    assert ALLOWED_TRANSITIONS[S.DOING] == {S.TODO, S.DONE}
    assert ALLOWED_TRANSITIONS[S.DONE] == frozenset()


@pytest.mark.parametrize(
    ("old", "new"),
    [(S.TODO, S.DOING), (S.TODO, S.DONE), (S.DOING, S.TODO), (S.DOING, S.DONE)]
    + [(s, s) for s in ShardState],
)
def test_allowed_entry_moves(old: ShardState, new: ShardState) -> None:
    entry = ShardEntry(0, 0, 10, 0, state=old)
    entry.move(new)
    assert entry.state is new


@pytest.mark.parametrize("new", [S.TODO, S.DOING])
def test_done_is_final(new: ShardState) -> None:
    entry = ShardEntry(0, 0, 10, 10, state=S.DONE)
    with pytest.raises(PermanentError, match="done -> "):
        entry.move(new)
    assert entry.state is S.DONE


def test_manager_walks_todo_doing_done() -> None:
    m = make(size=40, batch=4, per_shard=5)  # shards [0, 20), [20, 40)
    assert m.entries() == []  # an epoch's table is created on its first use
    shard = m.lease(7, 0)
    assert shard == Shard(epoch=0, start=0, end=20, batch_size=4)
    assert state_of(m, 0, 0) is S.DOING and state_of(m, 0, 20) is S.TODO
    (entry,) = [e for e in m.entries() if e.start == 0]
    assert entry.worker == 7
    for start in range(0, 20, 4):
        assert m.commit(0, start, start + 4) is True
        assert state_of(m, 0, 0) is (S.DONE if start == 16 else S.DOING)
    assert entry.worker is None and entry.done_to == 20


def test_doing_goes_back_to_todo_on_release_and_done_stays_done() -> None:
    m = make(size=40, batch=4, per_shard=5)
    a = m.lease(1, 0)
    b = m.lease(2, 0)
    assert a is not None and b is not None
    m.commit(0, a.start, a.end)  # DOING -> DONE
    assert m.release() == 1  # only b was DOING
    assert state_of(m, 0, a.start) is S.DONE and state_of(m, 0, b.start) is S.TODO
    assert m.lease(3, 0) == b  # the DONE shard is never handed out again
    assert m.lease(3, 0) is None


def test_todo_shard_can_be_committed_to_done_without_a_lease() -> None:
    # TODO -> DONE: the source's records of a re-form are committed before every shard is released
    m = make(size=40, batch=4, per_shard=5)
    shard = m.lease(1, 0)
    assert shard is not None
    m.release()
    assert state_of(m, 0, 0) is S.TODO
    assert m.commit(0, 0, 20) is True
    assert state_of(m, 0, 0) is S.DONE
    assert [s.start for s in drain(m, 0)] == [20]


def test_lease_of_empty_epoch_returns_none_and_changes_nothing() -> None:
    m = make(size=8, batch=4, per_shard=1)
    assert [s.start for s in drain(m, 0)] == [0, 4]
    before = m.counts()
    assert m.lease(1, 0) is None
    assert m.counts() == before


# ----------------------------------------------------------------------------- configuration
def test_configure_fixes_the_dataset_and_rejects_a_mismatch() -> None:
    m = make(size=100, batch=4)
    m.configure(DatasetConfig(100, 4, 5, False, 0))  # the same again: fine
    with pytest.raises(ConfigError, match="dataset mismatch"):
        m.configure(DatasetConfig(101, 4, 5, False, 0))
    with pytest.raises(ConfigError, match="dataset mismatch"):
        m.configure(DatasetConfig(100, 8, 5, False, 0))
    assert m.config == DatasetConfig(100, 4, 5, False, 0)


@pytest.mark.parametrize("size", [0, -5])
def test_configure_rejects_an_empty_dataset(size: int) -> None:
    with pytest.raises(ConfigError, match="positive"):
        ShardManager().configure(DatasetConfig(size, 4, 5, False, 0))


def test_nothing_works_before_configure() -> None:
    m = ShardManager()
    with pytest.raises(ConfigError, match="no dataset"):
        m.lease(0, 0)
    with pytest.raises(ConfigError, match="no dataset"):
        m.commit(0, 0, 1)
    assert m.is_committed(0, 0, 1) is False
    assert m.counts() == [] and m.release() == 0


# ----------------------------------------------------------------------------- lease order
@pytest.mark.parametrize(
    ("size", "batch", "per_shard", "shuffle", "seed"),
    [(100, 4, 5, False, 0), (100, 4, 5, True, 0), (1003, 7, 3, True, 42), (5, 8, 2, True, 9), (1, 1, 1, False, 0)],
)
def test_lease_order_follows_shard_starts(size: int, batch: int, per_shard: int, shuffle: bool, seed: int) -> None:
    m = make(size, batch, per_shard, shuffle, seed)
    shard_size = batch * per_shard
    for epoch in (0, 1, 3):
        leased = drain(m, epoch, worker=epoch)
        want = shard_starts(size, shard_size, shuffle, seed, epoch)
        assert [s.start for s in leased] == want
        assert all(s.end == min(s.start + shard_size, size) and s.batch_size == batch for s in leased)
        assert all(s.epoch == epoch for s in leased)
        assert sorted((s.start, s.end) for s in leased)[-1][1] == size  # the last shard is clipped


def test_shuffled_epochs_have_different_orders() -> None:
    m = make(size=400, batch=4, per_shard=1, shuffle=True, seed=3)
    assert [s.start for s in drain(m, 0)] != [s.start for s in drain(m, 1)]


# ----------------------------------------------------------------------------- commits
def test_commit_must_continue_the_committed_prefix() -> None:
    m = make(size=40, batch=4, per_shard=5)
    m.lease(0, 0)
    with pytest.raises(ShardConflictError, match="does not continue"):
        m.commit(0, 4, 8)  # skips [0, 4)
    assert m.commit(0, 0, 4) is True
    with pytest.raises(ShardConflictError, match="does not continue"):
        m.commit(0, 2, 6)  # overlaps the committed prefix and goes beyond it
    with pytest.raises(ShardConflictError, match="does not continue"):
        m.commit(0, 8, 12)
    assert m.commit(0, 4, 8) is True
    assert m.is_committed(0, 0, 8) and not m.is_committed(0, 0, 9)


@pytest.mark.parametrize(("start", "end"), [(16, 24), (0, 21), (5, 5), (6, 2), (40, 44), (-1, 3)])
def test_commit_must_lie_inside_one_shard(start: int, end: int) -> None:
    m = make(size=40, batch=4, per_shard=5)
    m.lease(0, 0)
    if start == 16:
        m.commit(0, 0, 16)
    with pytest.raises(ShardConflictError):
        m.commit(0, start, end)


def test_commit_of_an_already_committed_range_is_idempotent() -> None:
    m = make(size=40, batch=4, per_shard=5)
    m.lease(0, 0)
    assert m.commit(0, 0, 8) is True
    m.dirty()
    before = m.counts()
    assert m.commit(0, 0, 8) is False
    assert m.commit(0, 4, 8) is False  # a sub-range of the prefix
    assert m.commit(0, 0, 4) is False
    assert m.counts() == before and m.dirty() == []
    assert m.commit(0, 8, 20) is True
    assert m.commit(0, 0, 20) is False  # whole shard, now DONE
    assert state_of(m, 0, 0) is S.DONE


def test_commits_are_per_epoch() -> None:
    m = make(size=40, batch=4, per_shard=5)
    m.lease(0, 0)
    m.lease(0, 1)
    assert m.commit(0, 0, 4) is True
    assert m.is_committed(0, 0, 4) and not m.is_committed(1, 0, 4)
    assert m.commit(1, 0, 4) is True
    assert not m.is_committed(2, 0, 4)  # an epoch never touched


# ----------------------------------------------------------------------------- release
def test_release_puts_doing_shards_back_at_the_head_from_done_to() -> None:
    m = make(size=100, batch=4, per_shard=5)  # 5 shards of 20
    a, b, c = m.lease(1, 0), m.lease(2, 0), m.lease(1, 0)
    assert [s.start for s in (a, b, c)] == [0, 20, 40]
    m.commit(0, 0, 8)
    m.commit(0, 40, 44)
    assert m.release(worker=1) == 2
    assert state_of(m, 0, 20) is S.DOING  # worker 2's lease is untouched
    # worker 1's shards come first, in their original order, from their first uncommitted index
    assert m.lease(5, 0) == Shard(epoch=0, start=8, end=20, batch_size=4)
    assert m.lease(5, 0) == Shard(epoch=0, start=44, end=60, batch_size=4)
    assert m.lease(5, 0) == Shard(epoch=0, start=60, end=80, batch_size=4)
    assert m.release() == 4  # worker 5's three and worker 2's one
    assert [(s.start, s.end) for s in drain(m, 0)] == [(8, 20), (20, 40), (44, 60), (60, 80), (80, 100)]


def test_release_of_an_unknown_worker_releases_nothing() -> None:
    m = make()
    m.lease(1, 0)
    assert m.release(worker=99) == 0
    assert m.counts()[0][1:4] == (4, 1, 0)


def test_release_covers_every_epoch() -> None:
    m = make(size=40, batch=4, per_shard=5)
    m.lease(1, 0)
    m.lease(1, 2)
    assert m.release(1) == 2
    assert m.lease(1, 0).start == 0 and m.lease(1, 2).start == 0  # type: ignore[union-attr]


def test_a_released_lease_is_handed_out_again_with_the_committed_part_excluded() -> None:
    m = make(size=20, batch=4, per_shard=5)
    m.lease(1, 0)
    m.commit(0, 0, 12)
    m.release()
    assert m.lease(2, 0) == Shard(epoch=0, start=12, end=20, batch_size=4)
    m.commit(0, 12, 20)
    assert m.counts() == [(0, 0, 0, 1, 20, 20)]


# ----------------------------------------------------------------------------- stragglers
def test_straggler_lease_splits_the_shard_and_scales_the_batch() -> None:
    m = make(size=40, batch=4, per_shard=5)  # shards of 20
    slow = m.lease(9, 0, size_factor=0.5)
    assert slow == Shard(epoch=0, start=0, end=10, batch_size=2)
    assert m.counts() == [(0, 2, 1, 0, 0, 40)]  # 3 shards now
    # the tail of the split shard is next, at the normal batch size
    assert m.lease(1, 0) == Shard(epoch=0, start=10, end=20, batch_size=4)
    assert m.lease(1, 0) == Shard(epoch=0, start=20, end=40, batch_size=4)
    for start in range(0, 10, 2):
        assert m.commit(0, start, start + 2)
    assert state_of(m, 0, 0) is S.DONE and state_of(m, 0, 10) is S.DOING
    with pytest.raises(ShardConflictError):
        m.commit(0, 8, 12)  # across the cut: two shards now


def test_straggler_split_starts_at_done_to() -> None:
    m = make(size=20, batch=4, per_shard=5)
    m.lease(1, 0)
    m.commit(0, 0, 8)
    m.release()
    # 12 samples left: half of them, in batches of 2
    assert m.lease(9, 0, size_factor=0.5) == Shard(epoch=0, start=8, end=14, batch_size=2)
    assert m.lease(1, 0) == Shard(epoch=0, start=14, end=20, batch_size=4)


def test_tiny_size_factor_still_leases_at_least_one_batch() -> None:
    m = make(size=20, batch=4, per_shard=5)
    shard = m.lease(9, 0, size_factor=0.01)
    assert shard == Shard(epoch=0, start=0, end=1, batch_size=1)


def test_straggler_lease_of_a_small_remainder_does_not_split() -> None:
    m = make(size=22, batch=4, per_shard=5)  # shards [0, 20), [20, 22)
    assert m.lease(1, 0) is not None
    shard = m.lease(9, 0, size_factor=0.5)
    assert shard == Shard(epoch=0, start=20, end=22, batch_size=2)  # one small batch: nothing to cut
    assert m.counts() == [(0, 0, 2, 0, 0, 22)]


def test_split_shards_are_released_in_order() -> None:
    m = make(size=40, batch=4, per_shard=5)
    m.lease(9, 0, size_factor=0.5)  # [0, 10)
    m.lease(1, 0)  # [10, 20)
    m.lease(2, 0)  # [20, 40)
    assert m.release() == 3
    assert [(s.start, s.end) for s in drain(m, 0)] == [(0, 10), (10, 20), (20, 40)]


# ----------------------------------------------------------------------------- views
def test_counts_per_epoch() -> None:
    m = make(size=50, batch=5, per_shard=2)  # 5 shards of 10
    assert m.counts() == []
    m.lease(1, 0)
    m.lease(2, 0)
    m.commit(0, 0, 10)
    m.commit(0, 10, 15)
    m.lease(1, 2)
    assert m.counts() == [(0, 3, 1, 1, 15, 50), (2, 4, 1, 0, 0, 50)]


def test_dirty_returns_each_change_once() -> None:
    m = make(size=40, batch=4, per_shard=5)
    m.lease(1, 0)
    first = m.dirty()
    assert sorted(e.start for e in first) == [0, 20]  # the new epoch's table
    assert m.dirty() == []
    m.commit(0, 0, 4)
    assert m.dirty() == []  # progress inside a shard: the ledger has it, restore replays it
    m.commit(0, 4, 20)
    (changed,) = m.dirty()
    assert (changed.start, changed.done_to, changed.state) == (0, 20, S.DONE)
    m.lease(2, 0, size_factor=0.5)
    assert sorted(e.start for e in m.dirty()) == [20, 30]


# ----------------------------------------------------------------------------- restore
def _scenario(m: ShardManager) -> None:
    for epoch in (0, 1):
        for w in range(3):
            m.lease(w, epoch)
    m.commit(0, m.entries()[0].start, m.entries()[0].start + 4)
    doing = [e for e in m.entries() if e.state is S.DOING and e.epoch == 0]
    m.commit(0, doing[1].done_to, doing[1].end)
    m.release(worker=1)
    m.lease(4, 1, size_factor=0.5)


@pytest.mark.parametrize("shuffle", [False, True])
def test_restore_reproduces_the_next_leases(shuffle: bool) -> None:
    m = make(size=200, batch=4, per_shard=5, shuffle=shuffle, seed=11)
    _scenario(m)
    r = ShardManager()
    r.restore(m.config, copy_entries(m))
    assert r.counts() == m.counts()
    assert r.dirty() == []
    for epoch in (0, 1):
        assert drain(r, epoch, worker=5) == drain(m, epoch, worker=5)
    assert r.release() == m.release()
    for epoch in (0, 1, 2):
        assert drain(r, epoch, worker=6) == drain(m, epoch, worker=6)


def test_restore_reproduces_the_next_leases_after_repeated_straggler_splits() -> None:
    m = make(size=64, batch=4, per_shard=4)  # shards of 16
    s = m.lease(9, 0, size_factor=0.5)  # [0, 8), tail [8, 16) order 0.5
    m.commit(0, s.start, s.end)  # type: ignore[union-attr]
    s = m.lease(9, 0, size_factor=0.5)  # [8, 12), tail [12, 16) order 1.0 == next shard's
    m.commit(0, s.start, s.end)  # type: ignore[union-attr]
    m.lease(9, 0, size_factor=0.5)  # [12, 14), tail [14, 16) order 1.5 > next shard's
    r = ShardManager()
    r.restore(m.config, copy_entries(m))
    assert drain(r, 0, worker=1) == drain(m, 0, worker=1)


class _JournalMirror:
    """What the master journals: the rows ``dirty()`` hands out, and every committed range."""

    def __init__(self, m: ShardManager) -> None:
        self.m = m
        self.rows: dict[tuple[int, int], ShardEntry] = {}
        self.ledger: list[CommittedRange] = []

    def commit(self, epoch: int, start: int, end: int) -> None:
        if self.m.commit(epoch, start, end):
            self.ledger.append(CommittedRange(epoch, start, end, 0, 0))
        self.flush()

    def flush(self) -> None:
        for e in self.m.dirty():
            self.rows[(e.epoch, e.start)] = dataclasses.replace(e)

    def restored(self) -> ShardManager:
        r = ShardManager()
        r.restore(self.m.config, [dataclasses.replace(e) for e in self.rows.values()], self.ledger)
        return r


@pytest.mark.parametrize("shuffle", [False, True])
def test_restore_from_journaled_rows_and_the_ledger(shuffle: bool) -> None:
    """Rows journaled before some commits, plus the ledger, rebuild the live table exactly."""
    m = make(size=200, batch=4, per_shard=5, shuffle=shuffle, seed=3)
    j = _JournalMirror(m)
    leased = [m.lease(w, 0) for w in range(3)]
    j.flush()
    for s in leased:
        assert s is not None
        j.commit(0, s.start, s.start + 4)  # progress only: no row rewritten
        j.commit(0, s.start + 4, s.start + 8)
    j.commit(0, leased[0].start + 8, leased[0].end)  # type: ignore[union-attr]  # completes: DONE row
    m.release(worker=1)
    j.flush()
    r = j.restored()
    assert r.counts() == m.counts()
    assert r.samples_done == m.samples_done == sum(c[4] for c in m.counts())
    assert sorted((e.epoch, e.start, e.end, e.done_to, e.state) for e in r.entries()) == sorted(
        (e.epoch, e.start, e.end, e.done_to, e.state) for e in m.entries())
    assert drain(r, 0, worker=5) == drain(m, 0, worker=5)
    assert r.release() == m.release()


def test_restore_completes_a_shard_whose_last_commit_only_the_ledger_has() -> None:
    m = make(size=40, batch=4, per_shard=5)  # shards of 20
    s = m.lease(1, 0)
    assert s is not None
    r = ShardManager()
    r.restore(m.config, copy_entries(m), [CommittedRange(0, 0, 8, 1, 1), CommittedRange(0, 8, 20, 2, 1)])
    assert r.counts()[0][3] == 1 and r.is_committed(0, 0, 20)
    assert [x.start for x in drain(r, 0, worker=2)] == [20]


def test_restore_keeps_committed_prefixes() -> None:
    m = make(size=40, batch=4, per_shard=5)
    m.lease(1, 0)
    m.commit(0, 0, 8)
    r = ShardManager()
    r.restore(m.config, copy_entries(m))
    assert r.is_committed(0, 0, 8) and not r.is_committed(0, 8, 12)
    assert r.commit(0, 0, 8) is False
    with pytest.raises(ShardConflictError):
        r.commit(0, 12, 16)
    assert r.commit(0, 8, 12) is True


@pytest.mark.parametrize("shuffle", [False, True])
def test_rollback_returns_to_the_table_of_the_checkpointed_step(shuffle: bool) -> None:
    """Two workers train steps 0..9 (a straggler split among them); a rollback to the rows of
    steps <= 5 leaves committed exactly what steps 0..5 trained, nothing leased: the next leases
    hand out every other sample, those steps 6..9 had trained included, once."""
    m = make(size=96, batch=4, per_shard=3, shuffle=shuffle, seed=1)  # 8 shards of 12
    ledger: list[CommittedRange] = []
    held: dict[int, list[int]] = {}
    for step in range(10):
        for worker in (0, 1):
            h = held.get(worker)
            if not h or h[0] >= h[1]:
                shard = m.lease(worker, 0, 0.5 if step == 3 and worker == 1 else 1.0)
                assert shard is not None
                held[worker] = h = [shard.start, shard.end, shard.batch_size]
            start, end = h[0], min(h[0] + h[2], h[1])
            assert m.commit(0, start, end)
            ledger.append(CommittedRange(0, start, end, step, worker))
            h[0] = end
    m.dirty()
    kept = [r for r in ledger if r.step <= 5]
    m.rollback(kept)
    assert len(m.dirty()) == len(m.entries())  # the whole table goes to the journal again
    assert m.samples_done == sum(r.end - r.start for r in kept)
    assert all(e.state is not S.DOING and e.worker is None for e in m.entries())
    assert all(m.is_committed(r.epoch, r.start, r.end) for r in kept)
    voided = [r for r in ledger if r.step > 5]
    assert voided and not any(m.is_committed(r.epoch, r.start, r.end) for r in voided)
    assert m.unconsumed() == {0: 96 - m.samples_done}
    handed = sorted((x.start, x.end) for x in drain(m, 0, worker=7))
    trained = sorted((r.start, r.end) for r in kept)
    spans = sorted(handed + trained)
    assert spans[0][0] == 0 and spans[-1][1] == 96
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # no gap, no overlap


# ----------------------------------------------------------------------------- property
@dataclasses.dataclass
class _Holder:
    shard: Shard
    pos: int


def _run_random_schedule(seed: int, size: int, batch: int, per_shard: int, shuffle: bool, workers: int,
                         epochs: int, steps: int) -> None:
    rnd = random.Random(seed)
    m = make(size, batch, per_shard, shuffle, seed)
    held: dict[int, _Holder] = {}
    committed: dict[int, list[tuple[int, int]]] = {e: [] for e in range(epochs)}
    history: list[tuple[int, int, int]] = []

    def commit(epoch: int, start: int, end: int) -> None:
        if m.commit(epoch, start, end):
            committed[epoch].append((start, end))
            history.append((epoch, start, end))

    for _ in range(steps):
        w = rnd.randrange(workers)
        op = rnd.random()
        if w not in held and op < 0.5:
            shard = m.lease(w, rnd.randrange(epochs), rnd.choice([1.0, 1.0, 0.5, 0.3]))
            if shard is not None:
                held[w] = _Holder(shard, shard.start)
        elif w in held and op < 0.85:
            h = held[w]
            end = min(h.pos + h.shard.batch_size * rnd.randint(1, 2), h.shard.end)
            commit(h.shard.epoch, h.pos, end)
            h.pos = end
            if end == h.shard.end:
                del held[w]
        elif op < 0.92 and history:
            e, s, t = rnd.choice(history)  # a retried commit of a range already committed
            assert m.commit(e, s, t) is False
        elif op < 0.97:
            m.release(worker=w)
            held.pop(w, None)
        else:
            m.release()
            held.clear()
    # drain: every epoch must still hand out exactly what is missing
    m.release()
    for epoch in range(epochs):
        while (shard := m.lease(0, epoch, rnd.choice([1.0, 0.5]))) is not None:
            for start in range(shard.start, shard.end, shard.batch_size):
                commit(epoch, start, min(start + shard.batch_size, shard.end))
        ranges = sorted(committed[epoch])
        if ranges:
            assert ranges[0][0] == 0
            for (_, a_end), (b_start, _) in itertools.pairwise(ranges):
                assert a_end == b_start, f"epoch {epoch}: gap or overlap at {a_end}/{b_start}"
            assert ranges[-1][1] == size
        assert sum(e - s for s, e in ranges) == size
        assert m.is_committed(epoch, 0, 1)
        assert m.samples_done == sum(c[4] for c in m.counts())  # the running count agrees with a scan
    assert [c[1:] for c in m.counts()] == [(0, 0, c[3], size, size) for c in m.counts()]
    assert all(e.state is S.DONE and e.done_to == e.end for e in m.entries())


@pytest.mark.parametrize("seed", range(12))
def test_random_schedules_commit_every_sample_exactly_once(seed: int) -> None:
    rnd = random.Random(1000 + seed)
    _run_random_schedule(
        seed, size=rnd.randint(1, 300), batch=rnd.randint(1, 8), per_shard=rnd.randint(1, 6),
        shuffle=rnd.random() < 0.5, workers=rnd.randint(1, 5), epochs=rnd.randint(1, 3), steps=400,
    )


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**32),
    size=st.integers(1, 200),
    batch=st.integers(1, 6),
    per_shard=st.integers(1, 5),
    shuffle=st.booleans(),
    workers=st.integers(1, 4),
    epochs=st.integers(1, 3),
)
def test_exactly_once_property(seed: int, size: int, batch: int, per_shard: int, shuffle: bool, workers: int,
                               epochs: int) -> None:
    _run_random_schedule(seed, size, batch, per_shard, shuffle, workers, epochs, steps=150)


def test_unconsumed_counts_pending_ranges_of_an_epoch_nobody_leased() -> None:
    # logical workers commit without leasing: the first finish may come before any epoch table
    m = ShardManager()
    m.configure(DatasetConfig(100, 10, 1, True, 3, epochs=2))
    everything = [(e, s, s + 10) for e in range(2) for s in range(0, 100, 10)]
    assert m.unconsumed() == {0: 100, 1: 100}
    assert m.unconsumed(everything) == {}
    assert m.unconsumed(everything[:-1]) == {1: 10}
