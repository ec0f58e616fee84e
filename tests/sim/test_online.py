"""The online simulator on short synthetic traces, and the sim/fit/plan commands."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from tidal.api import ConfigError, JobObservation, ResourcePlan
from tidal.brain.dataparallel import FixedWorkers
from tidal.cli import _register_commands, app
from tidal.sim import online as sim

_register_commands()
runner = CliRunner()


def daily(minutes: int, seed: int = 0) -> np.ndarray:
    t = np.arange(minutes)
    rng = np.random.default_rng(seed)
    return 1000 * (1.6 + np.sin(2 * np.pi * t / 1440)) * np.exp(rng.normal(0, 0.05, minutes))


def test_simulation_metrics_are_consistent():
    counts = daily(4 * 1440)
    cfg = sim.SimConfig(peak_workers=12)
    window = sim.scale_to_peak(counts[-1440:], cfg)
    factor = window.max() / counts[-1440:].max()
    res = sim.simulate(window, ["adequate", "hpa", "kale"], cfg, history=counts[:-1440] * factor)
    ad = res["adequate"]
    assert ad.scaling_actions == 0 and ad.accumulated_lag_min < 1 and ad.slo_violation_rate == 0
    assert ad.worker_hours == pytest.approx(12 * 24)
    for r in res.values():
        # every restart stops training for 10 minutes (the last one may run past the end)
        assert r.downtime_min <= 10 * r.scaling_actions + 1e-9
        assert r.downtime_min >= 10 * (r.scaling_actions - 1) - 1e-9
        assert 0 <= r.slo_violation_rate <= 1
    assert res["kale"].worker_hours < 0.8 * ad.worker_hours


def test_oracle_is_a_lower_bound_of_every_policy():
    counts = daily(3 * 1440, seed=2)
    for job in sim.JOBS:
        cfg = sim.SimConfig(peak_workers=12, true_model=sim.JOBS[job]())
        window = sim.scale_to_peak(counts[-1440:], cfg)
        bound = sim.oracle_worker_hours(window, cfg)
        res = sim.simulate(window, ["adequate", "hpa", "kale", "madu"], cfg)
        assert 0 < bound < res["adequate"].worker_hours
        for r in res.values():
            assert bound <= r.worker_hours + 1e-9, (job, r.name)
    # waiting helps: the bound is below "each minute the fewest whole workers for its arrivals"
    f = np.array([sim.true_throughput(cfg, w) for w in range(1, 13)])
    per_minute = np.minimum(np.searchsorted(f, window / 60.0, side="right") + 1, 12).sum() / 60.0
    assert bound < per_minute
    # spending 3% of the minutes over the SLO can only lower it
    assert sim.oracle_worker_hours(window, cfg, violations=0.03) <= bound + 1e-6


def test_oracle_solves_a_constant_stream_exactly():
    """Constant arrivals at F(10) for a day, no noise: the last 20 minutes may stay waiting, so
    the cheapest is to train 1420/1440 of the arrivals evenly (the cost is convex in the rate),
    at a fraction of the way from 9 to 10 workers on the hull's segment between them."""
    cfg = sim.SimConfig(peak_workers=12, noise=0.0)
    f9, f10 = sim.true_throughput(cfg, 9), sim.true_throughput(cfg, 10)
    rate = f10 * 1420 / 1440
    expected = 24 * (9 + (rate - f9) / (f10 - f9))
    assert sim.oracle_worker_hours(np.full(1440, f10 * 60.0), cfg) == pytest.approx(expected, rel=1e-6)
    # a trickle: no policy of the simulator goes below one worker, and the bound does not either
    trickle = np.full(120, 0.01 * f10 * 60.0)
    assert sim.oracle_worker_hours(trickle, cfg) == pytest.approx(2.0)
    assert sim.oracle_worker_hours(trickle, cfg, min_workers=0) < 0.5
    # arrivals no count can keep within 20 minutes: no policy can keep the SLO
    assert sim.oracle_worker_hours(np.full(60, 2 * sim.true_throughput(cfg, 12) * 60.0), cfg) == float("inf")


def test_seamless_pauses_less_than_restart():
    counts = daily(3 * 1440, seed=1)
    out = {}
    for mig in ("restart", "seamless"):
        cfg = sim.SimConfig(peak_workers=10, migration=mig)
        w = sim.scale_to_peak(counts[-1440:], cfg)
        out[mig] = sim.simulate(w, ["hpa"], cfg)["hpa"]
    per_action = {m: r.downtime_min / max(1, r.scaling_actions) for m, r in out.items()}
    assert per_action["seamless"] < per_action["restart"]


