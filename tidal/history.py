"""The history of finished jobs on disk: DLRover-RM's "config DB", a ``tidal.brain.history.HistoryStore``.

The brain does no I/O, so the SQLite store lives here, used by the job master (a finished job
records its signature, final worker count and fitted model; a new job's planner warm-starts from
the most similar ones) and by ``tidal sim cluster``. Default file: ``~/.tidal/history.sqlite``
(``tidal run --history PATH``; ``TIDAL_HISTORY``, or ``TIDAL_HOME`` as the directory, in the
environment set the default).

Format: table ``jobs(job_id PRIMARY KEY, finished_s, features, config, params)``, the mappings as
JSON, and table ``meta(key PRIMARY KEY, value)`` with ``format`` = ``FORMAT``. A file without the
meta table was written by tidal before the format was versioned (format 1: same ``jobs`` table);
it is read as is and stamped. A file of a newer format, or one that is not a SQLite database, or
whose rows do not parse, raises ``HistoryError`` (one line): the master then logs it and starts
the job without a warm start, never stopping for it. Pass ``":memory:"`` for a private database.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

from tidal.api import ConfigError
from tidal.brain.history import JobRecord

__all__ = ["FORMAT", "HistoryError", "SQLiteHistory", "default_path"]

FORMAT = 2


class HistoryError(ConfigError):
    """The history file cannot be used: not SQLite, a newer format, rows that do not parse."""


def default_path() -> Path:
    """``$TIDAL_HISTORY``, else ``$TIDAL_HOME/history.sqlite`` when ``TIDAL_HOME`` is set, else
    ``~/.tidal/history.sqlite``."""
    env = os.environ.get("TIDAL_HISTORY")
    if env:
        return Path(env)
    home = os.environ.get("TIDAL_HOME")
    return Path(home) / "history.sqlite" if home else Path.home() / ".tidal" / "history.sqlite"


class SQLiteHistory:
    """``HistoryStore`` on a SQLite file (created, with its directory, if missing).

    Raises:
        HistoryError: the file exists but is not a history this tidal can read.
    """

    def __init__(self, path: str | Path = ":memory:") -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path)
            self._open()
        except sqlite3.DatabaseError as exc:
            raise HistoryError(f"history {self.path} is not usable: {exc}") from None

    def _open(self) -> None:
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "meta" in tables:
            row = self._db.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
            found = int(row[0]) if row and str(row[0]).isdigit() else None
            if found is None or found > FORMAT:
                self._db.close()
                raise HistoryError(f"history {self.path} is format {row[0] if row else 'unknown'}; "
                                   f"this tidal reads formats 1..{FORMAT}: use a newer tidal or another --history")
        with self._db:
            self._db.execute("CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, finished_s REAL NOT NULL, "
                             "features TEXT NOT NULL, config TEXT NOT NULL, params TEXT NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('format', ?)", (str(FORMAT),))

    def add(self, record: JobRecord) -> None:
        try:
            with self._db:
                self._db.execute(
                    "INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?)",
                    (record.job_id, record.finished_s, json.dumps(dict(record.features)),
                     json.dumps(dict(record.config)), json.dumps(dict(record.params))),
                )
        except sqlite3.DatabaseError as exc:
            raise HistoryError(f"history {self.path}: cannot record job {record.job_id}: {exc}") from None

    def records(self) -> list[JobRecord]:
        try:
            rows = self._db.execute(
                "SELECT job_id, finished_s, features, config, params FROM jobs ORDER BY finished_s, rowid"
            ).fetchall()
            out = []
            for r in rows:
                features, config, params = json.loads(r[2]), json.loads(r[3]), json.loads(r[4])
                if not all(isinstance(m, dict) for m in (features, config, params)):
                    raise ValueError(f"job {r[0]}: a field is not a JSON object")
                out.append(JobRecord(str(r[0]), float(r[1]), features,
                                     {k: float(v) for k, v in config.items()}, {k: float(v) for k, v in params.items()}))
            return out
        except (sqlite3.DatabaseError, ValueError, TypeError) as exc:
            raise HistoryError(f"history {self.path} has a row that does not parse: {exc}") from None

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> SQLiteHistory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
