"""The lag-priced program (Kale Eq. 11 over a horizon) against every schedule, and kale planning with it."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tidal.api import ConfigError, JobObservation, StreamObservation
from tidal.brain import lag_program
from tidal.brain.kale import KalePlanner
from tidal.sim import online as sim

DT = 60.0
F = [0.0, 100.0, 190.0, 270.0]  # samples/s of 0..3 workers
PHASES = lag_program.action_phases(30.0, 60.0, DT, lambda since, span: min(1.0, max(0.0, (30.0 - since) / span)))


def _schedule_cost(decisions: tuple[int, ...], w0: int, x0: float, past: np.ndarray, ahead: np.ndarray,
                   price: float) -> float:
    """Worker-minutes plus ``price`` per lag-minute of one schedule, simulated forward: ``decisions``
    per interval with no action under way, the count to move to (the current one: keep)."""
    series = np.concatenate([past, ahead])
    cum = np.concatenate([[0.0], np.cumsum(series)])
    base, h, m = len(past), len(ahead), DT / 60.0

    def lag(t: int, x: float) -> float:  # at the end of interval t with x waiting
        if x <= 0:
            return 0.0
        end = base + t + 1
        age = lag_program.oldest_age(cum, series, np.array([max(cum[end] - x, 0.0)]), end * DT, DT)[0]
        return price * age / 60.0 * m

    w, x, t, cost, it = w0, x0, 0, 0.0, iter(decisions)
    while t < h:
        v = next(it)
        if v == w or t + len(PHASES) > h:
            x = max(0.0, x + ahead[t] - F[w] * DT)
            cost += w * m + lag(t, x)
            t += 1
            continue
        for phase in PHASES:
            x = max(0.0, x + ahead[t] - F[v if phase.new else w] * DT * phase.train)
            cost += lag(t, x) + (phase.before * max(w, v) + (1 - phase.before) * v) * m
            t += 1
        w = v
    return cost + x / (F[w] * DT) * m


@pytest.mark.parametrize("w0,x0", [(1, 0.0), (2, 9_000.0), (3, 0.0)])
def test_the_program_is_the_cheapest_schedule(w0: int, x0: float) -> None:
    """Seven 1-minute intervals of a ramp up and down, 1-3 workers, an action two intervals long
    (half of each trains): on a fine grid the program's value at the state now is the least over
    every schedule of keeps and moves, and its first decision is that schedule's."""
    past = np.full(60, 120.0 * DT)
    ahead = np.array([120.0, 150.0, 260.0, 260.0, 250.0, 120.0, 90.0]) * DT
    price = 0.5
    policy = lag_program.solve(F, DT, PHASES, True, price, past, ahead, x0, 1, 3, grid=4000)
    best, first = math.inf, w0
    for decisions in itertools.product(range(1, 4), repeat=len(ahead)):
        cost = _schedule_cost(decisions, w0, x0, past, ahead, price)
        if cost < best - 1e-9:
            best, first = cost, decisions[0]
    col = x0 / policy.unit
    lo = int(col)
    r = w0 - 1
    value = min(np.interp(col, [lo, lo + 1], policy.keep[0, r, lo : lo + 2]),
                np.interp(col, [lo, lo + 1], policy.move[0, r, lo : lo + 2]))
    assert value == pytest.approx(best, rel=2e-3)
    assert policy.decide(0, w0, x0) == first


def test_a_program_sees_a_ramp_within_its_horizon_and_not_beyond() -> None:
    """One worker keeps up with the traffic now; in 40 minutes it doubles for hours. A program
    that sees the rise moves once the pause it pays is cheaper than the lag it avoids; one whose
    horizon ends before the rise keeps its one worker."""
    past = np.full(60, 90.0 * DT)
    ahead = np.concatenate([np.full(40, 90.0), np.full(140, 180.0)]) * DT
    seeing = lag_program.solve(F, DT, PHASES, True, 8.0, past, ahead, 0.0, 1, 3)
    blind = lag_program.solve(F, DT, PHASES, True, 8.0, past, ahead[:30], 0.0, 1, 3)
    assert blind.decide(0, 1, 0.0) == 1
    moves = [k for k in range(40) if seeing.decide(k, 1, 0.0) != 1]
    assert moves and seeing.decide(moves[0], 1, 0.0) == 2
    assert 30 <= moves[0] < 40  # late enough to pay little, early enough to be there at the rise


