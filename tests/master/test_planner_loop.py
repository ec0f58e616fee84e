"""The master asks its planner for a target: a planner that fails or overshoots never stops the
job, a user's target overrides the planner until ``scale_auto``. Driven with a fake clock."""

from __future__ import annotations

from pathlib import Path

from tests.test_master import make_master
from tidal.api import JobSnapshot, JobState, ResourcePlan


class ScriptedPlanner:
    """A planner that answers what the test says (a hand-written one, as the brain's are)."""

    name = "scripted"

    def __init__(self) -> None:
        self.workers = 2
        self.error: Exception | None = None
        self.calls = 0

    def plan(self, snapshot: JobSnapshot) -> ResourcePlan:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return ResourcePlan(workers=self.workers, reason="scripted")


def test_a_planner_that_raises_keeps_the_target_and_is_logged_once(tmp_path: Path) -> None:
    master, clock, _ = make_master(tmp_path, "1:4")
    planner = master.planner = ScriptedPlanner()
    master.target_override = None
    master.tick()
    assert master.target == 2
    planner.error = ZeroDivisionError("division by zero")
    for _ in range(5):
        clock.now += 1.0
        master.tick()
    assert planner.calls == 6 and master.state is JobState.RUNNING and master.target == 2
    errors = [e.message for e in master.events if e.kind == "error"]
    assert errors == ["planner scripted failed: ZeroDivisionError: division by zero; keeping 2 workers"]
    planner.error, planner.workers = None, 3
    clock.now += 1.0
    master.tick()
    assert master.target == 3  # back to deciding


def test_a_plan_outside_min_max_is_clamped_and_says_so(tmp_path: Path) -> None:
    master, clock, _ = make_master(tmp_path, "2:4")
    planner = master.planner = ScriptedPlanner()
    master.target_override = None
    planner.workers = 1  # below MIN
    master.tick()
    assert master.target == 2
    assert any("4 -> 2 workers (scripted, clamped from 1 to MIN:MAX)" in e.message for e in master.events)
    planner.workers = 9  # above MAX
    clock.now += 1.0
    master.tick()
    assert master.target == 4
    assert master.planner_decisions == 2


def test_the_planner_is_asked_at_its_interval(tmp_path: Path) -> None:
    master, clock, _ = make_master(tmp_path, "1:4", planner_interval_s=5.0)
    planner = master.planner = ScriptedPlanner()
    master.target_override = None
    for _ in range(10):
        master.tick()
        clock.now += 1.0
    assert planner.calls == 2  # at t=0 and t=5


def test_a_users_target_overrides_the_planner_until_auto(tmp_path: Path) -> None:
    master, clock, _ = make_master(tmp_path, "1:4")
    planner = master.planner = ScriptedPlanner()
    master.target_override = None
    master.tick()
    assert master.scale(4) == 4
    calls = planner.calls
    clock.now += 10.0
    master.tick()
    assert master.target == 4 and planner.calls == calls  # the planner is not asked
    assert master.scale_auto() == 2  # it decides at once
    assert master.target_override is None
    assert any("back to planner scripted" in e.message for e in master.events)
