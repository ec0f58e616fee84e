"""OOM prediction on a linear memory growth (DLRover-RM 5.3)."""

from __future__ import annotations

import pytest

from tidal.brain.oom import fit_memory_growth, predict_oom


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
