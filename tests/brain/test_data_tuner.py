"""GoldMiner 3.4.1's job-level tuner (tidal.brain.goldminer.DataWorkerTuner) on a simulated job.

The job's throughput is a function of the number of data workers serving; a data worker asked
for starts serving 3 s later, as real ones do; the trainers wait for batches in the share of
their time the data side falls short of the training side. The tuner is fed one observation a
second, as the master feeds it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tidal.api import DataWorkerObservation, JobObservation
from tidal.brain.goldminer import DataWorkerTuner

START_S = 3.0


def run(rate: Callable[..., float], train_rate: float, low: int, high: int, seconds: int = 600, *,
        threads: int = 0, busy: float = 0.5, threads_max: int = 8) -> tuple[DataWorkerTuner, list[int], float]:
    """The tuner on the simulated job: the tuner, the targets it set, when it was done.
    ``rate(k)`` (or ``rate(k, threads)`` with ``threads`` > 0: the trainers' CPUs are tunable,
    each using ``busy`` of them)."""
    tuner = DataWorkerTuner()
    target = serving = low
    asked_at = 0.0
    committed = 0.0
    targets = [target]
    now_threads = threads

    def r(k: int) -> float:
        return rate(k, now_threads) if threads else rate(k)

    for t in range(seconds):
        if serving != target and t - asked_at >= START_S:
            serving = target
        committed += r(serving)
        wait = max(0.0, 1 - r(serving) / train_rate) if serving else 1 - train_rate / (train_rate + r(0))
        obs = JobObservation(job_id="j", min_workers=1, max_workers=1, current_workers=1, now_s=float(t),
                             committed_samples=int(committed),
                             data=DataWorkerObservation(count=serving, target=target, low=low, high=high,
                                                        samples_per_s=r(serving), wait_share=wait,
                                                        trainer_threads=now_threads, trainer_threads_max=threads_max,
                                                        trainer_cpu=busy * now_threads))
        plan = tuner.plan(obs)
        if plan.worker_cpu:
            now_threads = plan.worker_cpu  # trainers apply it at their next batch
        wanted = plan.data_workers
        if wanted != target:
            target, asked_at = wanted, float(t)
            targets.append(target)
        if tuner.done:
            return tuner, targets, float(t)
    raise AssertionError(f"the tuner was not done in {seconds} s: {targets}, {tuner.reason}")


def test_grows_until_the_queue_is_ideal() -> None:
    # pre-processing bound: each data worker adds 10k samples/s until training (30k) limits
    tuner, targets, settled_at = run(lambda k: min(30e3, 10e3 + 10e3 * k), 30e3, 0, 8)
    assert tuner.settled == 2 and targets == [0, 1, 2]
    assert "queue is ideal" in tuner.reason
    assert settled_at < 60


def test_stops_where_the_speedup_turns_sublinear() -> None:
    rates = {0: 10e3, 1: 20e3, 2: 23e3, 3: 25e3}
    tuner, targets, _ = run(lambda k: rates[min(k, 3)], 40e3, 0, 8)
    assert tuner.settled == 1 and targets == [0, 1, 2, 1]
    assert "under 0.5x the first one's" in tuner.reason


def test_falls_back_when_data_workers_do_not_pay() -> None:
    # the transfer costs more than the pre-processing saves (3.4.1 (i))
    tuner, targets, _ = run(lambda k: 20e3 if k == 0 else 12e3 + 1e3 * k, 40e3, 0, 8)
    assert tuner.settled == 0 and targets[-1] == 0
    assert "falling back to no data workers" in tuner.reason


def test_stops_at_max() -> None:
    tuner, targets, _ = run(lambda k: 5e3 + 10e3 * k, 1e6, 0, 3)
    assert tuner.settled == 3 and "MAX 3" in tuner.reason and targets == [0, 1, 2, 3]


@pytest.mark.parametrize("low", [1, 2])
def test_without_a_baseline_it_starts_at_min(low: int) -> None:
    tuner, targets, _ = run(lambda k: min(50e3, 10e3 * k), 50e3, low, 8)
    assert targets[0] == low and tuner.settled == 5 and 0 not in tuner.measured


def test_with_the_queue_ideal_the_trainers_give_cpus_back() -> None:
    # 2 data workers make the queue ideal; the trainer needs 2 of its 4 threads for that rate
    def rate(k: int, threads: int) -> float:
        return min(30e3, 10e3 + 10e3 * k, 15e3 * threads)

    tuner, targets, _ = run(rate, 30e3, 0, 8, threads=4)
    assert targets == [0, 1, 2]
    assert tuner.settled == 2 and tuner.threads_settled == 2
    assert set(tuner.threads_measured) == {4, 3, 2, 1}
    assert "settled on 2 CPUs per trainer" in tuner.reason


def test_a_cpu_bound_trainer_gets_one_more_cpu_if_it_pays() -> None:
    # more data workers stop helping because the trainer (1 thread, fully busy) cannot take more
    def rate(k: int, threads: int) -> float:
        return min(10e3 + 10e3 * k, 15e3 * threads)

    tuner, _, _ = run(rate, 60e3, 0, 8, threads=1, busy=1.0)
    assert tuner.settled == 1 and tuner.threads_settled == 2  # 15k -> 20k samples/s


def test_a_trainer_not_busy_keeps_its_cpus() -> None:
    tuner, _, _ = run(lambda k, threads: min(10e3 + 10e3 * k, 22e3 * threads), 60e3, 0, 8, threads=1, busy=0.5)
    assert tuner.threads_settled == 1 and tuner.threads_measured == {1: tuner.measured[tuner.settled or 0]}
