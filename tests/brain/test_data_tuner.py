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


def run(rate: Callable[[int], float], train_rate: float, low: int, high: int, seconds: int = 300
        ) -> tuple[DataWorkerTuner, list[int], float]:
    """The tuner on the simulated job: the tuner, the targets it set, when it settled."""
    tuner = DataWorkerTuner()
    target = serving = low
    asked_at = 0.0
    committed = 0.0
    targets = [target]
    for t in range(seconds):
        if serving != target and t - asked_at >= START_S:
            serving = target
        committed += rate(serving)
        wait = max(0.0, 1 - rate(serving) / train_rate) if serving else 1 - train_rate / (train_rate + rate(0))
        obs = JobObservation(job_id="j", min_workers=1, max_workers=1, current_workers=1, now_s=float(t),
                             committed_samples=int(committed),
                             data=DataWorkerObservation(count=serving, target=target, low=low, high=high,
                                                        samples_per_s=rate(serving), wait_share=wait))
        wanted = tuner.plan(obs).data_workers
        if wanted != target:
            target, asked_at = wanted, float(t)
            targets.append(target)
        if tuner.settled is not None:
            return tuner, targets, float(t)
    raise AssertionError(f"the tuner did not settle in {seconds} s: {targets}")


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
