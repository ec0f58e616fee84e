"""The history file on disk (tidal.history) and what the master does with a bad one: a corrupt
file, one of a newer format, one of the older unversioned format, and the warm start it feeds."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tidal.brain.history import JobRecord
from tidal.history import FORMAT, HistoryError, SQLiteHistory
from tidal.master.api import JobSpec
from tidal.master.server import job_features, planner_for

pytestmark = pytest.mark.speed_free


def spec(tmp_path: Path, history: Path | None, planner: str = "dlrover-rm") -> JobSpec:
    return JobSpec(job_id="new", argv=["python", "/x/train.py", "--samples", "10"], min_workers=1, max_workers=6,
                   token="t", job_dir=str(tmp_path), planner=planner,
                   history_path=None if history is None else str(history))


def test_a_finished_job_warm_starts_a_similar_one(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    store = SQLiteHistory(path)
    store.add(JobRecord("old", 1.0, job_features(spec(tmp_path, path)), {"workers": 3.0},
                        {"theta0": 0.03, "theta1": 0.01, "knee": 3.0}))
    store.close()
    planner, note = planner_for(spec(tmp_path, path))
    assert note.startswith("from old (similarity 1.00)")
    from tidal.api import JobObservation

    first = planner.plan(JobObservation(job_id="new", min_workers=1, max_workers=6, current_workers=0))
    assert first.workers == 3 and "warm start" in first.reason


def test_a_corrupt_history_is_reported_in_one_line_and_the_job_starts_cold(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(HistoryError) as err:
        SQLiteHistory(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    planner, note = planner_for(spec(tmp_path, path))
    assert note.startswith("no warm start:") and planner.name == "dlrover-rm"


def test_a_history_of_a_newer_format_is_refused_not_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    SQLiteHistory(path).close()
    db = sqlite3.connect(path)
    with db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'format'", (str(FORMAT + 1),))
    db.close()
    with pytest.raises(HistoryError, match=f"format {FORMAT + 1}; this tidal reads formats 1..{FORMAT}"):
        SQLiteHistory(path)
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta").fetchone()[0] == str(FORMAT + 1)  # left as it was


def test_a_history_of_the_older_unversioned_format_is_read_and_stamped(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    db = sqlite3.connect(path)
    with db:
        db.execute("CREATE TABLE jobs (job_id TEXT PRIMARY KEY, finished_s REAL NOT NULL, "
                   "features TEXT NOT NULL, config TEXT NOT NULL, params TEXT NOT NULL)")
        db.execute("INSERT INTO jobs VALUES ('a', 1.0, '{\"script\": \"t.py\"}', '{\"workers\": 2}', '{}')")
    db.close()
    store = SQLiteHistory(path)
    assert [(r.job_id, dict(r.config)) for r in store.records()] == [("a", {"workers": 2.0})]
    store.close()
    assert sqlite3.connect(path).execute("SELECT value FROM meta WHERE key='format'").fetchone()[0] == str(FORMAT)


def test_a_row_that_does_not_parse_is_an_error_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    SQLiteHistory(path).close()
    db = sqlite3.connect(path)
    with db:
        db.execute("INSERT INTO jobs VALUES ('a', 1.0, 'not json', '{}', '{}')")
    db.close()
    with pytest.raises(HistoryError, match="does not parse"):
        SQLiteHistory(path).records()
    _, note = planner_for(spec(tmp_path, path))
    assert note.startswith("no warm start:")
