"""Baseline planners: the HPA algorithm's rules, Autopilot's deferral, madu, adequate."""

from __future__ import annotations

from tidal.api import JobObservation, StreamObservation
from tidal.brain import planners
from tidal.brain.baselines import AutopilotPlanner, HPAPlanner, MaduPlanner


def snap(now: float, workers: int, util: float = 0.5, backlog: float = 0.0, ready: bool = True,
         **stream) -> JobObservation:
    return JobObservation(job_id="j", min_workers=1, max_workers=40, current_workers=workers, now_s=now, ready=ready,
                          stream=StreamObservation(utilization=util, backlog=backlog, **stream))


def test_hpa_tolerance_and_ratio():
    hpa = HPAPlanner(target=0.8)
    assert hpa.plan(snap(15, 10, util=0.85)).workers == 10  # |0.85/0.8 - 1| = 0.0625 <= 0.1
    assert hpa.plan(snap(30, 10, util=0.96)).workers == 12  # ceil(1.2 * 10)


def test_hpa_scale_up_rate_limit():
    hpa = HPAPlanner(target=0.5)
    # desired ceil(2 * 1.0 / 0.5) * ... = huge; limits: 100% -> 4, 4 pods -> 6: Max -> 6
    hpa2 = HPAPlanner(target=0.05)
    assert hpa2.plan(snap(15, 2, util=1.0)).workers == 6
    # within the same 15 s period the pods just added count: start = 6 - 4 = 2 -> limit 6
    assert hpa2.plan(snap(20, 6, util=1.0)).workers == 6
    # a new period: from 6, 100% -> 12 and 6 + 4 -> 10: 12
    assert hpa2.plan(snap(40, 6, util=1.0)).workers == 12
    assert hpa.plan(snap(15, 4, util=1.0)).workers == 8


def test_hpa_scale_down_stabilization_window():
    hpa = HPAPlanner(target=0.8)
    assert hpa.plan(snap(0, 10, util=0.8)).workers == 10
    # load falls: desired 5, but the highest recommendation in the last 300 s is 10
    assert hpa.plan(snap(60, 10, util=0.4)).workers == 10
    assert hpa.plan(snap(299, 10, util=0.4)).workers == 10
    assert hpa.plan(snap(361, 10, util=0.4)).workers == 5


def test_hpa_starts_its_recommendations_with_the_current_count():
    """An idle first sync (nothing arrived yet) does not scale in: the controller seeds its
    recommendations with the current count, and the down window must pass first."""
    hpa = HPAPlanner(target=0.8)
    assert hpa.plan(snap(60, 4, util=0.0)).workers == 4
    assert hpa.plan(snap(300, 4, util=0.0)).workers == 4
    assert hpa.plan(snap(361, 4, util=0.0)).workers == 1


def test_hpa_keeps_its_recommendations_while_a_scaling_action_runs():
    """The controller syncs on while pods start, recommending the count it asked for: an action
    longer than the down window does not leave the window empty, so the first (idle) reading
    after it cannot scale in alone."""
    hpa = HPAPlanner(target=0.8)
    assert hpa.plan(snap(0, 10, util=0.96)).workers == 12  # ceil(1.2 * 10): the action starts
    for t in range(60, 540, 60):  # 8 minutes of scaling (a restart, say)
        assert hpa.plan(snap(t, 12, util=0.0, ready=False)).workers == 12
    # the pause's idle minute: desired ceil(0.3 / 0.8 * 12) = 5, but the window holds 12s
    assert hpa.plan(snap(540, 12, util=0.3)).workers == 12
    assert hpa.plan(snap(841, 12, util=0.3)).workers == 5  # once five minutes of low readings passed


def test_hpa_lag_metric():
    hpa = HPAPlanner(metric="lag", target=1000.0)
    assert hpa.plan(snap(15, 4, backlog=8000.0)).workers == 8  # 2000 per worker / 1000


def test_autopilot_defers_downscaling():
    ap = AutopilotPlanner(window_s=300, statistic="max", target_utilization=0.8, defer_down_s=1200)
    assert ap.plan(snap(60, 10, util=0.8)).workers == 10  # usage 8 workers / 0.8
    assert ap.plan(snap(120, 10, util=0.9)).workers == 12  # up at once: ceil(9 / 0.8)
    # usage falls to 4 workers; the max statistic over the window and the deferral keep it
    assert ap.plan(snap(180, 12, util=4 / 12)).workers == 12
    for t in range(240, 1560, 60):
        assert ap.plan(snap(t, 12, util=4 / 12)).workers == 12  # the 12s of t <= 420 still count
    last = ap.plan(snap(1680, 12, util=4 / 12)).workers
    assert last == 5  # ceil(4 / 0.8), once the window has forgotten the peak and 20 min have passed


def test_madu_fixed_rate_and_adequate():
    madu = MaduPlanner(forecaster="seasonal-naive", min_history_bins=144, lead_s=0.0, decide_every_s=600)
    madu.observe_history([60_000.0] * (3 * 1440), 60.0)  # 1000 samples/s, flat
    plan = madu.plan(snap(60, 4, measured=[(4.0, 400.0)], arrivals=[60_000.0]))
    assert plan.workers == 10  # 1000 / (400 / 4) per worker, no throughput model
    assert planners.get("adequate").plan(snap(0, 3)).workers == 40
    no_stream = JobObservation(job_id="j", min_workers=1, max_workers=40, current_workers=3)
    assert planners.get("adequate").plan(no_stream).workers == 40  # reads nothing of the stream


def test_madu_rate_is_the_lowest_measured_per_worker_rate():
    madu = MaduPlanner(forecaster="seasonal-naive", min_history_bins=144, lead_s=0.0, decide_every_s=600)
    madu.observe_history([60_000.0] * (3 * 1440), 60.0)  # 1000 samples/s, flat
    madu.plan(snap(60, 4, measured=[(4.0, 480.0), (8.0, 800.0)], arrivals=[60_000.0]))
    assert madu.rate() == 100.0  # 800 / 8: a line under every measured point
    assert MaduPlanner(per_worker_rate=50.0).rate() == 50.0