def test_peak_needs_exactly_k_workers():
    cfg = sim.SimConfig(peak_workers=20)
    w = sim.scale_to_peak(np.array([1.0, 5.0, 2.0]), cfg)
    peak = w.max() / cfg.interval_s
    assert sim.true_throughput(cfg, 19) < peak < sim.true_throughput(cfg, 20)


def test_a_worker_trains_only_its_own_partitions() -> None:
    # 8 partitions on 6 workers: workers 0 and 1 read two partitions each, the others one
    served = sim._serve(np.full(8, 100.0), capacity=60.0, workers=6)
    assert served.tolist() == [5.0, 5.0, 10.0, 10.0, 10.0, 10.0, 5.0, 5.0]
    # a partition with less than its share gives the rest to its worker's other partition
    served = sim._serve(np.array([1.0, 100, 100, 100]), capacity=40.0, workers=2)
    assert served.tolist() == [1.0, 10.0, 19.0, 10.0]  # worker 0 reads 0 and 2, worker 1 reads 1 and 3
    assert sim._serve(np.array([7.0]), capacity=5.0, workers=None).tolist() == [5.0]  # the pool


def test_uneven_partitions_fall_behind_where_a_pool_keeps_up() -> None:
    """Traffic that 6 pooled workers train with room to spare: with 8 partitions, the two
    workers reading two partitions each get 25% of it and fall behind; the lag grows."""
    cfg = sim.SimConfig(peak_workers=8, noise=0.0, true_model=sim.JOBS["t4-sync"]())
    rate = 0.8 * sim.true_throughput(cfg, 6) * 60.0  # 80% of six workers, per minute
    arrivals = np.full(180, rate)
    pooled = sim.simulate(arrivals, {"six": lambda: FixedWorkers(6)}, cfg)["six"]
    split = sim.simulate(arrivals, {"six": lambda: FixedWorkers(6)}, sim.SimConfig(
        peak_workers=8, noise=0.0, true_model=sim.JOBS["t4-sync"](), partitions=8))["six"]
    assert pooled.accumulated_lag_min == 0.0
    assert split.lag_s[-1] > split.lag_s[60] > 0 and split.slo_violation_rate > 0
    divides = sim.simulate(arrivals, {"eight": lambda: FixedWorkers(8)}, sim.SimConfig(
        peak_workers=8, noise=0.0, true_model=sim.JOBS["t4-sync"](), partitions=8))["eight"]
    assert divides.accumulated_lag_min == 0.0  # one partition each: even again
    with pytest.raises(ConfigError, match="partitions"):
        sim.simulate(arrivals, {"six": lambda: FixedWorkers(6)}, sim.SimConfig(partitions=0))


def test_global_shuffling_pools_uneven_partitions_but_their_queue_waits() -> None:
    """The traffic above with global shuffling: the six workers train as a pool (no backlog,
    no SLO violation), but the two that read two partitions each keep their local queue full,
    so a sample waits ``UPPER / (f(6) / 6)`` behind it on top of the pipeline. On eight workers
    no partition set is over its worker's share: the lag is the pipeline's alone."""
    model = sim.JOBS["t4-sync"]()
    base = sim.SimConfig(peak_workers=8, noise=0.0, true_model=model)
    rate = 0.8 * sim.true_throughput(base, 6) * 60.0
    arrivals = np.full(180, rate)
    cfg = sim.SimConfig(peak_workers=8, noise=0.0, true_model=model, partitions=8, shuffle_upper=1e5, latency_s=30.0)
    six = sim.simulate(arrivals, {"six": lambda: FixedWorkers(6)}, cfg)["six"]
    wait = 1e5 / (sim.true_throughput(cfg, 6) / 6)
    assert six.slo_violation_rate == 0.0
    assert np.allclose(six.lag_s[2:], 30.0 + wait)
    eight = sim.simulate(arrivals, {"eight": lambda: FixedWorkers(8)}, cfg)["eight"]
    assert np.allclose(eight.lag_s[2:], 30.0)
    with pytest.raises(ConfigError, match="shuffle_upper"):
        sim.simulate(arrivals, {"six": lambda: FixedWorkers(6)}, sim.SimConfig(shuffle_upper=384.0))


