"""DLRover-RM: warm start (Algorithm 1), NSGA-II candidates, weighted greedy (Eq. 11-14)."""

from __future__ import annotations

import numpy as np
import pytest

from tidal.api import ConfigError, JobObservation, PSObservation
from tidal.brain.dlrover import PSConfig
from tidal.brain.dlrover_rm import (
    PAPER_PARAMS,
    Candidate,
    DLRoverRMPlanner,
    config_from_mapping,
    nsga_candidates,
    predict_many,
    split_step_time,
    throughput_gain,
    warm_start,
    weighted_greedy,
    weighted_greedy_weight,
)
from tidal.brain.history import InMemoryHistory, JobRecord


def ps_obs(c: PSConfig, thp: float, steps_done: float, total_steps: float, ps_mem_used_gb: float) -> JobObservation:
    """A PS job running ``c`` at ``thp`` steps/s (one "sample" is one step), quota 200 cores."""
    return JobObservation(
        job_id="j", min_workers=1, max_workers=200, current_workers=c.workers, target_workers=c.workers,
        samples_per_s=thp, steps_done=steps_done, total_steps=total_steps,
        ps=PSObservation(ps=c.ps, worker_cpu=c.worker_cpu, ps_cpu=c.ps_cpu, worker_mem_gb=c.worker_mem_gb,
                         ps_mem_gb=c.ps_mem_gb, hot_ps_cpu=c.hot_ps_cpu, cpu_quota=200, ps_mem_used_gb=ps_mem_used_gb))


def test_warm_start_top_k_and_smoothing():
    h = InMemoryHistory()
    h.add(JobRecord("a", 1.0, {"model": "wd", "user": "u1"}, {"workers": 10.0, "ps": 4.0}))
    h.add(JobRecord("b", 2.0, {"model": "wd", "user": "u1"}, {"workers": 20.0, "ps": 2.0}))
    h.add(JobRecord("c", 3.0, {"model": "wd", "user": "u2"}, {"workers": 40.0, "ps": 8.0}))
    h.add(JobRecord("d", 4.0, {"model": "xdfm", "user": "u3"}, {"workers": 99.0, "ps": 99.0}))  # not similar
    got = warm_start(h, {"model": "wd", "user": "u1"}, k=3, mu=0.5)
    # ranked least to most similar: c (0.5), a (1.0, older), b (1.0, newer)
    # A0 = c = 40; A1 = .5*10 + .5*40 = 25; A2 = .5*20 + .5*25 = 22.5
    assert got == pytest.approx({"workers": 22.5, "ps": 0.5 * 2 + 0.5 * (0.5 * 4 + 0.5 * 8)})
    assert warm_start(h, {"model": "dcn", "user": "u9"}, k=3) is None
    with pytest.raises(ValueError):
        warm_start(h, {"model": "wd"}, mu=1.0)


def test_a_warm_start_over_the_quota_keeps_its_shape() -> None:
    """A smoothed configuration of 27 workers x 1 core and 10 PSes x 6 cores (87 cores) on a
    64-core quota: both counts shrink together (19 x 1 + 7 x 6 = 61), not the workers alone
    (1 x 1 + 10 x 6, a configuration no similar job ran)."""
    smoothed = {"workers": 27.0, "ps": 10.0, "worker_cpu": 1.0, "ps_cpu": 6.0, "worker_mem_gb": 8.0, "ps_mem_gb": 4.0}
    c = config_from_mapping(smoothed, 64)
    assert (c.workers, c.ps, c.worker_cpu, c.ps_cpu) == (19, 7, 1, 6) and c.cpus() <= 64
    assert config_from_mapping({**smoothed, "workers": 5.0, "ps": 2.0}, 64).workers == 5  # within: as smoothed
    assert config_from_mapping({**smoothed, "ps_mem_total_gb": 70.0}, 64).ps_mem_gb == pytest.approx(10.0)  # 70 / 7
    for quota in (2, 3, 17, 64, 200):  # always within the quota, at least one pod each
        for conf in ({"workers": 300.0, "ps": 1.0, "worker_cpu": 32.0, "ps_cpu": 32.0},
                     {"workers": 1.0, "ps": 90.0, "worker_cpu": 2.0, "ps_cpu": 16.0}):
            got = config_from_mapping(conf, quota)
            assert got.cpus() <= max(quota, 2) and got.workers >= 1 and got.ps >= 1, (quota, conf, got)


def test_weighted_greedy_order_depends_on_rho():
    now = {"short": PSConfig(2, 1, 2, 2, 0, 0), "long": PSConfig(2, 1, 2, 2, 0, 0)}
    big = PSConfig(4, 1, 2, 2, 0, 0)  # +4 cores
    short = Candidate("short", big, throughput=10.0, cost=10, extra_cost=4, gain=1.0, remaining=1000.0)
    long = Candidate("long", big, throughput=10.0, cost=10, extra_cost=4, gain=2.0, remaining=100000.0)
    # only one fits: rho = 2.5 prefers the job closer to the end, rho = 0 the higher efficiency
    assert list(weighted_greedy([short, long], now, free_cpus=4, free_mem_gb=1e9, rho=2.5)) == ["short"]
    assert list(weighted_greedy([short, long], now, free_cpus=4, free_mem_gb=1e9, rho=0.0)) == ["long"]
    assert set(weighted_greedy([short, long], now, free_cpus=8, free_mem_gb=1e9)) == {"short", "long"}
    assert weighted_greedy_weight(100.0, 10.0, 2.5) == pytest.approx(10.0**-2.5)


