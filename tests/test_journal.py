"""The master's journal: one contract suite, run against every implementation.

``JournalContract`` holds the behaviour every journal must have; each implementation subclasses
it with its own ``make_journal``. SQLite-only properties (a file that outlives the process,
``create=False``) follow at the end.
"""

from __future__ import annotations

import sqlite3
import time
from array import array
from pathlib import Path
from typing import Any

import pytest

from tidal.api import ConfigError
from tidal.master.journal import Journal, MemoryJournal, SqliteJournal
from tidal.master.shards import CommittedRange, ShardEntry, ShardState

pytestmark = pytest.mark.speed_free


class Boom(Exception):
    pass


def entry(epoch: int, start: int, end: int, **kw: Any) -> ShardEntry:
    kw.setdefault("done_to", start)
    return ShardEntry(epoch, start, end, **kw)


def key(e: ShardEntry) -> tuple:
    return (e.epoch, e.start, e.end, e.done_to, e.state, e.worker, e.batch_size, e.order)


def shards_of(j: Journal) -> list[tuple]:
    return sorted(key(e) for e in j.load_shards())


class JournalContract:
    """Behaviour every Journal implementation must have. Subclasses provide ``make_journal``."""

    def make_journal(self, tmp_path: Path) -> Journal:
        raise NotImplementedError

    @pytest.fixture
    def journal(self, tmp_path: Path) -> Any:
        j = self.make_journal(tmp_path)
        yield j
        j.close()

    # ------------------------------------------------------------------ meta
    @pytest.mark.parametrize(
        "value",
        [0, -7, 2**62, 1.5, "text ünïcode", True, [1, "a", None], {"a": {"b": [1, 2]}, "n": None}, {}],
    )
    def test_meta_round_trip(self, journal: Journal, value: Any) -> None:
        journal.put_meta("k", value)
        assert journal.get_meta("k") == value

    def test_meta_missing_key_gives_the_default(self, journal: Journal) -> None:
        assert journal.get_meta("nope") is None
        assert journal.get_meta("nope", {"d": 1}) == {"d": 1}

    def test_meta_overwrite_and_independent_keys(self, journal: Journal) -> None:
        journal.put_meta("a", 1)
        journal.put_meta("b", 2)
        journal.put_meta("a", {"x": 3})
        assert journal.get_meta("a") == {"x": 3} and journal.get_meta("b") == 2

    def test_meta_value_is_a_copy(self, journal: Journal) -> None:
        value = {"members": [0, 1]}
        journal.put_meta("state", value)
        value["members"].append(2)
        assert journal.get_meta("state") == {"members": [0, 1]}
        journal.get_meta("state")["members"].append(9)
        assert journal.get_meta("state") == {"members": [0, 1]}

    def test_tuples_come_back_as_lists(self, journal: Journal) -> None:
        journal.put_meta("t", (1, 2))
        assert journal.get_meta("t") == [1, 2]

    # ------------------------------------------------------------------ shards
    def test_shards_start_empty(self, journal: Journal) -> None:
        assert journal.load_shards() == []
        journal.save_shards([])
        assert journal.load_shards() == []

    def test_shard_save_load_round_trip(self, journal: Journal) -> None:
        rows = [
            entry(0, 0, 16),
            entry(0, 16, 32, done_to=24, state=ShardState.DOING, worker=3, batch_size=2, order=1.5),
            entry(1, 0, 16, done_to=16, state=ShardState.DONE, batch_size=4, order=7.0),
            entry(2**40, 2**50, 2**50 + 1, order=0.25),
        ]
        journal.save_shards(rows)
        loaded = journal.load_shards()
        assert sorted(key(e) for e in loaded) == sorted(key(e) for e in rows)
        assert all(isinstance(e.state, ShardState) for e in loaded)

    def test_saving_a_shard_again_replaces_it(self, journal: Journal) -> None:
        e = entry(0, 0, 16, state=ShardState.DOING, worker=1)
        journal.save_shards([e, entry(0, 16, 32)])
        e.done_to, e.state, e.worker = 16, ShardState.DONE, None
        journal.save_shards([e])
        assert shards_of(journal) == sorted([key(e), key(entry(0, 16, 32))])

    def test_saved_shards_are_snapshots(self, journal: Journal) -> None:
        e = entry(0, 0, 16)
        journal.save_shards([e])
        e.done_to = 8  # the live entry changes; the journal keeps what was saved
        (loaded,) = journal.load_shards()
        assert loaded.done_to == 0
        loaded.done_to = 4
        assert journal.load_shards()[0].done_to == 0

    # ------------------------------------------------------------------ ledger
    def test_ledger_keeps_append_order(self, journal: Journal) -> None:
        assert journal.load_ledger() == []
        a = [CommittedRange(0, 32, 40, 5, 1), CommittedRange(0, 0, 8, 5, 0)]
        b = [CommittedRange(1, 8, 16, 6, 0)]
        journal.append_ledger(a)
        journal.append_ledger([])
        journal.append_ledger(b)
        journal.append_ledger([a[0]])  # append-only: a duplicate row is kept, not merged
        assert journal.load_ledger() == [*a, *b, a[0]]

    def test_truncating_the_ledger_keeps_the_earlier_steps_in_order(self, journal: Journal) -> None:
        rows = [CommittedRange(0, 0, 8, 1, 0), CommittedRange(0, 8, 16, 2, 1), CommittedRange(0, 16, 24, 3, 0)]
        journal.append_ledger(rows[:2])
        journal.append_ledger(rows[2:])
        journal.append_ledger([CommittedRange(1, 0, 8, 4, 1)])
        with journal.transaction():
            journal.truncate_ledger(2)
        assert journal.load_ledger() == rows[:2]
        journal.append_ledger([CommittedRange(0, 16, 24, 3, 1)])  # the steps after it are trained again
        assert journal.load_ledger() == [*rows[:2], CommittedRange(0, 16, 24, 3, 1)]
        journal.truncate_ledger(-1)
        assert journal.load_ledger() == []

    def test_a_failed_transaction_keeps_the_ledger_whole(self, journal: Journal) -> None:
        journal.append_ledger([CommittedRange(0, 0, 8, 1, 0), CommittedRange(0, 8, 16, 2, 0)])
        with pytest.raises(RuntimeError), journal.transaction():
            journal.truncate_ledger(1)
            raise RuntimeError("boom")
        assert len(journal.load_ledger()) == 2

    # ------------------------------------------------------------------ workers
    def test_worker_rows(self, journal: Journal) -> None:
        assert journal.load_workers() == {}
        r0 = {"state": "active", "pid": 10, "create_time": 1.25, "exit_code": None, "ever_active": True}
        r1 = {"state": "launching", "pid": 0, "history": [[0.0, "launching"]]}
        journal.save_worker(0, r0)
        journal.save_worker(1, r1)
        journal.save_worker(0, {**r0, "state": "failed", "exit_code": -9})
        loaded = journal.load_workers()
        assert loaded == {0: {**r0, "state": "failed", "exit_code": -9}, 1: r1}
        assert all(isinstance(k, int) for k in loaded)

    # ------------------------------------------------------------------ transactions
    def test_transaction_commits_everything_together(self, journal: Journal) -> None:
        with journal.transaction():
            journal.put_meta("round", 3)
            journal.save_shards([entry(0, 0, 8)])
            journal.append_ledger([CommittedRange(0, 0, 8, 0, 0)])
            journal.save_worker(0, {"state": "active"})
        assert journal.get_meta("round") == 3
        assert shards_of(journal) == [key(entry(0, 0, 8))]
        assert journal.load_ledger() == [CommittedRange(0, 0, 8, 0, 0)]
        assert journal.load_workers() == {0: {"state": "active"}}

    def test_exception_in_transaction_keeps_nothing_of_it(self, journal: Journal) -> None:
        journal.put_meta("round", 1)
        journal.save_shards([entry(0, 0, 8)])
        journal.append_ledger([CommittedRange(0, 0, 4, 0, 0)])
        journal.save_worker(0, {"state": "joined"})
        with pytest.raises(Boom), journal.transaction():
            journal.put_meta("round", 2)
            journal.put_meta("new", "x")
            journal.save_shards([entry(0, 0, 8, done_to=8, state=ShardState.DONE), entry(0, 8, 16)])
            journal.append_ledger([CommittedRange(0, 4, 8, 1, 0)])
            journal.save_worker(0, {"state": "active"})
            journal.save_worker(1, {"state": "joined"})
            raise Boom
        assert journal.get_meta("round") == 1 and journal.get_meta("new") is None
        assert shards_of(journal) == [key(entry(0, 0, 8))]
        assert journal.load_ledger() == [CommittedRange(0, 0, 4, 0, 0)]
        assert journal.load_workers() == {0: {"state": "joined"}}

    def test_journal_is_usable_after_a_failed_transaction(self, journal: Journal) -> None:
        with pytest.raises(Boom), journal.transaction():
            journal.put_meta("a", 1)
            raise Boom
        with journal.transaction():
            journal.put_meta("a", 2)
        journal.put_meta("b", 3)
        assert (journal.get_meta("a"), journal.get_meta("b")) == (2, 3)
        with pytest.raises(Boom), journal.transaction():
            journal.put_meta("b", 4)
            raise Boom
        assert journal.get_meta("b") == 3

    def test_nested_transaction_joins_the_outer_one(self, journal: Journal) -> None:
        with journal.transaction():
            journal.put_meta("outer", 1)
            with journal.transaction():
                journal.put_meta("inner", 2)
                journal.append_ledger([CommittedRange(0, 0, 1, 0, 0)])
            journal.put_meta("after", 3)
        assert [journal.get_meta(k) for k in ("outer", "inner", "after")] == [1, 2, 3]
        assert journal.load_ledger() == [CommittedRange(0, 0, 1, 0, 0)]

    def test_exception_out_of_a_nested_transaction_discards_outer_and_inner(self, journal: Journal) -> None:
        with pytest.raises(Boom), journal.transaction():
            journal.put_meta("outer", 1)
            with journal.transaction():
                journal.put_meta("inner", 2)
                journal.save_worker(5, {"state": "active"})
            with journal.transaction():
                journal.append_ledger([CommittedRange(0, 0, 1, 0, 0)])
                raise Boom
        assert journal.get_meta("outer") is None and journal.get_meta("inner") is None
        assert journal.load_workers() == {} and journal.load_ledger() == []
        with journal.transaction():  # the nesting depth was reset
            journal.put_meta("later", 1)
        with pytest.raises(Boom), journal.transaction():
            journal.put_meta("later", 2)
            raise Boom
        assert journal.get_meta("later") == 1

    def test_base_exceptions_roll_back_too(self, journal: Journal) -> None:
        with pytest.raises(KeyboardInterrupt), journal.transaction():
            journal.put_meta("k", 1)
            raise KeyboardInterrupt
        assert journal.get_meta("k") is None


