"""The data-parallel planners and their model, driven by the job simulator (tidal.sim.job) on a
known throughput curve: linear up to a knee of 3 workers, flat beyond (theta1 = theta0 / 3)."""

from __future__ import annotations

import pytest

from tidal.api import JobObservation, PSObservation, ThroughputPoint, WorkerObservation
from tidal.brain import planners
from tidal.brain.api import FitError, ThroughputConfig, ThroughputSample
from tidal.brain.dataparallel import DLRoverRMWorkers, DLRoverWorkers, throughput_gain
from tidal.brain.history import InMemoryHistory, JobRecord
from tidal.brain.models import DataParallelModel
from tidal.sim.job import simulate_job

BATCH = 512
KNEE3 = {"theta0": 0.03, "theta1": 0.01, "knee": 3.0}
JOB = {"samples": 3_000_000, "batch_size": BATCH, "min_workers": 1, "max_workers": 6}


def thp(w: int, p: dict[str, float] = KNEE3) -> float:
    return DataParallelModel(dict(p)).predict(ThroughputConfig(w, batch_size=w * BATCH))


def samples(*counts: int) -> list[ThroughputSample]:
    return [ThroughputSample(ThroughputConfig(w, batch_size=w * BATCH), thp(w)) for w in counts]


def test_the_model_finds_the_knee_once_a_count_beyond_it_is_measured() -> None:
    m = DataParallelModel().fit(samples(1, 2, 3, 4, 5))
    assert m.params["knee"] == 3.0
    assert m.params["theta0"] == pytest.approx(0.03) and m.params["theta1"] == pytest.approx(0.01)
    # below the knee only: linear (the model cannot know better), never a fit error
    linear = DataParallelModel().fit(samples(1, 2))
    assert linear.predict(ThroughputConfig(4, batch_size=4 * BATCH)) == pytest.approx(4 * thp(1))
    with pytest.raises(FitError):
        DataParallelModel().fit(samples(2))


@pytest.mark.parametrize(("name", "settled"), [("max", 6), ("es", 3), ("dlrover-rm", 3), ("fixed", 6)])
def test_each_planner_settles_where_its_rule_says(name: str, settled: int) -> None:
    result = simulate_job(planners.get(name), KNEE3, **JOB)
    assert result.settled_workers == settled, result.decisions


def test_dlrover_rm_cold_costs_less_than_max_and_warm_less_than_cold() -> None:
    cold = simulate_job(planners.get("dlrover-rm"), KNEE3, **JOB)
    biggest = simulate_job(planners.get("max"), KNEE3, **JOB)
    history = InMemoryHistory([JobRecord("old", 1.0, {"script": "t.py"}, {"workers": 3.0}, KNEE3)])
    warm = simulate_job(DLRoverRMWorkers({"script": "t.py"}, history), KNEE3, **JOB)
    assert warm.decisions[0][3].startswith("warm start") and warm.settled_workers == 3
    assert len(warm.decisions) == 1  # it starts where the history says and stays
    assert biggest.worker_s > cold.worker_s > warm.worker_s
    assert warm.job_s <= cold.job_s * 1.05


def test_no_scale_out_that_cannot_pay_for_its_start_up_near_the_end() -> None:
    # Eq. 8: 5 s of start-up for +100% throughput pays over 60 s left, not over 2 s
    assert throughput_gain(2000.0, 1000.0, 5.0, 0.1, 60.0) > 0
    assert throughput_gain(2000.0, 1000.0, 5.0, 0.1, 2.0) < 0
    planner = DLRoverRMWorkers()
    obs = JobObservation(job_id="j", min_workers=1, max_workers=6, current_workers=2, target_workers=2,
                         throughput=[ThroughputPoint(workers=1, samples_per_s=thp(1), seconds=5),
                                     ThroughputPoint(workers=2, samples_per_s=thp(2), seconds=5)],
                         batch_size=BATCH, total_samples=1_000_000, committed_samples=1_000_000 - 30_000)
    plan = planner.plan(obs)
    assert plan.workers == 2 and "Eq. 8" in plan.reason
    early = planner.plan(obs.model_copy(update={"committed_samples": 0}))
    assert early.workers == 4  # at most twice the largest count measured


