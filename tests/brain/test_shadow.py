"""The shadow HPA (``tidal.brain.shadow``) against the simulator's HPA on the same traffic, and kale
setting its lag price against it (``KalePlanner(program_lag_ratio=...)``)."""

from __future__ import annotations

import numpy as np
import pytest

from tidal.api import ConfigError
from tidal.brain import shadow as shadow_module
from tidal.brain.kale import PROGRAM_PRICE_RANGE, KalePlanner
from tidal.brain.shadow import ShadowHPA
from tidal.sim import online as sim


def _diurnal(days: float, interval_s: float) -> np.ndarray:
    t = np.arange(int(days * 86400 / interval_s)) * interval_s
    return 1.0 + 0.8 * np.sin(2 * np.pi * t / 86400.0) ** 2 + 0.3 * (np.sin(2 * np.pi * t / 5400.0) > 0.7)


@pytest.mark.parametrize("migration", ["seamless", "restart"])
def test_the_shadow_accumulates_the_lag_the_simulated_hpa_does(migration: str) -> None:
    """With no throughput noise and the true F(w), the shadow HPA's queue is the simulator's: the
    same accumulated lag within a few percent (the simulator's first count is sized from the first
    hour's traffic, as is the shadow's here), and a lag that is not zero."""
    cfg = sim.SimConfig(migration=migration, noise=0.0)
    scaled = sim.scale_to_peak(_diurnal(1.0, cfg.interval_s), cfg)
    hpa = sim.simulate(scaled, ["hpa"], cfg)["hpa"]
    mig = sim.MIGRATIONS[migration]
    f = [sim.true_throughput(cfg, w) for w in range(cfg.peak_workers + 1)]
    first = float(np.mean(scaled[:60])) / cfg.interval_s
    shadow = ShadowHPA(workers=next(w for w in range(1, cfg.peak_workers + 1) if f[w] > first),
                       max_workers=cfg.peak_workers, lead_s=mig.prep_s + mig.pause_s, pause_s=mig.pause_s)
    for a in scaled:
        shadow.step(float(a), cfg.interval_s, f.__getitem__)
    assert hpa.accumulated_lag_min > 10.0
    assert shadow.accumulated_lag_min == pytest.approx(hpa.accumulated_lag_min, rel=0.05)


def _kale_ratio(ratio: float) -> tuple[sim.PolicyResult, KalePlanner]:
    """Kale planning over an hour on a smooth diurnal trace of 5-minute metrics (2 days of history,
    one scored), its price set against a shadow HPA's lag at ``ratio``, starting at 8."""
    cfg = sim.SimConfig(migration="seamless", interval_s=300.0, program_horizon_s=3600.0, program_lag_price=8.0,
                        program_lag_ratio=ratio)
    shape = _diurnal(3.0, cfg.interval_s)
    split = int(2 * 86400 / cfg.interval_s)
    scaled = sim.scale_to_peak(shape[split:], cfg)
    factor = float(scaled.max() / shape[split:].max())
    made: list[KalePlanner] = []
    make = sim.planner_factory("kale", cfg, sim.MIGRATIONS["seamless"])

    def keep() -> KalePlanner:
        made.append(make())
        return made[-1]

    return sim.simulate(scaled, {"kale": keep}, cfg, history=shape[:split] * factor)["kale"], made[0]


def test_kale_sets_its_price_to_keep_the_lag_at_its_ratio_of_the_shadows() -> None:
    """A tight ratio raises the price from where it started and buys the lag down with workers; a
    loose one lowers it and saves them; each within the price's range."""
    tight, tight_kale = _kale_ratio(0.02)
    loose, loose_kale = _kale_ratio(5.0)
    lo, hi = PROGRAM_PRICE_RANGE
    assert 8.0 < tight_kale.lag_price_now <= hi and lo <= loose_kale.lag_price_now < 8.0
    assert tight.accumulated_lag_min < loose.accumulated_lag_min
    assert tight.worker_hours > loose.worker_hours
    assert tight_kale._shadow is not None and tight_kale._shadow.accumulated_lag_min > 0


def test_a_ratio_needs_a_horizon_and_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="program_lag_ratio"):
        KalePlanner(program_lag_ratio=0.3)
    with pytest.raises(ConfigError, match="program_lag_ratio"):
        KalePlanner(program_horizon_s=3600.0, program_lag_ratio=0.0)


def test_the_shadow_drops_what_it_has_trained_and_ages_the_rest_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """A live job's shadow steps for weeks: the intervals trained through are dropped (every
    TRIM_AFTER of them), with every lag what it is when all are kept."""
    cfg = sim.SimConfig(migration="seamless", noise=0.0)
    scaled = sim.scale_to_peak(_diurnal(2.0, cfg.interval_s), cfg)
    f = [sim.true_throughput(cfg, w) for w in range(cfg.peak_workers + 1)]
    runs = []
    for keep in (10**9, 50):
        monkeypatch.setattr(shadow_module, "TRIM_AFTER", keep)
        shadow = ShadowHPA(workers=2, max_workers=cfg.peak_workers, lead_s=182.0, pause_s=122.0)
        runs.append(([shadow.step(float(a), cfg.interval_s, f.__getitem__) for a in scaled], len(shadow._cum)))
    (kept, n_kept), (trimmed, n_trimmed) = runs
    assert max(kept) > 60.0 and trimmed == kept
    assert n_kept == len(scaled) + 1 and n_trimmed < 3 * 50
