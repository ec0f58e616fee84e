"""Every cluster allocator of the brain is a ``ClusterAllocator``: one call shape, real grants.

The typed assignments in ``ALLOCATORS`` are what mypy checks structurally (name, and
``allocate(jobs, machines) -> list[grant]`` with each allocator's own types); the tests check the
same at run time and call each allocator on a small cluster, asserting on the grants.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, TypeVar

import pytest

from tidal.api import ConfigError
from tidal.brain.api import ClusterAllocator
from tidal.brain.dlrover import PSConfig
from tidal.brain.dlrover_rm import Candidate, FreeCapacity, WeightedGreedy
from tidal.brain.easyscale import ElasticJob, GangJob, GpuGrant, InterJobAllocator, IntraJobPlanner
from tidal.brain.goldminer import DataJob, DataWorkerAllocator, DataWorkerGrant, MachineCpus
from tidal.brain.yarn import GangGrant, GangRequest, Machine, YarnCapacityFifo

J = TypeVar("J")
M = TypeVar("M")
G = TypeVar("G")

yarn: ClusterAllocator[GangRequest, Machine, GangGrant] = YarnCapacityFifo()
data_workers: ClusterAllocator[DataJob, MachineCpus, DataWorkerGrant] = DataWorkerAllocator("maxtp")
inter_job: ClusterAllocator[ElasticJob | GangJob, Machine, GpuGrant] = InterJobAllocator(IntraJobPlanner())
greedy: ClusterAllocator[Candidate, FreeCapacity, Candidate] = WeightedGreedy()
ALLOCATORS: list[ClusterAllocator[Any, Any, Any]] = [yarn, data_workers, inter_job, greedy]


def allocate(allocator: ClusterAllocator[J, M, G], jobs: Sequence[J], machines: Sequence[M]) -> list[G]:
    """Call an allocator through the protocol only (as a scheduler loop would)."""
    grants = allocator.allocate(jobs, machines)
    assert isinstance(grants, list)
    assert allocator.allocate(jobs, machines) == grants  # pure: same input, same grants
    return grants


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda a: a.name)
def test_satisfies_the_protocol_structurally(allocator: ClusterAllocator[Any, Any, Any]):
    assert isinstance(allocator.name, str) and allocator.name
    expected = list(inspect.signature(ClusterAllocator.allocate).parameters)
    assert list(inspect.signature(type(allocator).allocate).parameters) == expected == ["self", "jobs", "machines"]


def test_names_are_distinct():
    assert len({a.name for a in ALLOCATORS}) == len(ALLOCATORS)


def test_yarn_grants_gangs_in_fifo_order():
    machines = [Machine("v0", "V100", 4, 32.0), Machine("t0", "T4", 2, 16.0)]
    jobs = [GangRequest("late", 1, 2, 1, 8.0, types=("T4",)), GangRequest("early", 0, 2, 1, 4.0)]
    grants = allocate(yarn, jobs, machines)
    assert grants == [GangGrant("early", {"v0": (2, 8.0)}), GangGrant("late", {"t0": (2, 16.0)})]
    # a gang that fits nowhere blocks the queue behind it
    assert allocate(yarn, [GangRequest("huge", 0, 8), *jobs[:1]], machines) == []


def test_data_workers_fill_a_starved_job_locally():
    job = DataJob("a", 1, ("m0",), speed=0.5, gain_per_cpu=0.25, cpus=0, remaining=100, dw_size=2)
    grants = allocate(data_workers, [job], [MachineCpus("m0", 4), MachineCpus("m1", 8)])
    # (1 - 0.5) / 0.25 = 2 CPUs make the queue ideal: one data worker of 2 CPUs, on its own machine
    assert grants == [DataWorkerGrant("a", "m0", 2, True)]


def test_inter_job_starts_and_grows_elastic_jobs():
    queued = ElasticJob("q", 0, 2, {"V100": 4.0})
    running = ElasticJob("r", 1, 4, {"V100": 4.0}, {"V100": 1})
    grants = allocate(inter_job, [queued, running], [Machine("s0", "V100", 2), Machine("s1", "V100", 2)])
    # q starts on one GPU; then +1 for q (2 ESTs on 2 GPUs: 2x) and +1 for r (4 ESTs on 2 GPUs: 2x)
    # tie at speedup 1.0 per GPU; a third GPU for r gains nothing (2 ESTs still on one GPU): one stays free
    assert grants == [GpuGrant("q", {"V100": 2}), GpuGrant("r", {"V100": 2})]  # in the order of the jobs
    # GPUs are pooled per type: one machine of 4 free V100 gives the same grants
    assert allocate(inter_job, [queued, running], [Machine("s", "V100", 4)]) == grants


def test_weighted_greedy_picks_within_free_capacity():
    now = PSConfig(2, 1, 2, 2, 0, 0)
    big = PSConfig(4, 1, 2, 2, 0, 0)  # +4 cores
    short = Candidate("short", big, 10.0, 10, 4, gain=1.0, remaining=1000.0, current=now)
    long = Candidate("long", big, 10.0, 10, 4, gain=2.0, remaining=100000.0, current=now)
    # only one fits in 4 free cores: Eq. 14 (rho = 2.5) favours the job closer to its end
    assert allocate(greedy, [short, long], [FreeCapacity(4, 1e9)]) == [short]
    assert allocate(WeightedGreedy(rho=0.0), [short, long], [FreeCapacity(4, 1e9)]) == [long]
    # the cluster is pooled: two machines of 4 free cores hold both
    assert {c.job_id for c in allocate(greedy, [short, long], [FreeCapacity(4, 1e9)] * 2)} == {"short", "long"}
    assert allocate(greedy, [short], [FreeCapacity(3, 1e9)]) == []
    with pytest.raises(ConfigError, match="no current configuration"):
        greedy.allocate([Candidate("x", big, 10.0, 10, 4, 1.0, 10.0)], [FreeCapacity(100, 1e9)])