def test_a_free_change_does_not_outrank_a_large_gain():
    """Eq. 11 divides the gain by the candidate's resource cost. Divided by the cost *added*
    (our reading before), a reshape costing nothing more had an infinite efficiency: a cold job
    took three such small steps, three minutes and a migration each, before the one that
    gained 2.5x (the cluster simulator, seed 100's j1)."""
    now = {"j": PSConfig(1, 2, 32, 8, 0, 0)}  # 48 cores
    reshape = Candidate("j", PSConfig(9, 3, 2, 4, 0, 0), throughput=50.0, cost=30, extra_cost=-18, gain=38.0,
                        remaining=1e5, current=now["j"])
    grow = Candidate("j", PSConfig(26, 8, 1, 4, 0, 0), throughput=124.0, cost=58, extra_cost=10, gain=112.0,
                     remaining=1e5, current=now["j"])
    assert list(weighted_greedy([reshape, grow], now, free_cpus=100, free_mem_gb=1e9).values()) == [grow]
    # without the room for it, the job still takes what fits
    assert list(weighted_greedy([reshape, grow], now, free_cpus=5, free_mem_gb=1e9).values()) == [reshape]


def test_throughput_gain_subtracts_overhead():
    # +5 steps/s, new pods for 120 s, PS pause 60 s at 10 steps/s, over 1200 s: 5 - (600 + 600)/1200 = 4
    assert throughput_gain(15.0, 10.0, True, True, 1200.0) == pytest.approx(4.0)


def dominated(f: np.ndarray, i: int) -> bool:
    return bool(np.any(np.all(f <= f[i], axis=1) & np.any(f < f[i], axis=1)))


def test_nsga_returns_non_dominated_feasible_candidates():
    now = PSConfig(1, 1, 1, 1, 0.0, 0.0)
    cands = nsga_candidates(PAPER_PARAMS, now, 0.0, float("inf"), cpu_quota=24, max_workers=8, max_ps=4,
                            pop_size=20, generations=15, seed=1)
    assert cands
    assert all(c.config.cpus() <= 24 for c in cands)
    f = np.array([[c.cost, -c.gain] for c in cands])
    assert not any(dominated(f, i) for i in range(len(cands)))
    again = nsga_candidates(PAPER_PARAMS, now, 0.0, float("inf"), cpu_quota=24, max_workers=8, max_ps=4,
                            pop_size=20, generations=15, seed=1)
    assert [c.config for c in again] == [c.config for c in cands]  # fixed seed: same answer


@pytest.mark.parametrize("quota", [24, 64, 200])
def test_the_front_reaches_the_fastest_configuration_within_the_quota(quota: int) -> None:
    """In a cluster with room the weighted greedy takes the front's fastest end: NSGA-II alone
    found a median 0.89-0.92 of the model's fastest (the cluster simulator's seeds 0-9).
    Checked against every integer configuration within the quota."""
    params = dict(PAPER_PARAMS, alpha_grad=PAPER_PARAMS["alpha_grad"] * 7.8)  # xDeepFM-like
    w, p, wc, pc = (g.ravel().astype(float) for g in np.meshgrid(
        np.arange(1, 65), np.arange(1, 17), np.arange(1, 33), np.arange(1, 33), indexing="ij"))
    fits = w * wc + p * pc <= quota
    best = float(predict_many(params, w[fits], p[fits], wc[fits], pc[fits]).max())
    cands = nsga_candidates(params, PSConfig(1, 1, 1, 1, 0.0, 0.0), 0.0, float("inf"), cpu_quota=quota,
                            pop_size=32, generations=15)
    assert max(c.throughput for c in cands) == pytest.approx(best)
    assert all(c.config.cpus() <= quota for c in cands)


