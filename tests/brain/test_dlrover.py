"""DLRover's sample/optimize/adjust stages and the ES/Optimus baselines (pure planners)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tidal.api import ConfigError, JobObservation, PSObservation
from tidal.brain.api import Planner
from tidal.brain.dlrover import (
    DLRoverPlanner,
    PSConfig,
    adjust_idle_ps,
    hot_ps_cores,
    optimize_config,
)
from tidal.brain.es import ESPlanner, scaling_efficiency
from tidal.brain.optimus_alloc import OptimusPlanner


def test_eq10_eq11_reproduce_table1():
    # DLRover Table 1, W&D: w_hat 2.5, s_hat 5.7, C_total 200 -> 24 workers of 3 cores, 8 PSes of 16
    # N_w = floor(200 / 8.2) = 24; s_total = 200 - 24 * 3 = 128; N_ps = 128 / 16 = 8
    assert optimize_config(2.5, 5.7, 200) == (24, 3, 8)
    # xDeepFM: w_hat 19.4, s_hat 3.1: N_w = floor(200 / 22.5) = 8; 20 cores; s_total = 40 -> 2 PSes
    assert optimize_config(19.4, 3.1, 200) == (8, 20, 2)


def test_eq10_leaves_room_for_a_ps():
    n_w, w_cpu, n_ps = optimize_config(30.0, 0.5, 64)
    assert n_w * w_cpu + n_ps * 16 <= 64 and n_ps >= 1


def test_adjust_idle_ps_and_hot_ps():
    # 8 workers use 16 of 32 PS cores: s_hat = 2 per worker -> 32 / 2 = 16 workers
    assert adjust_idle_ps(8, 16.0, 32.0, max_workers=100) == 16
    assert adjust_idle_ps(8, 16.0, 32.0, max_workers=12) == 12
    # hot PS uses 12 of 40 PS cores used; s_hat 4 per worker, 10 workers -> 12/40 * 4 * 10 = 12
    assert hot_ps_cores(12.0, 40.0, 4.0, 10) == 12
    assert hot_ps_cores(30.0, 40.0, 4.0, 100) == 32  # C_max


def obs(c: PSConfig, thp: float = 10.0, worker: float = 2.5, ps: list[float] | None = None,
        ready: bool = True, **kw) -> JobObservation:
    """A PS job running ``c`` at ``thp`` steps/s (one "sample" is one step); ``kw`` go to ``PSObservation``."""
    return JobObservation(
        job_id="j", min_workers=1, max_workers=200, current_workers=c.workers, target_workers=c.workers,
        ready=ready, samples_per_s=thp,
        ps=PSObservation(ps=c.ps, worker_cpu=c.worker_cpu, ps_cpu=c.ps_cpu, worker_mem_gb=c.worker_mem_gb,
                         ps_mem_gb=c.ps_mem_gb, hot_ps_cpu=c.hot_ps_cpu, cpu_quota=200, worker_cpu_used=worker,
                         ps_cpu_used=ps if ps is not None else [2.85, 2.85], **kw))


def step(planner: Planner, c: PSConfig, **kw) -> PSConfig:
    """One decision on ``c``, as the configuration it asks for (the plan carries a reason)."""
    plan = planner.plan(obs(c, **kw))
    assert plan.reason
    return PSConfig.from_plan(plan, c)


def test_dlrover_stages():
    pl = DLRoverPlanner(200)
    c0 = pl.initial()
    assert (c0.workers, c0.ps, c0.worker_cpu) == (1, 2, 32)
    c1 = step(pl, c0)  # sample -> optimize with w_hat 2.5, s_hat 5.7
    assert (c1.workers, c1.worker_cpu, c1.ps, c1.ps_cpu) == (24, 3, 8, 16)
    # optimize -> adjust: PSes use 64 of 128 cores, s_hat = 64/24 -> 128 / (64/24) = 48 workers, quota 200
    c2 = step(pl, c1, ps=[8.0] * 8)
    assert c2.workers == min(48, (200 - 128) // 3)
    # a hot PS (3x the mean, saturated) gets replaced by a bigger one
    # a hot PS (16 of 44 PS cores used, saturated) is replaced by min(16/44 * 5.7 * 16, 32) = 32 cores
    c3 = step(pl, replace(c2, workers=16), ps=[16.0] + [4.0] * 7)
    assert c3.hot_ps_cpu == 32 and c3.cpus() <= 200


def test_dlrover_oom_in_sampling_doubles():
    pl = DLRoverPlanner(200)
    c0 = pl.initial()
    assert step(pl, c0, oom_worker=True).worker_mem_gb == 2 * c0.worker_mem_gb
    assert step(pl, c0, oom_ps=True).ps == 2 * c0.ps


def test_es_threshold():
    assert scaling_efficiency(10.0, 1, 18.0, 5) == pytest.approx(0.2)
    es = ESPlanner(200, step=4)
    c = PSConfig(1, 2, 3, 16)
    c1 = step(es, c, thp=10.0)
    assert c1.workers == 5
    c2 = step(es, c1, thp=40.0)  # eff (30/4)/10 = 0.75 > 0.3: keep adding
    assert c2.workers == 9
    plan = es.plan(obs(c2, thp=42.0))  # eff (2/4)/(40/5) = 0.0625 < 0.3: back to 5, stop
    assert plan.workers == 5 and "scaling efficiency 0.06 < 0.3" in plan.reason
    c3 = PSConfig.from_plan(plan, c2)
    assert step(es, c3, thp=40.0).workers == 5


def test_optimus_explores_then_follows_marginal_gain():
    opt = OptimusPlanner(200)
    c = PSConfig(1, 1, 2, 2)

    def truth(x: PSConfig) -> float:  # PS-bound: a PS serves 2 workers
        return float(min(x.workers, 2 * x.ps))

    for _ in range(12):
        c = step(opt, c, thp=truth(c))
    assert c.ps >= 2 and c.workers >= 2
    assert abs(c.workers - 2 * c.ps) <= 2  # follows the bottleneck


def test_es_respects_free_cores():
    es = ESPlanner(200, step=4)
    c = PSConfig(1, 2, 3, 16)
    assert step(es, c, free_cpus=7.0).workers == 3  # 7 free cores: 2 workers of 3, not 4
    assert step(ESPlanner(200, step=4), c, free_cpus=None).workers == 5  # None: no limit known


def test_plans_set_every_size_and_round_trip():
    c = PSConfig(3, 2, 4, 8, 6.0, 10.0, hot_ps_cpu=12)
    plan = c.to_plan("why")
    assert plan.reason == "why" and None not in (plan.worker_cpu, plan.ps_cpu, plan.worker_mem_gb, plan.ps_mem_gb,
                                                plan.hot_ps_cpu)
    assert PSConfig.from_plan(plan, PSConfig(1, 1, 1, 1)) == c
    assert PSConfig.from_observation(obs(c)) == c
    # pods still starting count: the configuration is the target, not the workers training now
    starting = obs(c).model_copy(update={"current_workers": 1, "ready": False})
    assert PSConfig.from_observation(starting).workers == 3
    # a plan that leaves sizes unset keeps those of now
    assert PSConfig.from_plan(plan.model_copy(update={"worker_cpu": None, "ps_mem_gb": None}), c) == c


def test_planners_wait_while_pods_start():
    c = PSConfig(4, 2, 3, 16)
    for planner in (DLRoverPlanner(200), ESPlanner(200, step=4), OptimusPlanner(200)):
        plan = planner.plan(obs(c, ready=False))
        assert PSConfig.from_plan(plan, c) == c and "waiting" in plan.reason


@pytest.mark.parametrize("planner", [DLRoverPlanner(200), ESPlanner(200), OptimusPlanner(200)],
                         ids=lambda p: p.name)
def test_ps_planners_need_a_ps_observation(planner: Planner):
    plain = JobObservation(job_id="j", min_workers=1, max_workers=8, current_workers=2, samples_per_s=10.0)
    with pytest.raises(ConfigError, match=f"planner {planner.name} needs a parameter-server observation"):
        planner.plan(plain)
