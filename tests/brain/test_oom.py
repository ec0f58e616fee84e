"""OOM prediction on a linear memory growth (DLRover-RM 5.3)."""

from __future__ import annotations

import pytest

from tidal.brain.oom import fit_memory_growth, predict_oom, servers_for_memory


def test_linear_growth_predicts_oom_before_it_happens():
    samples = [(s, 4.0 + 0.001 * s) for s in (0, 1000, 2000, 3000)]  # 4 GB + 1 MB/step
    assert fit_memory_growth(samples) == pytest.approx((4.0, 0.001))
    f = predict_oom(samples, total_steps=10_000, capacity_gb=12.0)  # needs 14 GB at the end
    assert f.will_oom
    assert f.predicted_gb == pytest.approx(14.0)
    assert f.oom_at_step == pytest.approx(8000.0)
    assert f.recommended_gb == pytest.approx(14.0 * 1.2)


def test_no_oom_when_it_fits_and_flat_memory():
    samples = [(s, 4.0 + 0.001 * s) for s in (0, 1000)]
    assert not predict_oom(samples, 5000, 16.0).will_oom
    flat = predict_oom([(0, 5.0), (100, 5.0)], 10**9, 8.0)
    assert not flat.will_oom and flat.oom_at_step == float("inf")
    with pytest.raises(ValueError):
        fit_memory_growth([])


def test_servers_for_memory_adds_servers_before_they_fill() -> None:
    # 1 MiB per 1000 samples, 10,000 samples in all: 10 MiB at the end on servers of 4 MiB each
    samples = [(1000.0 * k, float(k)) for k in range(1, 4)]
    plan = servers_for_memory(samples, 10_000, per_server=4.0, servers=1, max_servers=8)
    assert plan.forecast.will_oom and plan.forecast.predicted_gb == pytest.approx(10.0)
    assert plan.servers == 4 and plan.enough  # ceil(10 * 1.2 / (4 * 0.95)) = 4
    capped = servers_for_memory(samples, 10_000, per_server=4.0, servers=1, max_servers=2)
    assert capped.servers == 2 and not capped.enough
    fits = servers_for_memory(samples, 10_000, per_server=4.0, servers=4, max_servers=8)
    assert fits.servers == 4 and fits.enough and not fits.forecast.will_oom
    # never fewer servers than now, even when a flat history needs fewer
    flat = servers_for_memory([(1.0, 1.0), (2.0, 1.0)], 100, per_server=4.0, servers=3, max_servers=8)
    assert flat.servers == 3 and flat.enough