def test_the_queue_waits_from_its_head_after_a_take_with_the_step_batch_given() -> None:
    """``shuffle_batch`` B: the lag is the age of the head of the full queue just after a step took
    its batch (``tidal.brain.kale.queue_head_age``), as a live worker reports it. With UPPER = 160
    and B = 128 the 32 records left are the newest of the last refill: they came ``(2B - UPPER) / r`` s into a step
    that began ``tau = B / (f / w)`` ago, r being what the busiest worker's partitions bring; with
    UPPER <= B nothing is left after a take; with UPPER = 300 (beyond two batches) the head came
    ``(3B - UPPER) / r`` s into the step before the previous one."""
    model = sim.JOBS["t4-sync"]()
    base = sim.SimConfig(peak_workers=8, noise=0.0, true_model=model)
    arrivals = np.full(60, 0.8 * sim.true_throughput(base, 6) * 60.0)
    per_worker = sim.true_throughput(base, 6) / 6
    brings = 2 * arrivals[0] / 8 / 60.0  # two of the 8 partitions
    tau = 128.0 / per_worker
    for upper, want in ((160.0, tau - 96.0 / brings), (128.0, 0.0), (300.0, 2 * tau - 84.0 / brings)):
        cfg = sim.SimConfig(peak_workers=8, noise=0.0, true_model=model, partitions=8, shuffle_upper=upper,
                            shuffle_batch=128.0, latency_s=10.0)
        six = sim.simulate(arrivals, {"six": lambda: FixedWorkers(6)}, cfg)["six"]
        assert np.allclose(six.lag_s[2:], 10.0 + want), upper
    assert 0 < tau - 96.0 / brings < 160.0 / per_worker  # below the whole queue's wait
    with pytest.raises(ConfigError, match="shuffle_batch"):
        sim.simulate(arrivals, {"six": lambda: FixedWorkers(6)}, dataclasses.replace(cfg, shuffle_batch=0.0))


def test_a_lag_measured_at_a_count_and_load_replaces_the_queue_model_there() -> None:
    """``rest_lags``: at a count it names, the lag of a job that keeps up is the measured lag at the
    load (arrivals over the count's capacity), interpolated between points and held beyond the
    last; at other counts the queue model stands (UPPER = B: the pipeline alone)."""
    model = sim.JOBS["t4-sync"]()
    base = sim.SimConfig(peak_workers=8, noise=0.0, true_model=model)
    arrivals = np.full(60, 0.8 * sim.true_throughput(base, 6) * 60.0)
    cfg = sim.SimConfig(peak_workers=8, noise=0.0, true_model=model, partitions=8, shuffle_upper=128.0,
                        shuffle_batch=128.0, latency_s=10.0, rest_lags={6: ((0.7, 20.0), (0.9, 40.0))})
    six = sim.simulate(arrivals, {"six": lambda: FixedWorkers(6)}, cfg)["six"]
    assert np.allclose(six.lag_s[2:], 30.0)  # halfway between the points at 0.8
    held = sim.simulate(arrivals * 1.2, {"six": lambda: FixedWorkers(6)}, cfg)["six"]
    assert np.allclose(held.lag_s[2:], 40.0)  # 0.96: beyond the last point
    five = sim.simulate(arrivals * 0.5, {"five": lambda: FixedWorkers(5)}, cfg)["five"]
    assert np.allclose(five.lag_s[2:], 10.0)
    for bad in ({6: ((0.9, 1.0), (0.7, 2.0))}, {6: ((0.7, -1.0),)}, {6: ()}):
        with pytest.raises(ConfigError, match="rest_lags"):
            sim.simulate(arrivals, {"six": lambda: FixedWorkers(6)}, dataclasses.replace(cfg, rest_lags=bad))


