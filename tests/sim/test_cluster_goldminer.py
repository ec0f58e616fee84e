"""The goldminer cluster scenario on a 40-job window: invariants (no over-allocation, all done)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.api import ConfigError
from tidal.sim.cluster import goldminer, scenario

PHILLY = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "philly-jobs.csv"
pytestmark = pytest.mark.skipif(not PHILLY.exists(), reason="needs ../shared/traces")


class Checked(goldminer._Cluster):
    def usage(self) -> tuple[float, float]:
        for n in self.gpus:
            assert 0 <= self.gpus[n] <= goldminer.GPUS, (n, self.gpus[n])
            assert 0 <= self.cpus[n] <= goldminer.CPUS, (n, self.cpus[n])
        return super().usage()


@pytest.mark.parametrize("policy", goldminer.POLICIES)
def test_small_run_invariants(policy: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(goldminer, "_Cluster", Checked)
    jobs = goldminer._make_jobs(PHILLY, 40, 2)
    m = goldminer._simulate(jobs, policy)
    assert m.completion_rate == 1.0
    for j in jobs:
        assert j.end_s is not None and j.end_s - j.submit_s >= j.ideal_s * (1 - 1e-6)
    assert 0 < m.gpu_util <= 1 and 0 < m.cpu_util <= 1
    if policy.startswith("goldminer-"):
        assert m.scaling_actions > 0


def test_run_api_and_errors():
    res = scenario("goldminer").run(PHILLY, 30, 2, ["no-dw-tuned", "goldminer-srtf"])
    assert res.policies["goldminer-srtf"].avg_jct_s <= 1.001 * res.policies["no-dw-tuned"].avg_jct_s
    with pytest.raises(ConfigError):
        goldminer.run(PHILLY, 10, 0, ["nope"])


def test_load_stretches_arrivals_only():
    from tidal.sim.cluster.api import at_load, load_philly, offered_load

    jobs = load_philly(PHILLY, 200, 0, max_gpus=64)
    assert offered_load(jobs, 64) > 1  # Philly's own rate overloads 64 GPUs
    for load in (0.5, 2.0):
        light = at_load(jobs, load, 64)
        assert offered_load(light, 64) == pytest.approx(load)
        assert [(j.duration_s, j.num_gpus) for j in light] == [(j.duration_s, j.num_gpus) for j in jobs]
        assert [j.submit_s for j in light] == sorted(j.submit_s for j in light)
    with pytest.raises(ConfigError):
        at_load(jobs, 0.0, 64)
    # a lighter load queues less under the same policy, on the same jobs
    heavy = goldminer.run(PHILLY, 100, 1, ["no-dw-hw"], load=4.0).policies["no-dw-hw"]
    light_m = goldminer.run(PHILLY, 100, 1, ["no-dw-hw"], load=0.25).policies["no-dw-hw"]
    assert light_m.avg_queue_s < heavy.avg_queue_s
