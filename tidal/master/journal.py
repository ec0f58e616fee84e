"""The master's journal: what a restarted master needs to carry on (DESIGN.md section 4).

The master writes to the journal *before* it answers the request that changed the state:
membership round, worker table, shard table, finalized steps and the committed-range ledger.
``tidal master --resume JOURNAL`` rebuilds the master from it. Two implementations behind one
interface: SQLite (the default, WAL mode) and in-memory (for tests and for jobs that opt out);
both pass the same contract suite in tests/test_journal.py.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import sys
import threading
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from tidal.api import ConfigError
from tidal.master.api import JournalUnavailableError
from tidal.master.shards import CommittedRange, ShardEntry, ShardState

log = logging.getLogger(__name__)


class Journal(Protocol):
    """Durable master state. Writes inside ``transaction()`` become visible together.

    Every write raises ``JournalUnavailableError`` (and keeps nothing of the transaction) when
    the storage refuses it, e.g. a full disk; the master then pauses the job.
    """

    def transaction(self) -> Any:
        """Context manager grouping writes; on exception nothing of them is kept."""
        ...

    def put_meta(self, key: str, value: Any) -> None: ...

    def get_meta(self, key: str, default: Any = None) -> Any: ...

    def save_shards(self, entries: list[ShardEntry]) -> None: ...

    def load_shards(self) -> list[ShardEntry]: ...

    def append_ledger(self, rows: list[CommittedRange]) -> None: ...

    def load_ledger(self) -> list[CommittedRange]: ...

    def truncate_ledger(self, after_step: int) -> None:
        """Delete every ledger row of a step above ``after_step`` (a resume from the checkpoint of
        that step: those steps are no longer in the model's lineage)."""
        ...

    def save_worker(self, worker_id: int, row: dict[str, Any]) -> None: ...

    def load_workers(self) -> dict[int, dict[str, Any]]: ...

    def close(self) -> None: ...


class MemoryJournal:
    """A journal that lives as long as the process (tests, throwaway jobs)."""

    def __init__(self) -> None:
        self._meta: dict[str, str] = {}
        self._shards: dict[tuple[int, int], tuple] = {}
        self._ledger: list[CommittedRange] = []
        self._workers: dict[int, str] = {}
        self._pending: list[tuple[str, Any]] | None = None

    @contextmanager
    def transaction(self) -> Iterator[None]:
        if self._pending is not None:  # nested: join the outer transaction
            yield
            return
        self._pending = []
        try:
            yield
            for kind, payload in self._pending:
                self._apply(kind, payload)
        finally:
            self._pending = None

    def _write(self, kind: str, payload: Any) -> None:
        if self._pending is None:
            self._apply(kind, payload)
        else:
            self._pending.append((kind, payload))

    def _apply(self, kind: str, payload: Any) -> None:
        if kind == "meta":
            self._meta[payload[0]] = payload[1]
        elif kind == "shards":
            for row in payload:
                self._shards[(row[0], row[1])] = row
        elif kind == "ledger":
            self._ledger.extend(payload)
        elif kind == "worker":
            self._workers[payload[0]] = payload[1]
        elif kind == "truncate":
            self._ledger = [r for r in self._ledger if r.step <= payload]

    def put_meta(self, key: str, value: Any) -> None:
        self._write("meta", (key, json.dumps(value)))

    def get_meta(self, key: str, default: Any = None) -> Any:
        raw = self._meta.get(key)
        return default if raw is None else json.loads(raw)

    def save_shards(self, entries: list[ShardEntry]) -> None:
        self._write("shards", [_shard_row(e) for e in entries])

    def load_shards(self) -> list[ShardEntry]:
        return [_shard_from_row(r) for r in self._shards.values()]

    def append_ledger(self, rows: list[CommittedRange]) -> None:
        self._write("ledger", list(rows))

    def load_ledger(self) -> list[CommittedRange]:
        return list(self._ledger)

    def truncate_ledger(self, after_step: int) -> None:
        self._write("truncate", after_step)

    def save_worker(self, worker_id: int, row: dict[str, Any]) -> None:
        self._write("worker", (worker_id, json.dumps(row)))

    def load_workers(self) -> dict[int, dict[str, Any]]:
        return {k: json.loads(v) for k, v in self._workers.items()}

    def close(self) -> None:
        pass


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS shards (
    epoch INTEGER NOT NULL, start INTEGER NOT NULL, "end" INTEGER NOT NULL, done_to INTEGER NOT NULL,
    state TEXT NOT NULL, worker INTEGER, batch_size INTEGER NOT NULL, ord REAL NOT NULL,
    PRIMARY KEY (epoch, start));
-- one row per append: packed little-endian int64 ranges (see _pack_ranges)
CREATE TABLE IF NOT EXISTS ledger (seq INTEGER PRIMARY KEY AUTOINCREMENT, ranges BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS workers (id INTEGER PRIMARY KEY, row TEXT NOT NULL);
"""


class SqliteJournal:
    """The default journal: one SQLite file in WAL mode, a transaction per master request.

    Commits append to the write-ahead log without fsync (``synchronous=NORMAL``: durable
    against a killed process, which is the failure the master must survive). Copying the log
    back into the database file, which does fsync, is done by a checkpointer thread on its own
    connection every ``checkpoint_s`` seconds instead of by whichever commit crosses SQLite's
    threshold: a checkpoint on the event loop stalled every request behind it by 10-200 ms
    (bench/master_load.py). SQLite releases the GIL while it checkpoints.
    """

    def __init__(self, path: str | Path, *, create: bool = True, checkpoint_s: float = 5.0) -> None:
        path = Path(path)
        if not create and not path.is_file():
            raise ConfigError(f"journal {path} does not exist")
        try:
            if create:
                # The journal holds the job spec and so its bearer token: readable by the user only.
                # SQLite creates -wal and -shm with the mode of the database file, so the file must
                # exist with 0600 before sqlite opens it (umask can only take bits away).
                os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA wal_autocheckpoint=0")
            self._db.executescript(_SCHEMA)
            columns = [r[1] for r in self._db.execute("PRAGMA table_info(ledger)")]
            if columns != ["seq", "ranges"]:
                self._db.close()
                raise ConfigError(
                    f"journal {path} has a ledger of another format (columns {columns}): "
                    "it was written by another version of tidal; resume it with that version"
                )
            checkpointer = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        except OSError as exc:
            raise ConfigError(f"cannot open journal {path}: {exc.strerror}") from exc
        except sqlite3.Error as exc:
            raise ConfigError(f"cannot open journal {path}: {exc}") from exc
        self._depth = 0
        self._stop = threading.Event()
        self._checkpointer = threading.Thread(
            target=_checkpoint_loop, args=(checkpointer, self._stop, checkpoint_s), name="journal-checkpoint",
            daemon=True,
        )
        self._checkpointer.start()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        with _unavailable_on_error():
            self._db.execute("BEGIN")
        self._depth = 1
        try:
            with _unavailable_on_error():
                yield
                self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                try:
                    self._db.execute("ROLLBACK")
                except sqlite3.Error as exc:  # SQLite may have rolled back itself (SQLITE_FULL)
                    log.debug("journal rollback: %s", exc)
            raise
        finally:
            self._depth = 0

    def put_meta(self, key: str, value: Any) -> None:
        with _unavailable_on_error():
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))

    def get_meta(self, key: str, default: Any = None) -> Any:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def save_shards(self, entries: list[ShardEntry]) -> None:
        if entries:
            with _unavailable_on_error():
                self._db.executemany(
                    "INSERT OR REPLACE INTO shards VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [_shard_row(e) for e in entries],
                )

    def load_shards(self) -> list[ShardEntry]:
        rows = self._db.execute("SELECT epoch, start, \"end\", done_to, state, worker, batch_size, ord FROM shards")
        return [_shard_from_row(tuple(r)) for r in rows]

    def append_ledger(self, rows: list[CommittedRange]) -> None:
        # A finalized step of 2,000 workers is 2,000 ranges: one packed row instead of 2,000
        # inserts keeps the journal write off the report's latency (bench/master_load.py).
        if rows:
            with _unavailable_on_error():
                self._db.execute("INSERT INTO ledger (ranges) VALUES (?)", (_pack_ranges(rows),))

    def load_ledger(self) -> list[CommittedRange]:
        out: list[CommittedRange] = []
        for (blob,) in self._db.execute("SELECT ranges FROM ledger ORDER BY seq"):
            out.extend(_unpack_ranges(blob))
        return out

    def truncate_ledger(self, after_step: int) -> None:
        # rare (a resume after every worker was lost): rewrite the packed rows that hold later steps
        with _unavailable_on_error():
            for seq, blob in self._db.execute("SELECT seq, ranges FROM ledger").fetchall():
                rows = _unpack_ranges(blob)
                kept = [r for r in rows if r.step <= after_step]
                if len(kept) == len(rows):
                    continue
                if kept:
                    self._db.execute("UPDATE ledger SET ranges = ? WHERE seq = ?", (_pack_ranges(kept), seq))
                else:
                    self._db.execute("DELETE FROM ledger WHERE seq = ?", (seq,))

    def save_worker(self, worker_id: int, row: dict[str, Any]) -> None:
        with _unavailable_on_error():
            self._db.execute("INSERT OR REPLACE INTO workers VALUES (?, ?)", (worker_id, json.dumps(row)))

    def load_workers(self) -> dict[int, dict[str, Any]]:
        return {int(i): json.loads(r) for i, r in self._db.execute("SELECT id, row FROM workers")}

    def close(self) -> None:
        self._stop.set()
        self._checkpointer.join()
        self._db.close()


@contextmanager
def _unavailable_on_error() -> Iterator[None]:
    """A refused write (disk full, I/O error, read-only file) as the master's retryable error."""
    try:
        yield
    except sqlite3.Error as exc:
        raise JournalUnavailableError(f"cannot write the journal: {exc}") from exc


def _checkpoint_loop(db: sqlite3.Connection, stop: threading.Event, every_s: float) -> None:
    try:
        while not stop.wait(every_s):
            try:
                db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error as exc:  # e.g. the disk is full: commits will say so; keep trying
                log.warning("journal checkpoint failed: %s", exc)
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except sqlite3.Error as exc:
        log.warning("journal checkpoint failed: %s", exc)
    finally:
        db.close()


# A ledger blob: int64s, little-endian. One written since stream ranges carry ``after`` starts
# with _SIX and holds (epoch, start, end, step, worker, after) sextuples; an older blob holds
# (epoch, start, end, step, worker) quintuples (after 0), and is read as before.
_SIX = -6


def _pack_ranges(rows: list[CommittedRange]) -> bytes:
    """One blob per append (see ``_SIX``)."""
    packed = array("q", [_SIX])
    packed.extend(x for r in rows for x in r)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _unpack_ranges(blob: bytes) -> list[CommittedRange]:
    if len(blob) % 8:
        raise ConfigError(f"journal ledger row of {len(blob)} bytes is not a whole number of ranges")
    flat = array("q")
    flat.frombytes(blob)
    if sys.byteorder != "little":
        flat.byteswap()
    width, at = (6, 1) if flat and flat[0] == _SIX else (5, 0)
    if (len(flat) - at) % width:
        raise ConfigError(f"journal ledger row of {len(blob)} bytes is not a whole number of ranges")
    return [CommittedRange(*flat[i:i + width]) for i in range(at, len(flat), width)]


def _shard_row(e: ShardEntry) -> tuple:
    return (e.epoch, e.start, e.end, e.done_to, e.state.value, e.worker, e.batch_size, e.order)


def _shard_from_row(r: tuple) -> ShardEntry:
    return ShardEntry(
        epoch=r[0], start=r[1], end=r[2], done_to=r[3], state=ShardState(r[4]), worker=r[5], batch_size=r[6], order=r[7]
    )
