"""A small dlrover-rm scenario: invariants of the simulation, every policy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tidal.api import ConfigError
from tidal.brain.dlrover import PSConfig
from tidal.sim.cluster import dlrover_rm as scen
from tidal.sim.cluster import scenario

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "philly-jobs.csv"
pytestmark = pytest.mark.skipif(not TRACE.exists(), reason="Philly trace not present")


@pytest.mark.parametrize("policy", scen.POLICIES)
def test_invariants(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs, nodes = scen.make_jobs(TRACE, 30, 3)
    sim = scen.Sim(policy, jobs, nodes * scen.NODE_CORES, nodes * scen.NODE_MEM_GB, 3)
    peak = {"cpu": 0.0, "mem": 0.0}
    alloc = sim.alloc

    def checked(old, new):  # type: ignore[no-untyped-def]
        ok = alloc(old, new)
        peak["cpu"] = max(peak["cpu"], sim.used_cpu)
        peak["mem"] = max(peak["mem"], sim.used_mem)
        return ok

    monkeypatch.setattr(sim, "alloc", checked)
    m = sim.run()
    assert peak["cpu"] <= sim.cores + 1e-6 and peak["mem"] <= sim.mem + 1e-6
    assert sim.used_cpu == pytest.approx(0.0, abs=1e-6)  # everything released
    done = [j for j in jobs if j.state == "done"]
    failed = [j for j in jobs if j.state == "failed"]
    assert len(done) + len(failed) == len(jobs)
    assert m.completion_rate == pytest.approx(len(done) / len(jobs))
    for j in done:
        assert j.end - j.submit >= j.duration * (1 - 1e-6)  # never faster than the ideal
        assert j.cfg.cpus() <= j.quota or policy == "manual"
    assert len(m.jcts) == len(done) and 0 <= m.cpu_util <= 1
    # per job, cores used never exceed cores allocated (DLRover Fig. 2's statistic)
    assert all(j.core_s_used <= j.core_s_allocated * (1 + 1e-9) for j in jobs)
    assert 0 < m.extra["job_cpu_util_median"] <= 1 and 0 <= m.extra["jobs_below_half_cpu"] <= 1
    assert len(m.timeline) <= scen.TIMELINE_POINTS + 10
    if policy != "manual":
        assert not failed
    else:
        assert m.scaling_actions == 0


def test_run_reports_all_policies_and_warm_start() -> None:
    res = scenario("dlrover-rm").run(TRACE, 40, 0, ["manual", "dlrover-rm"])
    assert set(res.policies) == {"manual", "dlrover-rm"}
    rm = res.policies["dlrover-rm"]
    assert not math.isnan(rm.median_jct_s)
    if rm.extra.get("recurring_jobs"):
        assert 0 <= rm.extra["warm_start_worker_rel_err"] <= 10
    assert rm.to_json()["completion_rate"] == rm.completion_rate


def test_load_sizes_the_cluster() -> None:
    _, busy = scen.make_jobs(TRACE, 60, 1, load=4.0)
    _, roomy = scen.make_jobs(TRACE, 60, 1, load=0.5)
    assert busy <= roomy
    with pytest.raises(ConfigError):
        scen.make_jobs(TRACE, 60, 1, load=-1.0)


def test_observation_carries_the_configuration() -> None:
    jobs, nodes = scen.make_jobs(TRACE, 30, 3)
    sim = scen.Sim("dlrover", jobs, nodes * scen.NODE_CORES, nodes * scen.NODE_MEM_GB, 3)
    j = jobs[0]
    sim.t = j.submit
    assert sim.start(j)
    obs = sim.observe(j)
    assert obs.ps is not None and obs.ps.cpu_quota == j.quota
    assert PSConfig.from_observation(obs) == j.cfg  # the planners see the configuration the job holds
    assert not obs.ready and obs.samples_per_s == 0.0  # its pods are still starting
    assert obs.ps.free_cpus == pytest.approx(sim.cores - j.cfg.cpus())
    assert j.planner is not None and PSConfig.from_plan(j.planner.plan(obs), j.cfg) == j.cfg  # waits


def test_a_seed_is_simulated_the_same_after_another_in_one_process() -> None:
    """Every seed has kinds of the same names with other coefficients: a cache keyed by name made
    a second seed in one process (a robustness sweep) run on the first seed's ideal throughputs."""
    def manual(seed: int) -> float:
        return scen.run(TRACE, 40, seed, ["manual"]).policies["manual"].avg_jct_s

    scen._IDEAL.clear()
    alone = manual(2)
    scen._IDEAL.clear()
    manual(1)
    assert manual(2) == alone


