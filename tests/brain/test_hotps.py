"""The hot-PS planner (tidal.brain.hotps, DLRover 4.2): shards move off a server that is much
busier than its peers, as far as the move lowers the busiest server's predicted load; a balanced
or idle job is left alone."""

from __future__ import annotations

import pytest

from tidal.brain.hotps import plan_hot_shards

TWO = [v % 2 for v in range(64)]  # 32 shards each


def even_hits(rate: float = 100.0) -> dict[int, list[float]]:
    """Rows pulled per shard per second, the same for every shard (hashing spreads the ids)."""
    return {s: [rate if TWO[v] == s else 0.0 for v in range(64)] for s in (0, 1)}


def test_a_balanced_job_is_left_alone() -> None:
    assert plan_hot_shards({0: 0.5, 1: 0.45}, even_hits(), TWO) is None


def test_an_idle_job_has_no_hot_server() -> None:
    assert plan_hot_shards({0: 0.15, 1: 0.01}, even_hits(), TWO) is None


def test_a_server_three_times_slower_per_row_gives_away_shards_until_the_load_evens() -> None:
    # server 0 spends 3x the time per row: 0.9 busy against 0.3 for the same rows
    plan = plan_hot_shards({0: 0.9, 1: 0.3}, even_hits(), TWO)
    assert plan is not None and plan.hot == 0
    assert all(TWO[v] == 0 and plan.new_map[v] == 1 for v in plan.moved)
    assert [v for v in range(64) if plan.new_map[v] != TWO[v]] == sorted(plan.moved)
    kept = plan.new_map.count(0)
    # even load: 3k = (64 - k) -> k = 16 shards stay on server 0
    assert 15 <= kept <= 17, kept
    assert plan.busy_after == pytest.approx(0.45, abs=0.03)  # 16 x 0.028 = 48 x 0.0094
    assert "hot parameter server 0 (busy 0.90, peers' median 0.30)" in plan.describe()


def test_hot_shards_move_first_and_a_server_keeps_one() -> None:
    hits = even_hits(10.0)
    hits[0][0] = 500.0  # one very hot shard on server 0 (a shard-level hot spot)
    plan = plan_hot_shards({0: 0.95, 1: 0.1}, hits, TWO)
    assert plan is not None and plan.moved[0] == 0  # the hottest shard goes first
    assert plan.new_map.count(0) >= 1


def test_a_shard_too_hot_to_move_anywhere_useful_is_kept() -> None:
    # all of server 0's load is one shard: moving it just makes server 1 the hot one
    hits = {0: [0.0] * 64, 1: [0.0] * 64}
    hits[0][0] = 1000.0
    hits[1][1] = 10.0
    assert plan_hot_shards({0: 0.9, 1: 0.05}, hits, TWO) is None


def test_missing_reports_or_one_server_plan_nothing() -> None:
    assert plan_hot_shards({0: 0.9}, even_hits(), TWO) is None
    assert plan_hot_shards({0: 0.9, 1: 0.1}, {0: even_hits()[0]}, TWO) is None
    assert plan_hot_shards({0: 0.9}, {0: [1.0] * 64}, [0] * 64) is None
