"""The worker-hour bound with every scaling action paid, against every schedule of the simulator."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np
import pytest

from tidal.api import ConfigError, JobObservation, ResourcePlan
from tidal.sim import online as sim
from tidal.sim.paid_bound import lag_priced_worker_hours, paid_moves_worker_hours


class Scripted:
    """Answers the simulator's n + 1 plan calls (the launch, then one per interval) from a list."""

    def __init__(self, counts: Sequence[int]) -> None:
        self.counts, self.calls = counts, 0

    def plan(self, obs: JobObservation) -> ResourcePlan:
        self.calls += 1
        return ResourcePlan(workers=self.counts[self.calls - 1])


def simulate_every_schedule(window: np.ndarray, cfg: sim.SimConfig) -> list[sim.PolicyResult]:
    """The simulator's results for every count sequence it can be told."""
    schedules = list(itertools.product(range(1, cfg.peak_workers + 1), repeat=len(window) + 1))
    factories = {str(i): (lambda s=s: Scripted(s)) for i, s in enumerate(schedules)}
    return list(sim.simulate(window, factories, cfg).values())  # type: ignore[arg-type]


def every_schedule(window: np.ndarray, cfg: sim.SimConfig) -> list[tuple[float, int]]:
    """(worker-hours, intervals over the SLO) of every count sequence the simulator can be told."""
    return [(r.worker_hours, round(r.slo_violation_rate * len(window))) for r in simulate_every_schedule(window, cfg)]


@pytest.mark.parametrize("migration", ["restart", "seamless"])
def test_the_bound_is_the_cheapest_schedule_the_simulator_can_run(migration: str) -> None:
    """Ten 5-minute intervals (a restart pauses two, the SLO is four), 1 or 2 workers, a burst
    that 1 worker cannot keep: every one of the 2^11 schedules simulated. The bound is at most
    the cheapest that keeps the SLO (with one interval over allowed, too), at the default grid,
    and equal to it on a fine one."""
    cfg = sim.SimConfig(peak_workers=2, migration=migration, interval_s=300.0)
    f1 = sim.true_throughput(cfg, 1) * 300.0
    window = np.array([0.6, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 0.3, 0.3, 0.3]) * f1
    runs = every_schedule(window, cfg)
    for allowed in (0, 1):
        share = allowed / len(window) + 1e-9
        cheapest = min(wh for wh, over in runs if over <= allowed)
        assert paid_moves_worker_hours(window, cfg, violations=share) <= cheapest + 1e-9
        assert paid_moves_worker_hours(window, cfg, violations=share, grid=2000) == pytest.approx(cheapest), allowed
    strict = min(wh for wh, over in runs if over == 0)
    assert strict > sim.oracle_worker_hours(window, cfg) + 0.1  # the free-rescaling bound is below it


def test_a_scale_in_cheaper_than_a_scale_out_is_paid_as_the_simulator_pays_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """As live: a scale-out three 5-minute intervals long (the new workers start for 10 minutes),
    a scale-in one (the leaver's goodbye, then the pause). A burst at the start, then nothing: the
    cheapest schedule scales in right after it. Over all 2^11 schedules simulated, the bound is the
    cheapest on a fine grid (and within 0.2% of the Lagrangian dual of the lag-priced one), and it
    is below what the same window costs when a scale-in takes as long as a scale-out."""
    monkeypatch.setitem(sim.MIGRATIONS, "asymmetric", sim.Migration(
        "asymmetric", prep_s=600.0, pause_s=60.0, scale_in_prep_s=30.0, scale_in_pause_s=60.0))
    monkeypatch.setitem(sim.MIGRATIONS, "symmetric", sim.Migration("symmetric", prep_s=600.0, pause_s=60.0))
    cfg = sim.SimConfig(peak_workers=2, migration="asymmetric", interval_s=300.0)
    window = np.array([1.9, 1.9, 1.9, 1.9, 1.9, 0.0, 0.0, 0.0, 0.0, 0.0]) * sim.true_throughput(cfg, 1) * 300.0
    results = simulate_every_schedule(window, cfg)
    cheapest = min(r.worker_hours for r in results if r.slo_violation_rate == 0)
    assert paid_moves_worker_hours(window, cfg) <= cheapest + 1e-9
    assert paid_moves_worker_hours(window, cfg, grid=2000) == pytest.approx(cheapest)
    symmetric = dataclasses.replace(cfg, migration="symmetric")
    assert paid_moves_worker_hours(window, symmetric, grid=2000) > cheapest + 0.05
    hours = np.array([r.worker_hours for r in results])
    lag = np.array([r.accumulated_lag_min for r in results])
    for budget in (float(lag.min()), float(np.quantile(lag, 0.1)), float(np.median(lag))):
        within = float(hours[lag <= budget + 1e-9].min())
        dual = simulated_dual(hours, lag, budget)
        assert dual * 0.998 <= lag_priced_worker_hours(window, cfg, budget, grid=2000) <= within + 1e-9, budget