def test_dlrover_feeds_the_cpus_from_one_workers_use() -> None:
    planner = DLRoverWorkers(cpus=2.0)
    start = JobObservation(job_id="j", min_workers=1, max_workers=8, current_workers=0)
    assert planner.plan(start).workers == 1
    sampled = JobObservation(job_id="j", min_workers=1, max_workers=8, current_workers=1, target_workers=1,
                             throughput=[ThroughputPoint(workers=1, samples_per_s=thp(1), seconds=5)],
                             workers=[WorkerObservation(worker_id=0, cpu_percent=40.0)], batch_size=BATCH)
    plan = planner.plan(sampled)
    assert plan.workers == 5 and "0.40 cores" in plan.reason  # floor(2 / 0.4)


def test_dlrover_adds_workers_once_where_its_servers_idle() -> None:
    """DLRover 4.2, idle PS CPU: past the adjust stage, servers using 0.6 of their 2 cores for 2
    workers (0.3 a worker) have room for floor(2 / 0.3) = 6 workers; asked once, then held."""
    planner = DLRoverWorkers(cpus=2.0)
    planner.stage = "adjust"  # sample and optimize as in the test above
    points = [ThroughputPoint(workers=w, samples_per_s=thp(w), seconds=5) for w in (1, 2)]

    def obs(used: list[float]) -> JobObservation:
        return JobObservation(job_id="j", min_workers=1, max_workers=8, current_workers=2, target_workers=2,
                              throughput=points, batch_size=BATCH, ps=PSObservation(ps=2, ps_cpu=1, ps_cpu_used=used))

    busy = planner.plan(obs([0.8, 0.7]))  # 1.5 of 2 cores: not idle
    assert busy.workers == 2 and busy.reason == "adjusted"
    plan = planner.plan(obs([0.35, 0.25]))
    assert plan.workers == 6 and "idle PS CPU" in plan.reason and "0.60 of their 2 cores" in plan.reason
    assert planner.plan(obs([0.35, 0.25])).workers == 2  # once: later decisions hold the count they see
    capped = DLRoverWorkers(cpus=2.0)
    capped.stage = "adjust"
    assert capped.plan(obs([0.05, 0.05]).model_copy(update={"max_workers": 4})).workers == 4
    no_ps = DLRoverWorkers(cpus=2.0)
    no_ps.stage = "adjust"
    assert no_ps.plan(obs([0.05]).model_copy(update={"ps": None})).reason == "adjusted"


def test_a_decision_carries_the_model_it_rested_on() -> None:
    obs = JobObservation(job_id="j", min_workers=1, max_workers=6, current_workers=3, target_workers=3,
                         throughput=[ThroughputPoint(workers=w, samples_per_s=thp(w), seconds=5) for w in (1, 2, 3, 4)],
                         batch_size=BATCH)
    plan = planners.get("dlrover-rm").plan(obs)
    assert plan.workers == 3 and plan.model == "data-parallel"
    assert plan.params["knee"] == 3.0 and plan.error_pct == pytest.approx(0.0, abs=1e-6)


def test_knees_the_data_cannot_tell_apart_give_the_middle_one() -> None:
    # 3 scaled linearly, 5 did not: the knee is anywhere in 3..4 for the data
    assert DataParallelModel().fit(samples(1, 2, 3, 5)).params["knee"] == 3.5


def test_a_warm_start_trusts_the_similar_jobs_measurements_over_extrapolation() -> None:
    from tidal.brain.dataparallel import efficient_count, history_params

    measured = {1: 17_300.0, 2: 32_400.0, 3: 41_700.0, 4: 49_600.0, 5: 52_200.0, 6: 54_500.0}
    assert efficient_count(measured) == 4  # 49.6k >= 0.9 * 54.5k; 2 is not
    record = history_params(None, measured)
    assert record["samples_per_s@5"] == 52_200.0
    history = InMemoryHistory([JobRecord("old", 1.0, {"script": "t.py"}, {"workers": 4.0},
                                         {**KNEE3, **record})])
    planner = DLRoverRMWorkers({"script": "t.py"}, history)
    start = planner.plan(JobObservation(job_id="j", min_workers=1, max_workers=6, current_workers=0))
    assert start.workers == 4
    # this job runs 2% slower than the old one at 4: the old curve, rescaled, still says stay
    obs = JobObservation(job_id="j", min_workers=1, max_workers=6, current_workers=4, target_workers=4,
                         throughput=[ThroughputPoint(workers=4, samples_per_s=0.98 * 49_600, seconds=5)],
                         batch_size=BATCH, total_samples=1_638_400, committed_samples=200_000)
    plan = planner.plan(obs)
    assert plan.workers == 4, plan.reason