def _diurnal_days(days: int, interval_s: float) -> np.ndarray:
    t = np.arange(int(days * 86400 / interval_s)) * interval_s
    return 1.0 + 0.8 * np.sin(2 * np.pi * t / 86400.0) ** 2


def _kale_program(price: float | None, days: int = 3) -> sim.PolicyResult:
    """Kale on a smooth diurnal trace (2 days of history, then ``days - 2`` scored), seamless moves,
    planning over 3 hours at ``price`` (None: Eq. 10, the default)."""
    cfg = sim.SimConfig(migration="seamless", interval_s=300.0, program_horizon_s=None if price is None else 10800.0,
                        program_lag_price=8.0 if price is None else price)
    shape = _diurnal_days(days, cfg.interval_s)
    split = int(2 * 86400 / cfg.interval_s)
    history, window = shape[:split], shape[split:]
    scaled = sim.scale_to_peak(window, cfg)
    factor = float(scaled.max() / window.max())
    kale = sim.planner_factory("kale", cfg, sim.MIGRATIONS["seamless"])
    return sim.simulate(scaled, {"kale": kale}, cfg, history=history * factor)["kale"]


def test_kale_planning_over_hours_trades_workers_for_lag_at_its_price() -> None:
    """On a smooth diurnal day kale sizing each bin by Eq. 10 runs its workers nearly busy and
    pays each move's pause in lag; planning over 3 hours with the lag priced keeps a fraction of
    that lag for a few more worker-hours and fewer moves, and a higher price buys less lag for
    more workers."""
    eq10, cheap, dear = _kale_program(None), _kale_program(4.0), _kale_program(32.0)
    assert cheap.accumulated_lag_min < 0.5 * eq10.accumulated_lag_min
    assert cheap.scaling_actions < eq10.scaling_actions
    assert cheap.worker_hours < 1.25 * eq10.worker_hours
    assert dear.accumulated_lag_min < cheap.accumulated_lag_min
    assert dear.worker_hours > cheap.worker_hours
    assert max(dear.slo_violation_rate, cheap.slo_violation_rate) == 0.0


def test_a_program_of_no_horizon_or_no_price_is_refused() -> None:
    with pytest.raises(ConfigError, match="program_horizon_s"):
        KalePlanner(program_horizon_s=0.0)
    with pytest.raises(ConfigError, match="program_lag_price"):
        KalePlanner(program_horizon_s=3600.0, program_lag_price=0.0)
    with pytest.raises(ValueError, match="horizon"):
        lag_program.solve(F, DT, PHASES, True, 1.0, np.ones(5), np.ones(2), 0.0, 1, 3)


def test_a_low_price_keeps_the_slo_only_with_its_penalty() -> None:
    """Traffic 1.3x what one worker trains for three hours, the lag priced at almost nothing: the
    program keeps its one worker for two hours and more, the oldest sample aging past the 15-minute
    bound (what still waits at the horizon's end is priced, so it moves near it); with the SLO's
    penalty it adds a worker before the bound is passed."""
    past = np.full(60, 100.0 * DT)
    ahead = np.full(180, 130.0 * DT)

    def first_move(slo_s: float | None) -> int | None:
        policy = lag_program.solve(F, DT, PHASES, True, 0.01, past, ahead, 0.0, 1, 3, slo_s=slo_s)
        backlog = 0.0
        for k in range(len(policy.keep)):
            if policy.decide(k, 1, backlog) != 1:
                return k
            backlog += ahead[k] - F[1] * DT
        return None

    unpenalized = first_move(None)
    assert unpenalized is None or unpenalized > 120
    moved = first_move(900.0)
    assert moved is not None and (moved + len(PHASES)) * 30.0 / 130.0 < 15.0  # minutes of age when its workers come


