"""A SQLite ``HistoryStore`` (DLRover-RM's "config DB"), outside the brain because it does I/O.

One table, ``jobs(job_id PRIMARY KEY, finished_s, features, config, params)``, the mappings as
JSON. Pass ``":memory:"`` for a private in-memory database. Numbers and strings in ``features``
survive the round trip as they went in (JSON keeps the distinction).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from tidal.brain.history import JobRecord

__all__ = ["SQLiteHistory"]


class SQLiteHistory:
    """``HistoryStore`` on a SQLite file (created if missing)."""

    def __init__(self, path: str | Path = ":memory:") -> None:
        self._db = sqlite3.connect(str(path))
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, finished_s REAL NOT NULL, "
            "features TEXT NOT NULL, config TEXT NOT NULL, params TEXT NOT NULL)"
        )
        self._db.commit()

    def add(self, record: JobRecord) -> None:
        with self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?)",
                (record.job_id, record.finished_s, json.dumps(dict(record.features)),
                 json.dumps(dict(record.config)), json.dumps(dict(record.params))),
            )

    def records(self) -> list[JobRecord]:
        rows = self._db.execute(
            "SELECT job_id, finished_s, features, config, params FROM jobs ORDER BY finished_s, rowid"
        ).fetchall()
        return [JobRecord(r[0], r[1], json.loads(r[2]), json.loads(r[3]), json.loads(r[4])) for r in rows]

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])

    def close(self) -> None:
        self._db.close()