def test_a_scale_in_costs_what_the_migration_says_for_a_scale_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Migration.scale_in_*``: live, a scale-in starts no process, so it is over in a minute where
    a scale-out prepares for ten. The simulated job holds the old count only that long."""
    monkeypatch.setitem(sim.MIGRATIONS, "asymmetric", sim.Migration(
        "asymmetric", prep_s=600.0, pause_s=60.0, scale_in_prep_s=30.0, scale_in_pause_s=20.0))

    class UpThenDown:
        name = "up-then-down"

        def plan(self, obs: JobObservation) -> ResourcePlan:
            return ResourcePlan(workers=2 if obs.now_s < 60 else 4 if obs.now_s < 1200 else 3)

    cfg = sim.SimConfig(peak_workers=8, noise=0.0, migration="asymmetric")
    run = sim.simulate(np.full(30, 0.5 * sim.true_throughput(cfg, 2) * 60.0), {"x": UpThenDown}, cfg)["x"]
    # decided at the end of minute 0: 11 minutes at max(2, 4), then 4 from minute 11 (the end of 660 s);
    # decided at the end of minute 19 (at 1200 s): over 50 s into minute 20, which holds 3 (a
    # scale-out as long would hold 4 for 11 more minutes)
    assert list(run.workers[:12]) == [2] + [4] * 11
    assert list(run.workers[19:22]) == [4, 3, 3]
    assert run.scaling_actions == 2
    assert run.downtime_min == pytest.approx((60.0 + 20.0) / 60.0)


@pytest.mark.parametrize(("migration", "held"), [
    # restart: the old 13 save the model (the first minute), then the new count's pods are deployed
    ("restart", [13.0] + [3.0] * 9),
    # seamless: the old 13 train through the joiners' minute and save (1 s into the second), then go
    ("seamless", [13.0, (1 * 13 + 59 * 3) / 60, 3.0, 3.0]),
])
def test_a_scale_in_holds_the_leavers_only_until_the_hand_over(migration: str, held: list[float]) -> None:
    """``Migration.held``: a stop-and-restart (DLRover-RM 5.2) stops the old workers once they have
    saved the model and deploys the new count after; the leavers are not held for the 10 minutes
    the new pods take to start. A scale-out holds the new count from the hand-over on."""

    class DownThenUp:
        name = "down-then-up"

        def plan(self, obs: JobObservation) -> ResourcePlan:
            return ResourcePlan(workers=13 if obs.now_s < 60 else 3 if obs.now_s < 1200 else 5)

    cfg = sim.SimConfig(peak_workers=16, noise=0.0, migration=migration)
    run = sim.simulate(np.full(40, 0.5 * sim.true_throughput(cfg, 3) * 60.0), {"x": DownThenUp}, cfg)["x"]
    assert list(run.workers[:1 + len(held)]) == pytest.approx([13.0, *held])
    assert run.workers[1 + len(held)] == 3.0
    # the scale-out decided at the end of minute 19: restart holds the old 3 while they save
    assert run.workers[20] == (3.0 if migration == "restart" else 5.0)
    assert run.workers[-1] == 5.0
    with pytest.raises(ConfigError, match="handover_s"):
        sim.Migration("short", prep_s=0.0, pause_s=30.0, handover_s=60.0)  # a hand-over after the action


def test_planners_read_the_capacity_live_workers_read() -> None:
    """``capacity_reading``: live, the rate over the busy share reads a little above what the
    workers sustain; the planners get the reading, the job trains what it sustains."""
    seen: list[float] = []

    class Reader:
        name = "reader"

        def plan(self, obs: JobObservation) -> ResourcePlan:
            assert obs.stream is not None
            seen.extend(rate for _, rate in obs.stream.measured)
            return ResourcePlan(workers=2)

    cfg = sim.SimConfig(peak_workers=4, noise=0.0, capacity_reading=1.02)
    run = sim.simulate(np.full(10, 3 * sim.true_throughput(cfg, 2) * 60.0), {"r": Reader}, cfg)["r"]
    assert seen and np.allclose(seen, 1.02 * sim.true_throughput(cfg, 2))
    assert run.lag_s[-1] > 0  # the job trained what it sustains: it fell behind
    with pytest.raises(ConfigError, match="capacity_reading"):
        sim.simulate(np.ones(3), {"r": Reader}, sim.SimConfig(capacity_reading=0.0))


def test_a_pause_reads_as_idle_in_the_utilization() -> None:
    """The busy share a planner sees is over the whole minute, as a live worker counts it: the
    part of a minute spent in a scaling action's pause is idle; a minute paused throughout
    reports nothing new. (Counting only the trained part of a minute read a short catch-up as
    saturation, and the simulated HPA scaled out again after every scale-in.)"""

    class Once:
        name = "once"

        def __init__(self) -> None:
            self.seen: list[tuple[bool, float]] = []

        def plan(self, obs: JobObservation) -> ResourcePlan:
            assert obs.stream is not None
            self.seen.append((obs.ready, obs.stream.utilization))
            return ResourcePlan(workers=5 if obs.now_s >= 600 else 4)

    cfg = sim.SimConfig(peak_workers=8, noise=0.0, migration="seamless")
    arrivals = np.full(30, 0.5 * sim.true_throughput(cfg, 4) * 60.0)
    planner = Once()
    sim.simulate(arrivals, {"once": lambda: planner}, cfg)
    util = [u for _, u in planner.seen[1:]]  # the first call sizes the job at launch
    assert util[5] == pytest.approx(0.5, rel=1e-6)  # steady: half busy
    # decided at the end of minute 9: minute 10 trains (prep), 11 and 12 are paused throughout
    # (no report: the reading before stands), 13 is paused 2 s and catches up
    assert util[11] == util[12] == util[10] == pytest.approx(0.5, rel=1e-6)
    assert util[13] == pytest.approx(58 / 60)  # busy for the 58 s it trained, idle for the 2 s paused
    # not ready until the interval after the one the action ended in
    assert [ready for ready, _ in planner.seen[1 + 9 : 1 + 15]] == [True, False, False, False, False, True]


def test_the_busy_share_is_read_over_the_live_window() -> None:
    """``busy_window_s``: a live worker's busy share is over its last second, 96 trace seconds at
    96x; the reading after a pause then mixes the catch-up with the minute before (a minute
    paused throughout reports nothing and is skipped), as HPA sees it live."""
    readings = {}
    for window in (None, 96.0):
        seen: list[float] = []

        class Once:
            name = "once"

            def plan(self, obs: JobObservation, seen: list[float] = seen) -> ResourcePlan:
                assert obs.stream is not None
                seen.append(obs.stream.utilization)
                return ResourcePlan(workers=5 if obs.now_s >= 600 else 4)

        cfg = sim.SimConfig(peak_workers=8, noise=0.0, migration="seamless", busy_window_s=window)
        sim.simulate(np.full(30, 0.5 * sim.true_throughput(cfg, 4) * 60.0), {"once": Once}, cfg)
        readings[window] = seen[1:]
    own, windowed = readings[None], readings[96.0]
    assert windowed[5] == pytest.approx(0.5, rel=1e-6)  # steady: the same either way
    assert own[13] == pytest.approx(58 / 60)
    # minute 13's 60 s, and 36 s of minute 10 (11 and 12 were paused throughout)
    assert windowed[13] == pytest.approx((58 / 60 * 60 + 0.5 * 36) / 96)
    assert windowed[14] == pytest.approx((own[14] * 60 + own[13] * 36) / 96)
    with pytest.raises(ConfigError, match="busy_window_s"):
        sim.simulate(np.ones(3), {"once": Once}, sim.SimConfig(busy_window_s=0.0))


def test_after_a_scale_in_the_job_is_not_ready_until_its_leavers_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Migration.scale_in_settle_s``: live, a master is not ready while a scaled-in worker is
    still exiting (2-3 wall s, about 250 trace s at 96x), by which time the survivors have drained
    the pause's backlog; a planner then never reads that catch-up. A scale-out has no such wait."""
    monkeypatch.setitem(sim.MIGRATIONS, "settling", sim.Migration(
        "settling", prep_s=0.0, pause_s=30.0, scale_in_prep_s=0.0, scale_in_pause_s=30.0, scale_in_settle_s=150.0))
    seen: list[tuple[float, bool, float]] = []

    class DownThenUp:
        name = "down-then-up"

        def plan(self, obs: JobObservation) -> ResourcePlan:
            assert obs.stream is not None
            seen.append((obs.now_s, obs.ready, obs.stream.utilization))
            return ResourcePlan(workers=6 if obs.now_s < 600 else 4 if obs.now_s < 1200 else 6)

    cfg = sim.SimConfig(peak_workers=8, noise=0.0, migration="settling")
    sim.simulate(np.full(30, 0.6 * sim.true_throughput(cfg, 4) * 60.0), {"x": DownThenUp}, cfg)
    ready = {round(t): r for t, r, _ in seen[1:]}
    # the scale-in decided at 600 s pauses 600-630 s; its leavers exit at 780 s: ready from the
    # observation at 780 s on, the interval the pause ended in (660 s) and the two after it not
    assert [ready[t] for t in (600, 660, 720, 780, 840)] == [True, False, False, True, True]
    # the scale-out decided at 1200 s pauses 1200-1230 s: ready again from 1260 s + 60 s
    assert [ready[t] for t in (1260, 1320)] == [False, True]
    # and the first reading after the settle is no longer the catch-up's saturation
    util = {round(t): u for t, _, u in seen[1:]}
    assert util[780] < 0.95


