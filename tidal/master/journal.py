"""The master's journal: what a restarted master needs to carry on (DESIGN.md section 4).

The master writes to the journal *before* it answers the request that changed the state:
membership round, worker table, shard table, finalized steps and the committed-range ledger.
``tidal master --resume JOURNAL`` rebuilds the master from it. Two implementations behind one
interface: SQLite (the default, WAL mode) and in-memory (for tests and for jobs that opt out);
both pass the same contract suite in tests/test_journal.py.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from tidal.api import ConfigError
from tidal.master.shards import CommittedRange, ShardEntry, ShardState


class Journal(Protocol):
    """Durable master state. Writes inside ``transaction()`` become visible together."""

    def transaction(self) -> Any:
        """Context manager grouping writes; on exception nothing of them is kept."""
        ...

    def put_meta(self, key: str, value: Any) -> None: ...

    def get_meta(self, key: str, default: Any = None) -> Any: ...

    def save_shards(self, entries: list[ShardEntry]) -> None: ...

    def load_shards(self) -> list[ShardEntry]: ...

    def append_ledger(self, rows: list[CommittedRange]) -> None: ...

    def load_ledger(self) -> list[CommittedRange]: ...

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
CREATE TABLE IF NOT EXISTS ledger (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, epoch INTEGER NOT NULL, start INTEGER NOT NULL,
    "end" INTEGER NOT NULL, step INTEGER NOT NULL, worker INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS workers (id INTEGER PRIMARY KEY, row TEXT NOT NULL);
"""


class SqliteJournal:
    """The default journal: one SQLite file in WAL mode, a transaction per master request."""

    def __init__(self, path: str | Path, *, create: bool = True) -> None:
        path = Path(path)
        if not create and not path.is_file():
            raise ConfigError(f"journal {path} does not exist")
        try:
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise ConfigError(f"cannot open journal {path}: {exc}") from exc
        self._depth = 0

    @contextmanager
    def transaction(self) -> Iterator[None]:
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._db.execute("BEGIN")
        self._depth = 1
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        else:
            self._db.execute("COMMIT")
        finally:
            self._depth = 0

    def put_meta(self, key: str, value: Any) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))

    def get_meta(self, key: str, default: Any = None) -> Any:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def save_shards(self, entries: list[ShardEntry]) -> None:
        if entries:
            self._db.executemany(
                "INSERT OR REPLACE INTO shards VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [_shard_row(e) for e in entries],
            )

    def load_shards(self) -> list[ShardEntry]:
        rows = self._db.execute("SELECT epoch, start, \"end\", done_to, state, worker, batch_size, ord FROM shards")
        return [_shard_from_row(tuple(r)) for r in rows]

    def append_ledger(self, rows: list[CommittedRange]) -> None:
        if rows:
            self._db.executemany(
                "INSERT INTO ledger (epoch, start, \"end\", step, worker) VALUES (?, ?, ?, ?, ?)",
                [(r.epoch, r.start, r.end, r.step, r.worker) for r in rows],
            )

    def load_ledger(self) -> list[CommittedRange]:
        rows = self._db.execute("SELECT epoch, start, \"end\", step, worker FROM ledger ORDER BY seq")
        return [CommittedRange(*r) for r in rows]

    def save_worker(self, worker_id: int, row: dict[str, Any]) -> None:
        self._db.execute("INSERT OR REPLACE INTO workers VALUES (?, ?)", (worker_id, json.dumps(row)))

    def load_workers(self) -> dict[int, dict[str, Any]]:
        return {int(i): json.loads(r) for i, r in self._db.execute("SELECT id, row FROM workers")}

    def close(self) -> None:
        self._db.close()


def _shard_row(e: ShardEntry) -> tuple:
    return (e.epoch, e.start, e.end, e.done_to, e.state.value, e.worker, e.batch_size, e.order)


def _shard_from_row(r: tuple) -> ShardEntry:
    return ShardEntry(
        epoch=r[0], start=r[1], end=r[2], done_to=r[3], state=ShardState(r[4]), worker=r[5], batch_size=r[6], order=r[7]
    )