def test_planner_warm_start_refit_and_oom():
    h = InMemoryHistory([JobRecord("old", 1.0, {"model": "wd"}, {"workers": 8, "ps": 2, "worker_cpu": 3,
                                                                   "ps_cpu": 8, "ps_mem_gb": 10.0}, PAPER_PARAMS)])
    pl = DLRoverRMPlanner("j", {"model": "wd"}, 200, h)
    assert pl.warm_started and (pl.initial_config.workers, pl.initial_config.ps) == (8, 2)
    c = pl.initial_config
    o = ps_obs(c, 5.0, steps_done=1000, total_steps=10_000, ps_mem_used_gb=5.0)
    pl.observe(o)
    assert pl.predict(c) == pytest.approx(5.0)  # prior rescaled to the measurement
    assert pl.candidates(o) and all(x.gain > 0 and x.current == c for x in pl.candidates(o))
    # the PSes partition the tables: a candidate with more or fewer PSes holds the same memory in all
    assert {x.config.ps for x in pl.candidates(o)} != {c.ps}
    assert all(x.config.ps * x.config.ps_mem_gb == pytest.approx(c.ps * c.ps_mem_gb) for x in pl.candidates(o))
    assert PSConfig.from_plan(pl.plan(o), c) == c  # nothing to fix yet: the plan is the configuration now
    o2 = ps_obs(c, 5.0, steps_done=3000, total_steps=10_000, ps_mem_used_gb=7.0)
    pl.observe(o2)
    # 4 GB + 1 MB/step -> 14 GB at the end > 10 GB: more memory before the OOM
    plan = pl.plan(o2)
    assert plan.ps_mem_gb == pytest.approx(17.0) and "OOM predicted" in plan.reason


def test_one_measurement_with_the_ps_busy_share_learns_where_the_step_goes() -> None:
    """Fewer samples than coefficients: the prior rescaled keeps the paper's shape whatever the
    job; with the PSes' busy share the PS terms (Eq. 3-5) and the worker terms (Eq. 2, beta)
    are scaled apart, so a job whose PSes are the bottleneck is seen to gain from more PSes."""
    c = PSConfig(8, 2, 2, 4, 4.0, 8.0)
    truth = dict(PAPER_PARAMS, alpha_upd=4 * PAPER_PARAMS["alpha_upd"], alpha_emb=4 * PAPER_PARAMS["alpha_emb"])

    def thp(params: dict[str, float], conf: PSConfig) -> float:
        return float(predict_many(params, np.array([conf.workers]), np.array([conf.ps]), np.array([conf.worker_cpu]),
                                  np.array([conf.ps_cpu]))[0])

    t = c.workers / thp(truth, c)
    ps_time = truth["alpha_upd"] * 8 / (2 * 4) + truth["alpha_sync"] * 8 / 2 + truth["alpha_emb"] / 2
    busy = ps_time / t
    learnt = split_step_time(PAPER_PARAMS, c, thp(truth, c), busy)
    rescaled = split_step_time(PAPER_PARAMS, c, thp(truth, c), None)
    assert thp(learnt, c) == pytest.approx(thp(truth, c)) and thp(rescaled, c) == pytest.approx(thp(truth, c))
    more_ps = PSConfig(8, 6, 2, 4, 4.0, 8.0)
    gain_truth = thp(truth, more_ps) / thp(truth, c)
    # the measured split predicts most of the true gain of three times the PSes; the prior's
    # shape predicts much less of it
    assert abs(thp(learnt, more_ps) / thp(learnt, c) - gain_truth) < 0.5 * abs(
        thp(rescaled, more_ps) / thp(rescaled, c) - gain_truth)
    assert split_step_time(PAPER_PARAMS, c, 5.0, 1.0) == split_step_time(PAPER_PARAMS, c, 5.0, None)  # no split


def test_a_change_of_the_ps_count_is_not_read_as_memory_growth():
    """The PSes partition the tables: 2 PSes using 12 GB each, then 7 using 3.4 GB each, hold the
    same 24 GB. Read per PS, the two samples fitted a flat 7.7 GB a PS and predicted an OOM of
    the 7 PSes of 6.9 GB (the cluster simulator's seed 3: a job whose memory never grew got more
    memory, and a migration, 3 minutes after it started)."""
    pl = DLRoverRMPlanner("j", {"model": "wd"}, 200, InMemoryHistory())
    two = PSConfig(1, 2, 32, 8, 4.0, 24.0)
    pl.observe(ps_obs(two, 11.0, steps_done=2000, total_steps=300_000, ps_mem_used_gb=12.0))
    seven = PSConfig(37, 7, 1, 3, 4.0, 48.0 / 7)
    o = ps_obs(seven, 90.0, steps_done=4000, total_steps=300_000, ps_mem_used_gb=24.0 / 7)
    pl.observe(o)
    assert PSConfig.from_plan(pl.plan(o), seven) == seven
    # growth of them all still is: 24 GB at steps 2,000 and 4,000, then 26 GB at 6,000 fit
    # 173 GB at the end, 24.7 GB a PS (x 1.2 margin: 30 GB)
    grown = ps_obs(seven, 90.0, steps_done=6000, total_steps=300_000, ps_mem_used_gb=26.0 / 7)
    pl.observe(grown)
    plan = pl.plan(grown)
    assert "OOM predicted" in plan.reason and plan.ps_mem_gb == 30.0 and plan.ps == 7


def test_planner_needs_a_ps_observation():
    pl = DLRoverRMPlanner("j", {"model": "wd"}, 200, InMemoryHistory())
    plain = JobObservation(job_id="j", min_workers=1, max_workers=8, current_workers=2, samples_per_s=5.0)
    for call in (pl.plan, pl.observe, pl.candidates):
        with pytest.raises(ConfigError, match="planner dlrover-rm needs a parameter-server observation"):
            call(plain)
