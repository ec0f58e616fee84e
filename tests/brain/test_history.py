"""History store contract, run against the in-memory and the SQLite implementation."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.brain.history import HistoryStore, InMemoryHistory, JobRecord, similarity, top_k
from tidal.history import SQLiteHistory


def rec(i: int, model: str, t: float, workers: float, size: float = 10.0) -> JobRecord:
    return JobRecord(f"j{i}", t, {"model": model, "size": size}, {"workers": workers, "ps": 2.0}, {"beta": 1.0})


class HistoryContract:
    def make(self, tmp_path: Path) -> HistoryStore:
        raise NotImplementedError

    def test_add_and_order(self, tmp_path: Path) -> None:
        h = self.make(tmp_path)
        assert len(h) == 0 and h.records() == []
        h.add(rec(1, "wd", 20.0, 4))
        h.add(rec(2, "wd", 10.0, 6))
        assert [r.job_id for r in h.records()] == ["j2", "j1"]
        assert len(h) == 2

    def test_replace_same_id_and_round_trip(self, tmp_path: Path) -> None:
        h = self.make(tmp_path)
        h.add(rec(1, "wd", 1.0, 4))
        h.add(rec(1, "xdfm", 2.0, 8, size=3.5))
        (r,) = h.records()
        assert r.features == {"model": "xdfm", "size": 3.5}
        assert r.config == {"workers": 8, "ps": 2.0} and r.params == {"beta": 1.0}

    def test_top_k_most_similar_first(self, tmp_path: Path) -> None:
        h = self.make(tmp_path)
        h.add(rec(1, "wd", 1.0, 4, size=10))
        h.add(rec(2, "xdfm", 2.0, 8, size=10))
        h.add(rec(3, "wd", 3.0, 5, size=5))
        h.add(rec(4, "wd", 4.0, 6, size=10))
        got = top_k(h, {"model": "wd", "size": 10.0}, 2)
        assert [r.job_id for _, r in got] == ["j4", "j1"]  # equal similarity: newer first


class TestInMemory(HistoryContract):
    def make(self, tmp_path: Path) -> HistoryStore:
        return InMemoryHistory()


class TestSQLite(HistoryContract):
    def make(self, tmp_path: Path) -> HistoryStore:
        return SQLiteHistory(tmp_path / "history.db")

    def test_persists(self, tmp_path: Path) -> None:
        SQLiteHistory(tmp_path / "h.db").add(rec(1, "wd", 1.0, 4))
        assert [r.job_id for r in SQLiteHistory(tmp_path / "h.db").records()] == ["j1"]


def test_similarity():
    assert similarity({"a": "x", "n": 10.0}, {"a": "x", "n": 5.0}) == pytest.approx(0.75)
    assert similarity({"a": "x"}, {}) == 0.0