class TestMemoryJournal(JournalContract):
    def make_journal(self, tmp_path: Path) -> Journal:
        return MemoryJournal()


class TestSqliteJournal(JournalContract):
    def make_journal(self, tmp_path: Path) -> Journal:
        return SqliteJournal(tmp_path / "journal.sqlite")


# ----------------------------------------------------------------------------- SQLite only
def _fill(j: SqliteJournal) -> None:
    with j.transaction():
        j.put_meta("spec", {"job_id": "abc", "argv": ["python", "x.py"]})
        j.save_shards([entry(0, 0, 8, done_to=4, state=ShardState.DOING, worker=2, order=0.5)])
        j.append_ledger([CommittedRange(0, 0, 4, 0, 2), CommittedRange(0, 4, 6, 1, 2)])
        j.save_worker(2, {"state": "active", "pid": 123})


def test_sqlite_journal_survives_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    j = SqliteJournal(path)
    _fill(j)
    j.close()
    again = SqliteJournal(path, create=False)
    try:
        assert again.get_meta("spec") == {"job_id": "abc", "argv": ["python", "x.py"]}
        assert shards_of(again) == [key(entry(0, 0, 8, done_to=4, state=ShardState.DOING, worker=2, order=0.5))]
        assert again.load_ledger() == [CommittedRange(0, 0, 4, 0, 2), CommittedRange(0, 4, 6, 1, 2)]
        assert again.load_workers() == {2: {"state": "active", "pid": 123}}
        again.append_ledger([CommittedRange(1, 0, 1, 2, 2)])  # appends after the old rows
        assert again.load_ledger()[-1] == CommittedRange(1, 0, 1, 2, 2)
    finally:
        again.close()