def test_jobs_out_tells_where_each_jobs_time_went(tmp_path: Path) -> None:
    """``tidal sim cluster --jobs-out``: one line per job and policy, consistent with the metrics."""
    import json

    from typer.testing import CliRunner

    from tidal.cli import _register_commands, app

    _register_commands()
    out = tmp_path / "jobs.jsonl"
    res = CliRunner().invoke(app, ["sim", "cluster", "--scenario", "dlrover-rm", "--trace", str(TRACE), "--jobs", "30",
                                   "--seed", "3", "--policies", "manual,dlrover-rm", "--jobs-out", str(out)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted({r["policy"] for r in rows}) == ["dlrover-rm", "manual"]
    assert len(rows) == 2 * 30
    for r in rows:
        assert r["core_s_used"] <= r["core_s_allocated"] * (1 + 1e-9)
        if r["state"] == "done":
            assert r["jct_s"] >= r["queue_s"] >= 0 and r["jct_s"] >= r["ideal_s"] * (1 - 1e-6)
        assert len(r["decisions"]) == r["actions"]
        if r["policy"] == "manual":
            assert r["actions"] == 0 and r["final"] == r["submitted_with"]
    assert any(r["decisions"] for r in rows if r["policy"] == "dlrover-rm")


def test_users_fit_the_quota_keeping_their_configurations_shape() -> None:
    """Over the quota, the users' (manual's, es's) request shrinks workers and PSes together:
    dropping workers first made 1-worker, 18-PS jobs that es (which keeps the PSes) ran for
    474 simulated days."""
    jobs, nodes = scen.make_jobs(TRACE, 500, 3)
    sim = scen.Sim("manual", jobs, nodes * scen.NODE_CORES, nodes * scen.NODE_MEM_GB, 3)
    for j in jobs:
        _, best = scen.ideal(j.kind, j.quota)
        asked = (max(1, round(best.workers * j.kind.user_count[0])), max(1, round(best.ps * j.kind.user_count[1])))
        got = sim.user_config(j, best)
        assert got.cpus() <= j.quota
        # the worker share of the pods moves by no more than the last pod taken off either side
        share, asked_share = got.workers / (got.workers + got.ps), asked[0] / sum(asked)
        assert abs(share - asked_share) <= 1 / (got.workers + got.ps) + 0.05, (j.jid, asked, got)


def test_dlrover_rm_migrates_seamlessly() -> None:
    """DLRover-RM 5.2: new pods start while the old configuration trains, holding resources
    beside it; then the job pauses for the flash checkpoint and re-partition only. A baseline
    stops, and its new worker shape starts before it trains again."""
    for policy in ("dlrover-rm", "es"):
        jobs, nodes = scen.make_jobs(TRACE, 30, 3)
        sim = scen.Sim(policy, jobs, nodes * scen.NODE_CORES, nodes * scen.NODE_MEM_GB, 3)
        j = jobs[0]
        sim.t = j.submit
        j.want = PSConfig(2, 1, 4, 4, 4.0, 8.0)
        assert sim.start(j)
        sim.running.append(j)
        sim.t = j.paused_until
        sim.refresh()
        old, held = j.cfg, sim.used_cpu
        new = PSConfig(4, 2, 2, 4, 4.0, 4.0)  # every worker reshaped, PSes changed
        sim.apply(j, new)
        sim.refresh()
        if policy == "dlrover-rm":
            assert j.migration is not None and j.cfg == old and j.last_thp > 0  # still training
            assert sim.used_cpu == held + new.cpus()  # both configurations held
            assert not sim.observe(j).ready
            sim.advance(scen.START_S)
            sim.t += scen.START_S
            sim.check(j)
            sim.refresh()
            assert j.migration is None and j.cfg == new and sim.used_cpu == new.cpus()
            assert j.paused_until == pytest.approx(sim.t + scen.PS_PAUSE_S["dlrover-rm"]) and j.last_thp == 0
        else:
            assert j.migration is None and j.cfg == new and j.last_thp == 0
            assert j.paused_until == pytest.approx(sim.t + scen.START_S + scen.PS_PAUSE_DEFAULT_S)
