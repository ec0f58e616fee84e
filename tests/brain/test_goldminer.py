"""GoldMiner's job-level tuning, cluster-level policies and placement on hand-made states."""

from __future__ import annotations

import pytest

from tidal.api import ConfigError
from tidal.brain.goldminer import (
    DataJob,
    DataWorkerAllocator,
    MachineCpus,
    data_worker_size,
    metric,
    trainer_cpus,
    use_data_workers,
)
from tidal.brain.yarn import GangGrant, GangRequest, Machine, YarnCapacityFifo


def test_job_level_tuning():
    assert data_worker_size([0.1, 0.2, 0.3, 0.4], ideal=0.3) == 3  # queue ideal at 3
    assert data_worker_size([0.1, 0.2, 0.25, 0.28], ideal=1.0) == 2  # sublinear after 2
    assert data_worker_size([0.1, 0.2], ideal=1.0) == 2  # used up its CPUs
    assert trainer_cpus([(8, 1.0), (7, 1.0), (3, 0.99), (2, 0.8), (1, 0.5)]) == 3
    assert use_data_workers(1.0, 0.97) and not use_data_workers(1.0, 0.9)
    with pytest.raises(ConfigError):
        data_worker_size([], 1.0)


def jobs() -> list[DataJob]:
    # fast: 1 GPU, gains 0.25/CPU, almost done; wide: 4 GPUs, 0.1/CPU, long; starved: 1 GPU at 0.2
    return [
        DataJob("fast", 1, ("m0",), 0.5, 0.25, 2, remaining=100, dw_size=2, order=0),
        DataJob("wide", 4, ("m1",), 0.5, 0.1, 5, remaining=10_000, dw_size=2, order=1),
        DataJob("starved", 1, ("m2",), 0.2, 0.05, 4, remaining=5_000, dw_size=2, order=2),
    ]


def test_metrics_by_hand():
    fast, wide, starved = jobs()
    assert metric("maxtp", fast, 2, 0.5) == pytest.approx(-0.25)  # 0.5/2*1
    assert metric("maxtp", wide, 2, 0.2) == pytest.approx(-0.4)  # 0.2/2*4
    assert metric("srtf", fast, 2, 0.5) == pytest.approx(100 * 4 / 1.0)
    assert metric("fair", starved, 2, 0.1) == pytest.approx(0.3)


@pytest.mark.parametrize(("policy", "first"), [("maxtp", "wide"), ("srtf", "fast"), ("fair", "starved")])
def test_policies_choose(policy: str, first: str):
    machines = [MachineCpus(f"m{i}", 2) for i in range(3)]
    grants = DataWorkerAllocator(policy).allocate(jobs(), machines)
    assert grants[0].job_id == first
    assert sum(g.cpus for g in grants) <= 6


def test_placement_prefers_local_then_quiet_machines():
    job = DataJob("a", 1, ("m0",), 0.0, 0.1, 0, 100, dw_size=4)
    machines = [MachineCpus("m0", 2), MachineCpus("m1", 8, distributed_jobs=2), MachineCpus("m2", 4)]
    grants = DataWorkerAllocator("maxtp").allocate([job], machines)
    assert (grants[0].machine, grants[0].local, grants[0].cpus) == ("m0", True, 2)
    assert grants[1].machine == "m2" and not grants[1].local  # fewer distributed jobs than m1


def test_yarn_fifo_gang_blocks_and_packs():
    yarn = YarnCapacityFifo()
    machines = [Machine("a", "V100", 2, 16), Machine("b", "V100", 8, 64)]
    q = [GangRequest("big", 0, 8), GangRequest("one", 1, 1)]
    out = yarn.allocate(q, machines)
    assert out == [GangGrant("big", {"b": (8, 0.0)}), GangGrant("one", {"a": (1, 0.0)})]
    q = [GangRequest("huge", 0, 12), GangRequest("one", 1, 1)]
    assert yarn.allocate(q, machines) == []  # head of line blocks (strict FIFO)
    # CPUs per worker must be local: 2 workers x 12 CPUs do not fit on a (16 CPUs)
    assert yarn.place(GangRequest("c", 0, 2, 1, 12), [Machine("a", "V100", 2, 16)]) is None