def test_sqlite_uncommitted_transaction_is_invisible_to_another_connection(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    writer = SqliteJournal(path)
    reader = SqliteJournal(path, create=False)
    try:
        with writer.transaction():
            writer.put_meta("round", 4)
            writer.append_ledger([CommittedRange(0, 0, 1, 0, 0)])
            assert reader.get_meta("round") is None and reader.load_ledger() == []
        assert reader.get_meta("round") == 4 and len(reader.load_ledger()) == 1
    finally:
        writer.close()
        reader.close()


def test_sqlite_rolled_back_transaction_is_not_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    j = SqliteJournal(path)
    j.put_meta("round", 1)
    with pytest.raises(Boom), j.transaction():
        j.put_meta("round", 2)
        raise Boom
    j.close()
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("SELECT value FROM meta WHERE key = 'round'").fetchall() == [("1",)]
    finally:
        raw.close()


def test_sqlite_uses_wal(tmp_path: Path) -> None:
    j = SqliteJournal(tmp_path / "j.sqlite")
    try:
        assert j._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        j.close()


def test_create_false_on_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.sqlite"
    with pytest.raises(ConfigError, match=r"nope\.sqlite does not exist"):
        SqliteJournal(missing, create=False)
    assert not missing.exists()  # and it was not created


def test_create_false_on_a_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        SqliteJournal(tmp_path, create=False)


def test_journal_in_a_missing_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot open journal"):
        SqliteJournal(tmp_path / "no" / "such" / "dir" / "j.sqlite")


def test_a_file_that_is_not_a_database_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(b"this is not a sqlite database, just some text\n" * 100)
    with pytest.raises(ConfigError, match="cannot open journal"):
        SqliteJournal(path, create=False)


def test_sqlite_checkpoints_the_log_in_the_background(tmp_path: Path) -> None:
    """Commits only append to the write-ahead log; the checkpointer thread copies it back."""
    path = tmp_path / "j.sqlite"
    j = SqliteJournal(path, checkpoint_s=0.05)
    ranges = [CommittedRange(0, i, i + 1, i, 0) for i in range(5000)]
    j.append_ledger(ranges)
    db_size = path.stat().st_size
    deadline = time.monotonic() + 10
    while path.stat().st_size == db_size and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.stat().st_size > db_size  # the ledger reached the database file while open
    j.close()
    assert not (tmp_path / "j.sqlite-wal").exists() or (tmp_path / "j.sqlite-wal").stat().st_size == 0
    with sqlite3.connect(path) as db:  # another reader, without the log, sees everything
        assert db.execute("SELECT count(*) FROM ledger").fetchone() == (1,)
    reopened = SqliteJournal(path, create=False)
    assert reopened.load_ledger() == ranges
    reopened.close()


def test_sqlite_ledger_row_of_a_broken_size_is_a_config_error(tmp_path: Path) -> None:
    j = SqliteJournal(tmp_path / "j.sqlite")
    j._db.execute("INSERT INTO ledger (ranges) VALUES (?)", (b"\0" * 41,))
    with pytest.raises(ConfigError, match="whole number of ranges"):
        j.load_ledger()
    j.close()


def test_stream_ranges_keep_after_and_rows_of_five_fields_still_load(tmp_path: Path) -> None:
    j = SqliteJournal(tmp_path / "j.sqlite")
    rows = [CommittedRange(0, 21, 30, 1, 1, 20), CommittedRange(2, 2**62, 2**62 + 5, 2, 0, 2**61)]
    j.append_ledger(rows)
    old = array("q", [1, 0, 8, 0, 3])  # a blob written before ranges carried ``after``
    j._db.execute("INSERT INTO ledger (ranges) VALUES (?)", (old.tobytes(),))
    assert j.load_ledger() == [*rows, CommittedRange(1, 0, 8, 0, 3, 0)]
    j.close()


def test_a_journal_with_a_ledger_of_another_format_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:
        db.execute('CREATE TABLE ledger (seq INTEGER PRIMARY KEY, epoch INTEGER, start INTEGER, "end" INTEGER)')
    with pytest.raises(ConfigError, match="ledger of another format"):
        SqliteJournal(path, create=False)