def test_a_pipeline_latency_is_a_floor_under_the_lag() -> None:
    """With ample workers the lag is the latency: a sample waits for the read ahead and the
    step, then is trained; nothing is lost."""
    cfg = sim.SimConfig(peak_workers=8, noise=0.0, latency_s=90.0)
    arrivals = np.full(30, 0.3 * sim.true_throughput(cfg, 4) * 60.0)
    run = sim.simulate(arrivals, {"four": lambda: FixedWorkers(4)}, cfg)["four"]
    assert run.lag_s[0] == pytest.approx(60.0)  # the first minute: nothing trainable yet
    assert np.allclose(run.lag_s[2:], 90.0)
    assert run.accumulated_lag_min == pytest.approx((60.0 + 29 * 90.0) / 60.0)  # minutes of lag x minutes
    none = sim.simulate(arrivals, {"four": lambda: FixedWorkers(4)}, sim.SimConfig(peak_workers=8, noise=0.0))["four"]
    assert none.accumulated_lag_min == 0.0
    with pytest.raises(ConfigError, match="latency_s"):
        sim.simulate(arrivals, {"four": lambda: FixedWorkers(4)}, sim.SimConfig(latency_s=-1.0))


def test_the_planner_factory_passes_kale_arguments_and_refuses_them_elsewhere() -> None:
    cfg = sim.SimConfig(migration="restart", interval_s=300.0)
    mig = sim.MIGRATIONS["restart"]
    kale = sim.planner_factory("kale", cfg, mig, track_error=None, min_history_bins=5)()
    assert kale.track_error is None and kale.min_history_bins == 5  # type: ignore[attr-defined]
    assert kale.lead_s == mig.prep_s + mig.pause_s  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="KalePlanner arguments given for 'hpa'"):
        sim.planner_factory("hpa", cfg, mig, track_error=None)
    # a forecasting planner says how far into a window it runs without a forecast
    assert sim.forecast_wait_s("kale", cfg, 0.0) == pytest.approx((2 * 144 + 2) * 600.0)
    assert sim.forecast_wait_s("kale", cfg, 86400.0 * 3) == 0.0
    assert sim.forecast_wait_s("hpa", cfg, 0.0) == 0.0


