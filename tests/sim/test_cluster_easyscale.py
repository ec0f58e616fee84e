"""The easyscale cluster scenario on a 40-job window: invariants and the pure planners in use."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.api import ConfigError
from tidal.sim.cluster import easyscale, scenario

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
PHILLY = TRACES / "philly-jobs.csv"
pytestmark = pytest.mark.skipif(not PHILLY.exists(), reason="needs ../shared/traces")


class Checked(easyscale._Usage):
    """Usage recorder that also checks no GPU is given twice."""

    def record(self, now: float, busy_gpus: int) -> None:
        assert 0 <= busy_gpus <= self.total
        super().record(now, busy_gpus)


def test_small_run_invariants(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(easyscale, "_Usage", Checked)
    jobs = easyscale._make_jobs(PHILLY, 40, 1)
    per_type = {t: s * g for t, s, g in easyscale.SERVERS}
    orig = easyscale.true_rate

    def rate(job, counts, servers=None):  # every allocation stays within each type's GPUs
        for t, n in counts.items():
            assert 0 <= n <= per_type[t]
        assert sum(counts.values()) <= job.max_p
        return orig(job, counts, servers)

    monkeypatch.setattr(easyscale, "true_rate", rate)
    for policy in easyscale.POLICIES:
        fresh = easyscale._make_jobs(PHILLY, 40, 1)
        m = easyscale._simulate(fresh, policy)
        assert m.completion_rate == 1.0
        for j in fresh:
            assert j.end_s is not None and j.start_s is not None
            assert j.end_s - j.submit_s >= j.ideal_s * (1 - 1e-6)
        assert 0 < m.gpu_util <= 1 and m.makespan_s > 0
        assert len(m.jcts) == 40 and 0 < len(m.timeline) <= 2001
    assert len(jobs) == 40


def test_run_api_and_errors():
    res = scenario("easyscale").run(PHILLY, 30, 2, ["yarn-cs", "easyscale-heter"])
    assert set(res.policies) == {"yarn-cs", "easyscale-heter"}
    assert res.policies["easyscale-heter"].avg_jct_s <= res.policies["yarn-cs"].avg_jct_s
    assert "Pollux" in res.notes[0]
    with pytest.raises(ConfigError):
        easyscale.run(PHILLY, 10, 0, ["nope"])


def test_pollux_profiles_match_embedded():
    fitted = easyscale.pollux_profiles(TRACES / "pollux-throughput")
    for app, prof in easyscale._EMBEDDED.items():
        assert fitted[app].compute_s == pytest.approx(prof.compute_s, rel=1e-3)
        assert fitted[app].multi[0] == pytest.approx(prof.multi[0], rel=1e-3)
