"""The easyscale cluster scenario on a 40-job window: invariants and the pure planners in use."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.api import ConfigError
from tidal.sim.cluster import easyscale, scenario
from tidal.sim.cluster.api import srpt_mean_flow_s

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


def test_the_capacity_bound_is_srpt_on_one_machine_and_no_policy_beats_it():
    """``srpt_mean_flow_s``: two jobs at 0 of work 2 and 1 at speed 1 end at 1 and 3; a job of
    work 4 is preempted at 1 by one of work 1, which ends at 2, the first at 5. On a window where
    the cluster queues (seed 106: 391 one-GPU jobs within three hours), the bound is above the
    ideal durations' and every policy's average JCT is above it."""
    assert srpt_mean_flow_s([(0.0, 2.0), (0.0, 1.0)], 1.0) == pytest.approx(2.0)
    assert srpt_mean_flow_s([(0.0, 4.0), (1.0, 1.0)], 1.0) == pytest.approx(3.0)
    assert srpt_mean_flow_s([(5.0, 6.0)], 3.0) == pytest.approx(2.0)
    res = easyscale.run(PHILLY, 500, 106, easyscale.POLICIES)
    capacity = res.policies["yarn-cs"].avg_capacity_s
    assert capacity is not None and capacity > 2 * res.policies["yarn-cs"].avg_ideal_s
    for m in res.policies.values():
        assert m.avg_capacity_s == capacity and m.avg_jct_s >= capacity


def test_least_attained_service_first_shortens_a_queued_window(monkeypatch: pytest.MonkeyPatch):
    """Seed 3 (a tuning window; YARN-CS queues jobs 75 h on average): EasyScale served least attained
    service first, preempting after 4 hours, completes every job with a lower average JCT than in
    submission order (the paper's queue: ``PREEMPT_AFTER_S`` None), by starting jobs sooner."""
    las = easyscale._simulate(easyscale._make_jobs(PHILLY, 500, 3), "easyscale-heter")
    monkeypatch.setattr(easyscale, "PREEMPT_AFTER_S", None)
    fifo = easyscale._simulate(easyscale._make_jobs(PHILLY, 500, 3), "easyscale-heter")
    assert las.completion_rate == fifo.completion_rate == 1.0
    assert las.avg_jct_s < 0.9 * fifo.avg_jct_s
    assert las.avg_queue_s < fifo.avg_queue_s


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