def test_load_trace_formats():
    counts, interval = sim.load_trace([["minute", "n"], ["0", "5"], ["1", "7"], ["3", "1"]], None)
    assert interval == 60.0 and list(counts) == [5, 7, 0, 1]
    counts, _ = sim.load_trace([["t", "a", "b"], ["2020-01-01 00:00:00", "1", "9"], ["2020-01-01 00:01:00", "2", "8"],
                                ["2020-01-01 00:02:00", "3", "7"]], "b")
    assert list(counts) == [9, 8, 7]
    with pytest.raises(ConfigError):
        sim.load_trace([["t", "a"], ["x", "1"], ["y", "2"]], None)
    with pytest.raises(ConfigError):
        sim.load_trace([["t", "a"], ["0", "1"], ["1", "2"]], "zzz")


def test_cli_sim_online_time_share_trades_lag_for_workers(tmp_path: Path):
    """Seamless moves, a small job (at most 4 workers, so whole workers round the traffic up by a
    tenth or more most of the day): kale time-shares them by default, and ``--no-time-share``
    sizes every count from the forecast, with more worker-hours and less lag."""
    trace = tmp_path / "trace.csv"
    trace.write_text("minute,count\n" + "".join(f"{i},{c:.1f}\n" for i, c in enumerate(daily(3 * 1440))))
    metrics = {}
    for flag in ("--time-share", "--no-time-share"):
        out = tmp_path / f"{flag}.json"
        r = runner.invoke(app, ["sim", "online", "--trace", str(trace), "--days", "1", "--peak-workers", "4",
                                "--migration", "seamless", "--policies", "kale", flag, "--json", str(out)])
        assert r.exit_code == 0, r.output
        metrics[flag] = json.loads(out.read_text())["policies"]["kale"]
    shared, forecast = metrics["--time-share"], metrics["--no-time-share"]
    assert shared["worker_hours"] < 0.97 * forecast["worker_hours"], (shared, forecast)
    assert shared["accumulated_lag_min"] > forecast["accumulated_lag_min"]
    assert shared["slo_violation_rate"] <= 0.03