def test_a_stream_no_schedule_keeps_is_inf_and_bad_input_is_refused() -> None:
    cfg = sim.SimConfig(peak_workers=2, interval_s=300.0)
    flood = np.full(12, 10 * sim.true_throughput(cfg, 2) * 300.0)
    assert paid_moves_worker_hours(flood, cfg) == float("inf")
    with pytest.raises(ConfigError, match="violations"):
        paid_moves_worker_hours(flood, cfg, violations=1.5)
    with pytest.raises(ConfigError, match="migration"):
        paid_moves_worker_hours(flood, sim.SimConfig(migration="teleport"))


def every_schedule_lag(window: np.ndarray, cfg: sim.SimConfig) -> tuple[np.ndarray, np.ndarray]:
    """(worker-hours, accumulated lag-minutes) of every count sequence the simulator can be told."""
    res = simulate_every_schedule(window, cfg)
    return np.array([r.worker_hours for r in res]), np.array([r.accumulated_lag_min for r in res])


def simulated_dual(hours: np.ndarray, lag: np.ndarray, budget: float) -> float:
    """The Lagrangian dual of the simulated schedules within ``budget`` lag-minutes, over 2,000
    prices (below the true dual: the prices are a grid)."""
    return max(float(np.min(hours + mu * (lag - budget))) for mu in np.exp(np.linspace(-10.0, 10.0, 2000)))


@pytest.mark.parametrize("migration", ["restart", "seamless"])
def test_the_lag_priced_bound_is_the_lagrangian_dual_of_every_schedule(migration: str) -> None:
    """The live bench's setting in small: 3 partitions under global shuffling (2 workers leave one
    of them with two partitions, so its full queue holds records back), a pipeline latency of 200 s
    in 5-minute intervals, and a quiet interval. Over all 2^11 schedules simulated: for lag budgets
    from the least lag any schedule has to the median, the bound is at most the cheapest schedule
    within the budget and, on a fine grid, within 0.2% of the Lagrangian dual of the simulated
    schedules themselves (each interval's lag priced as the simulator counts it); where the budget
    binds it is above the bound with the lag free; under the latency every schedule has, ``inf``."""
    cfg = sim.SimConfig(peak_workers=2, migration=migration, interval_s=300.0, partitions=3, latency_s=200.0)
    cfg.shuffle_upper = 0.3 * sim.true_throughput(cfg, 1) * 60.0
    f1 = sim.true_throughput(cfg, 1) * 300.0
    window = np.array([0.6, 1.9, 1.9, 1.9, 1.9, 0.0, 1.9, 0.3, 0.3, 0.3]) * f1
    hours, lag = every_schedule_lag(window, cfg)
    free = paid_moves_worker_hours(window, cfg, violations=0.99)
    for budget in (float(lag.min()), float(np.quantile(lag, 0.1)), float(np.median(lag))):
        cheapest = float(hours[lag <= budget + 1e-9].min())
        dual = simulated_dual(hours, lag, budget)
        bound = lag_priced_worker_hours(window, cfg, budget, grid=2000)
        assert lag_priced_worker_hours(window, cfg, budget) <= cheapest + 1e-9
        assert dual * 0.998 <= bound <= cheapest + 1e-9, (budget, dual, bound, cheapest)
    assert lag_priced_worker_hours(window, cfg, float(lag.min()), grid=2000) > free + 0.4
    assert lag_priced_worker_hours(window, cfg, 0.0) == float("inf")  # under the pipeline's latency
    with pytest.raises(ConfigError, match="lag budget"):
        lag_priced_worker_hours(window, cfg, -1.0)