def _diurnal_program(interval_s: float) -> tuple[sim.PolicyResult, KalePlanner]:
    """Kale planning over an hour on a diurnal trace, two days of history and 3 hours scored, its
    traffic counted every ``interval_s`` (the same rates whatever the interval: scaled as the
    simulator scales the trace counted per minute)."""
    def rate(interval: float) -> np.ndarray:
        t = np.arange(int(2.125 * 86400 / interval)) * interval
        return 1.0 + 0.8 * np.sin(2 * np.pi * t / 86400.0) ** 2 + 0.3 * (np.sin(2 * np.pi * t / 5400.0) > 0.7)

    per_minute = rate(60.0)[int(2 * 86400 / 60.0):] * 60.0
    factor = float(sim.scale_to_peak(per_minute, sim.SimConfig()).max() / per_minute.max())
    cfg = sim.SimConfig(migration="seamless", interval_s=interval_s, noise=0.0, program_horizon_s=3600.0)
    counts, split = rate(interval_s) * interval_s * factor, int(2 * 86400 / interval_s)
    made: list[KalePlanner] = []
    make = sim.planner_factory("kale", cfg, sim.MIGRATIONS["seamless"])

    def keep() -> KalePlanner:
        made.append(make())
        return made[-1]

    return sim.simulate(counts[split:], {"kale": keep}, cfg, history=counts[:split])["kale"], made[0]


def test_a_live_job_s_seconds_are_summed_into_minute_steps_for_the_program() -> None:
    """A live job counts arrivals every planner interval (a second at ``tidal run``'s defaults):
    the program sums them into minute steps, so an hour is 60 steps to solve over (3,600 before,
    a solve that took minutes), and plans as it does on the same traffic counted per minute."""
    by_minute, _ = _diurnal_program(60.0)
    by_second, kale = _diurnal_program(1.0)
    assert kale._policy is not None
    mig = sim.MIGRATIONS["seamless"]
    phases = lag_program.action_phases(mig.prep_s, mig.pause_s, 60.0, lambda since, span: 0.0)
    assert len(kale._policy.keep) == 60 - len(phases) + 1  # decisions over the hour's minute steps
    assert by_second.scaling_actions == by_minute.scaling_actions
    assert by_second.worker_hours == pytest.approx(by_minute.worker_hours, rel=0.02)
    assert by_second.accumulated_lag_min == pytest.approx(by_minute.accumulated_lag_min, rel=0.25)
    assert by_second.slo_violation_rate == by_minute.slo_violation_rate == 0.0


def test_the_program_holds_while_its_action_forms() -> None:
    """A live master asks every planner interval and may read the job ready before the new count
    has begun to form: the program, which paid the action's lead before its next decision, holds
    until that lead has passed, then decides again. Handed one worker with 24,000 samples waiting
    (appended before it started: no arrival it saw holds them, so they are aged from the lag), it
    adds a second."""
    kale = KalePlanner(program_horizon_s=3600.0, lead_s=40.0, pause_s=5.0, measure_actions=False)
    now, backlog, current, reasons = 0.0, 24_000.0, 1, []
    for _ in range(12):
        stream = StreamObservation(interval_s=5.0, arrivals=[0.0], measured=[(current, 128.0 * current)],
                                   backlog=backlog, lag_s=now + 60.0, utilization=1.0)
        plan = kale.plan(JobObservation(job_id="j", now_s=now, min_workers=1, max_workers=2, current_workers=current,
                                        target_workers=current, ready=True, stream=stream))
        reasons.append(plan.reason)
        current, backlog, now = plan.workers, backlog - 128.0 * current * 5.0, now + 5.0
    assert reasons[0].startswith("program: 2 workers at 24000 samples waiting")
    assert reasons[1:8] == ["program: an action under way"] * 7  # 40 s of lead, asked every 5 s
    assert reasons[8].startswith("program: ") and current == 2