def test_cli_sim_online(tmp_path: Path):
    trace = tmp_path / "trace.csv"
    counts = daily(3 * 1440)
    trace.write_text("minute,count\n" + "".join(f"{i},{c:.1f}\n" for i, c in enumerate(counts)))
    out, png = tmp_path / "m.json", tmp_path / "p.png"
    r = runner.invoke(app, ["sim", "online", "--trace", str(trace), "--days", "1", "--peak-workers", "10",
                            "--policies", "kale,hpa,autopilot,madu,adequate", "--json", str(out), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"kale", "hpa", "autopilot", "madu", "adequate"}
    assert set(data["policies"]["kale"]) == {"slo_violation_rate", "accumulated_lag_min", "downtime_min",
                                             "worker_hours", "scaling_actions"}
    assert png.stat().st_size > 10_000
    assert 0 < data["oracle_worker_hours"] < data["policies"]["adequate"]["worker_hours"]
    assert "lower bound" in r.output
    # two days of history, where the forecasters need two days and two 10-minute bins: said
    assert "kale and madu need 48.3 h to fit a forecast: for the window's first 0.3 h" in r.output
    one_day = runner.invoke(app, ["sim", "online", "--trace", str(trace), "--days", "2", "--peak-workers", "10",
                                  "--policies", "kale,hpa"])
    assert one_day.exit_code == 0, one_day.output
    assert "24.0 h of arrivals before it and kale needs 48.3 h" in one_day.output
    assert ("first 24.3 h kale scales out by its threshold fallback alone and in to what the last 3 hours' "
            "busiest 20 minutes need") in one_day.output
    relaxed = runner.invoke(app, ["sim", "online", "--trace", str(trace), "--days", "1", "--peak-workers", "10",
                                  "--policies", "adequate", "--bound-violations", "0.03", "--json", str(out)])
    assert relaxed.exit_code == 0, relaxed.output
    assert json.loads(out.read_text())["oracle_violations"] == 0.03
    assert json.loads(out.read_text())["oracle_worker_hours"] <= data["oracle_worker_hours"] + 1e-6
    assert runner.invoke(app, ["sim", "online", "--trace", str(trace), "--bound-violations", "1"]).exit_code == 2
    # kale acting before a smaller lag (--planned-lag): no more lag, at least as many workers
    eager = runner.invoke(app, ["sim", "online", "--trace", str(trace), "--days", "1", "--peak-workers", "10",
                                "--policies", "kale", "--planned-lag", "60", "--json", str(out)])
    assert eager.exit_code == 0, eager.output
    eager_kale = json.loads(out.read_text())["policies"]["kale"]
    assert eager_kale["accumulated_lag_min"] <= data["policies"]["kale"]["accumulated_lag_min"] + 1e-9
    assert eager_kale["worker_hours"] >= data["policies"]["kale"]["worker_hours"] - 1e-9
    refused = runner.invoke(app, ["sim", "online", "--trace", str(trace), "--planned-lag", "0"])
    assert isinstance(refused.exception, ConfigError) and "--planned-lag must be between" in str(refused.exception)
    # the bound that pays every action: above the free one, below what kale used
    paid = runner.invoke(app, ["sim", "online", "--trace", str(trace), "--days", "1", "--peak-workers", "10",
                               "--policies", "kale", "--paid-bound", "--json", str(out)])
    assert paid.exit_code == 0, paid.output
    assert "paying every restart action" in paid.output
    run = json.loads(out.read_text())
    assert data["oracle_worker_hours"] < run["paid_bound_worker_hours"] <= run["policies"]["kale"]["worker_hours"]
    t4 = runner.invoke(app, ["sim", "online", "--trace", str(trace), "--days", "1", "--peak-workers", "10",
                             "--job", "t4-sync", "--policies", "adequate", "--json", str(out)])
    assert t4.exit_code == 0, t4.output
    assert json.loads(out.read_text())["job"] == "t4-sync"
    assert runner.invoke(app, ["sim", "online", "--trace", str(trace), "--job", "h100"]).exit_code == 2
    bad = runner.invoke(app, ["sim", "online", "--trace", str(trace), "--migration", "teleport"])
    assert bad.exit_code == 2
    # an earlier window (to tune on), and a skip that leaves nothing
    early = runner.invoke(app, ["sim", "online", "--trace", str(trace), "--days", "1", "--skip-days", "1",
                                "--peak-workers", "10", "--policies", "adequate"])
    assert early.exit_code == 0, early.output
    assert "fit a forecast" not in early.output  # adequate forecasts nothing
    assert runner.invoke(app, ["sim", "online", "--trace", str(trace), "--skip-days", "5"]).exit_code == 2
    # partitions: 7 on 10 workers leave 3 idle; adequate's lag may grow where the pool's did not
    split = runner.invoke(app, ["sim", "online", "--trace", str(trace), "--days", "1", "--peak-workers", "10",
                                "--policies", "adequate", "--partitions", "7", "--json", str(out)])
    assert split.exit_code == 0, split.output
    split_lag = json.loads(out.read_text())["policies"]["adequate"]["accumulated_lag_min"]
    assert split_lag >= data["policies"]["adequate"]["accumulated_lag_min"]
    shuffled = runner.invoke(app, ["sim", "online", "--trace", str(trace), "--days", "1", "--peak-workers", "10",
                                   "--policies", "adequate", "--partitions", "7", "--global-shuffle", "128:384",
                                   "--json", str(out)])
    assert shuffled.exit_code == 0, shuffled.output
    # the workers train as a pool again: a queue of 384 samples waits under a second at this job's rate
    assert json.loads(out.read_text())["policies"]["adequate"]["accumulated_lag_min"] < split_lag
    assert runner.invoke(app, ["sim", "online", "--trace", str(trace), "--global-shuffle", "128:384"]).exit_code == 2
    assert runner.invoke(app, ["sim", "online", "--trace", str(trace), "--partitions", "7",
                               "--global-shuffle", "384:128"]).exit_code == 2
    zero = runner.invoke(app, ["sim", "online", "--trace", str(trace), "--partitions", "0"])
    assert zero.exit_code == 2 and "--partitions must be at least 1" in zero.output


def _csv(tmp_path: Path, text: str) -> str:
    p = tmp_path / "d.csv"
    p.write_text(text)
    return str(p)


def test_cli_fit(tmp_path: Path):
    rows = "".join(f"{w},{16384 / (0.00035 + 2.5726 / w + 0.9824 / w**2 + 0.02786 * w):.3f},16384\n" for w in range(1, 25))
    path = _csv(tmp_path, "workers,throughput,batch_size\n" + rows)
    r = runner.invoke(app, ["fit", "kale-sync", path, "--json", "--test-fraction", "0.25", "--seed", "3"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert set(data) == {"model", "params", "mape", "rmse", "n_train", "n_test"}
    assert data["n_test"] == 6 and data["mape"] < 0.01
    assert data["params"]["theta1"] == pytest.approx(2.5726, rel=1e-3)
    assert runner.invoke(app, ["fit", "dlrover-rm", path]).exit_code == 2  # missing ps, cpus
    assert runner.invoke(app, ["fit", "kale-sync", _csv(tmp_path, "workers,throughput\n1,x\n2,3\n")]).exit_code == 2
    assert runner.invoke(app, ["fit", "kale-sync", _csv(tmp_path, "workers,throughput\n1,2\n2,3\n")]).exit_code == 2
    assert runner.invoke(app, ["fit", "nope", path]).exit_code == 2


def test_cli_plan_kale():
    args = ["plan", "kale", "--model", "kale-sync", "--params", "[0.00035, 2.5726, 0.9824, 0.02786]",
            "--batch-size", "16384", "--traffic", "30000"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "workers 10" in r.output and "30005.5" in r.output
    r = runner.invoke(app, [*args[:-1], "40000", "--json"])
    assert json.loads(r.output) == {"workers": 10, "throughput": pytest.approx(30005.46, rel=1e-4), "feasible": False}
    assert runner.invoke(app, [*args[:5], "not json", *args[6:]]).exit_code == 2


def test_cli_sim_online_program_hours_buys_down_the_lag(tmp_path: Path):
    """``--program-hours``: kale plans over hours with the lag priced, on 5-minute metrics with
    seamless moves: less lag than the default at more worker-hours, more so at a higher price;
    bad values refused."""
    trace = tmp_path / "trace.csv"
    five_min = daily(3 * 1440).reshape(-1, 5).sum(axis=1)
    trace.write_text("minute,count\n" + "".join(f"{5 * i},{c:.1f}\n" for i, c in enumerate(five_min)))
    metrics = {}
    for name, flags in {"default": [], "p4": ["--program-hours", "3", "--program-lag-price", "4"],
                        "p32": ["--program-hours", "3", "--program-lag-price", "32"]}.items():
        out = tmp_path / f"{name}.json"
        r = runner.invoke(app, ["sim", "online", "--trace", str(trace), "--days", "1", "--peak-workers", "10",
                                "--migration", "seamless", "--policies", "kale", "--json", str(out), *flags])
        assert r.exit_code == 0, r.output
        metrics[name] = json.loads(out.read_text())["policies"]["kale"]
    assert metrics["p4"]["accumulated_lag_min"] < metrics["default"]["accumulated_lag_min"]
    assert metrics["p32"]["accumulated_lag_min"] < metrics["p4"]["accumulated_lag_min"]
    assert metrics["p32"]["worker_hours"] > metrics["p4"]["worker_hours"]
    assert max(m["slo_violation_rate"] for m in metrics.values()) <= 0.03
    for bad in (["--program-hours", "0"], ["--program-hours", "25"], ["--program-lag-price", "4"],
                ["--program-hours", "3", "--program-lag-price", "-1"], ["--program-lag-ratio", "0.3"],
                ["--program-hours", "3", "--program-lag-ratio", "0"]):
        r = runner.invoke(app, ["sim", "online", "--trace", str(trace), *bad])
        assert r.exit_code == 2, (bad, r.output)
