"""EasyScale's waste model, intra-job planner and inter-job allocator on hand-made states."""

from __future__ import annotations

import pytest

from tidal.api import ConfigError
from tidal.brain.easyscale import (
    ElasticJob,
    GangJob,
    GpuGrant,
    InterJobAllocator,
    IntraJobPlanner,
    PlanDatabase,
    estimated_throughput,
    map_ests,
    waste,
)
from tidal.brain.yarn import Machine

CAP = {"V100": 4.0, "T4": 2.0}


def free(**gpus: int) -> list[Machine]:
    """One pooled machine per GPU type with this many free GPUs (the allocator pools by type)."""
    return [Machine(t, t, n) for t, n in gpus.items()]


def by_job(grants: list[GpuGrant]) -> dict[str, dict[str, int]]:
    return {g.job_id: g.gpus for g in grants}


def test_waste_by_hand():
    # maxP = 8; 1 V100 (C=4) with A=4, 2 T4 (C=2) with A=2 -> nEST = 8
    # f = max(4/4, 2/2) = 1; waste = 1*(4-4/1) + 2*(2-2/1) + 0 = 0; throughput = 4 + 4 = 8
    assert waste(8, {"V100": 1, "T4": 2}, {"V100": 4, "T4": 2}, CAP) == pytest.approx(0.0)
    assert estimated_throughput(8, {"V100": 1, "T4": 2}, {"V100": 4, "T4": 2}, CAP) == pytest.approx(8.0)
    # A_T4 = 3: nEST = 10 (2 surplus), f = max(1, 1.5) = 1.5
    # waste = 1*(4 - 4/1.5) + 2*(2 - 3/1.5) + (10-8)/1.5 = 1.3333 + 0 + 1.3333 = 2.6667
    assert waste(8, {"V100": 1, "T4": 2}, {"V100": 4, "T4": 3}, CAP) == pytest.approx(8 / 3)
    # Eq. 1d = 8 - 8/3 = maxP / f = 8 / 1.5
    assert estimated_throughput(8, {"V100": 1, "T4": 2}, {"V100": 4, "T4": 3}, CAP) == pytest.approx(8 / 1.5)
    with pytest.raises(ConfigError):
        waste(8, {"V100": 1}, {"V100": 4}, CAP)  # nEST < maxP


def test_map_ests_balances_and_caps():
    plan = map_ests(8, {"V100": 1, "T4": 2}, CAP)
    assert dict(plan.ests_per_gpu) == {"V100": 4, "T4": 2}
    assert plan.throughput == pytest.approx(8.0)
    assert map_ests(4, {"V100": 2}, CAP).throughput == pytest.approx(8.0)  # 2 ESTs per GPU
    with pytest.raises(ConfigError):
        map_ests(2, {"V100": 3}, CAP)


def test_proposals_top_k_homogeneous_increments():
    job = ElasticJob("a", 0, 8, CAP, {"V100": 1})
    props = IntraJobPlanner(top_k=2).propose(job, {"V100": 8, "T4": 8})
    assert len(props) == 2
    assert props[0].add == ("V100", 4)  # largest estimated gain first
    assert all(p.plan.gpus <= 8 for p in props)
    homo = IntraJobPlanner(heterogeneous=False).propose(job, {"V100": 0, "T4": 8})
    assert [p for p in homo if p.release is None] == []  # homo never mixes in T4


def test_fallback_when_slower():
    planner = IntraJobPlanner()
    slower = ElasticJob("a", 0, 8, CAP, {"V100": 4}, previous={"V100": 2}, measured=1.0, measured_previous=1.5)
    assert planner.fallback(slower) == {"V100": 2}
    faster = ElasticJob("a", 0, 8, CAP, {"V100": 4}, previous={"V100": 2}, measured=2.0, measured_previous=1.5)
    assert planner.fallback(faster) is None
    banned = ElasticJob("a", 0, 8, CAP, {"V100": 2}, banned=frozenset({(("V100", 4),)}))
    assert all(p.plan.counts != (("V100", 4),) for p in planner.propose(banned, {"V100": 8}))


def test_allocator_speedup_per_gpu_and_ties():
    alloc = InterJobAllocator(IntraJobPlanner())
    # a: 1 V100 of maxP 2 -> +1 doubles (1.0 per GPU); b: 2 V100 of maxP 8 -> +2 doubles (0.5 per GPU)
    a = ElasticJob("a", 0, 2, CAP, {"V100": 1})
    b = ElasticJob("b", 1, 8, CAP, {"V100": 2})
    out = alloc.allocate([a, b], free(V100=1))
    assert out == [GpuGrant("a", {"V100": 2})]
    # tie: c +1 GPU -> speedup 2 ((2-1)/1 = 1.0 per GPU); d (maxP 3) +2 -> speedup 3 ((3-1)/2 = 1.0)
    c = ElasticJob("c", 0, 2, CAP, {"V100": 1})
    d = ElasticJob("d", 1, 3, CAP, {"V100": 1})
    assert alloc.allocate([c, d], free(V100=2)) == [GpuGrant("d", {"V100": 3})]  # more GPUs wins
    # free GPUs are pooled per type: two servers with one V100 each are one pool of two
    assert alloc.allocate([c, d], [Machine("s0", "V100", 1), Machine("s1", "V100", 1)]) == [GpuGrant("d", {"V100": 3})]


def test_allocator_queued_jobs_start_and_gangs_have_priority():
    alloc = InterJobAllocator(IntraJobPlanner())
    big = ElasticJob("big", 0, 8, CAP, {"V100": 4})
    new = ElasticJob("new", 1, 1, CAP)
    out = by_job(alloc.allocate([big, new], free(V100=0, T4=0)))
    assert out["new"] == {"V100": 1} and out["big"] == {"V100": 3}  # reclaimed one GPU
    gang = GangJob("g", 2, 4, ("V100",))
    out = by_job(alloc.allocate([big, gang], free(V100=1)))
    assert out["g"] == {"V100": 4} and out["big"] == {"V100": 1}


def test_least_attained_service_preempts_only_past_the_quantum():
    hour = 3600.0
    las = InterJobAllocator(IntraJobPlanner(), preempt_after_s=4 * hour)
    old = ElasticJob("old", 0, 1, CAP, {"V100": 1}, attained_s=5 * hour)
    new = ElasticJob("new", 1, 1, CAP)
    # the cluster is full: the newcomer takes the GPU of the job that has trained 4 hours longer
    assert by_job(las.allocate([old, new], free(V100=0, T4=0))) == {"old": {}, "new": {"V100": 1}}
    # the paper's FIFO (no preemption): it waits
    assert InterJobAllocator(IntraJobPlanner()).allocate([old, new], free(V100=0, T4=0)) == []
    # within the quantum: no preemption, either of a young job or of one little older than the queued
    young = ElasticJob("young", 0, 1, CAP, {"V100": 1}, attained_s=3 * hour)
    assert las.allocate([young, new], free(V100=0, T4=0)) == []
    back = ElasticJob("back", 0.5, 1, CAP, attained_s=2 * hour)  # submitted before new, preempted since
    assert las.allocate([old, back], free(V100=0, T4=0)) == []  # 5 h is not 4 h more than 2 h
    # queued jobs start least attained first, whatever their submission order
    assert by_job(las.allocate([back, new], free(V100=1, T4=0))) == {"new": {"V100": 1}}
    assert by_job(InterJobAllocator(IntraJobPlanner()).allocate([back, new], free(V100=1, T4=0))) == {"back": {"V100": 1}}
    with pytest.raises(ConfigError, match="preempt_after_s"):
        InterJobAllocator(IntraJobPlanner(), preempt_after_s=-1.0)


def test_proposals_drop_plans_matched_with_fewer_gpus():
    # from 3 V100 with maxP = 8, Eq. 1 rates {V4}, {V5}, {V7}, {V3,P2} and {V3,P4} the same (3 ESTs
    # on one V100 bound the step): the allocator would take {V4} (best speedup per GPU), so the
    # others must not push it out of the top k (EasyScale 3.4: ties go to more GPUs only at
    # equal speedup *per GPU*)
    cap = {"V100": 2.5, "P100": 1.5}
    job = ElasticJob("a", 0, 8, cap, {"V100": 3})
    props = IntraJobPlanner(top_k=3).propose(job, {"V100": 13, "P100": 16})
    assert ("V100", 1) in [p.add for p in props]
    for p in props:
        assert not any(q.plan.gpus < p.plan.gpus and q.plan.throughput >= p.plan.throughput for q in props)


def test_heterogeneous_job_can_move_all_its_slow_gpus():
    # 1 V100 + 6 T4 (V100 2.5x a T4), 8 ESTs: while a T4 holds an EST it bounds the step at 1.0;
    # swapping 1, 2 or 4 of them gains nothing, all 6 at once does (7 V100: 2 ESTs / 2.5 = 0.8)
    job = ElasticJob("a", 0, 8, {"V100": 2.5, "T4": 1.0}, {"V100": 1, "T4": 6})
    props = IntraJobPlanner(top_k=8).propose(job, {"V100": 8})
    assert ("V100", 6) in [p.add for p in props if p.release == ("T4", 6)]


def test_the_plan_database_corrects_eq1_by_what_was_measured():
    # maxP 8 on 4 V100: Eq. 1d says 16 mini-batches/s (2 steps/s); measured 1.0 step/s (bias 0.5)
    cap = {"V100": 4.0, "T4": 2.0}
    held = (("V100", 4),)
    mix = (("T4", 4), ("V100", 4))
    job = ElasticJob("a", 0, 8, cap, {"V100": 4}, measured_plans={held: 1.0, (("T4", 2), ("V100", 2)): 0.25})
    db = PlanDatabase(job)
    assert db.held_bias == pytest.approx(0.5)
    assert db.estimate({"V100": 4}).throughput == pytest.approx(8.0)  # measured: 1 step/s x 8
    # a plan over V100 alone: the nearest measured V100 plan's bias (the held one)
    assert db.estimate({"V100": 8}).throughput == pytest.approx(0.5 * map_ests(8, {"V100": 8}, cap).throughput)
    # a mix: the bias of the measured mix over the same types (0.25 x 8 / Eq. 1d of {T4 2, V100 2})
    mix_bias = 0.25 * 8 / map_ests(8, {"T4": 2, "V100": 2}, cap).throughput
    assert db.estimate(dict(mix)).throughput == pytest.approx(mix_bias * map_ests(8, dict(mix), cap).throughput)
    # nothing measured: Eq. 1d as printed
    fresh = ElasticJob("b", 0, 8, cap, {"V100": 4})
    assert PlanDatabase(fresh).estimate({"V100": 4}).throughput == pytest.approx(16.0)


def test_a_job_returns_to_a_faster_plan_it_has_measured():
    # the job ran 4 V100 at 1.0 step/s; its V100s were reclaimed and it regrew onto 1 V100 + 6 T4
    # (spread over servers: measured 0.4). Once 3 V100 are free, it goes back to 4 V100 and
    # gives the T4 back, which no incremental or upgrade plan (they only add to the held plan)
    # would do
    cap = {"V100": 2.5, "T4": 1.0}
    job = ElasticJob("a", 0, 8, cap, {"V100": 1, "T4": 6},
                     measured_plans={(("V100", 4),): 1.0, (("T4", 6), ("V100", 1)): 0.4})
    props = IntraJobPlanner(top_k=8).propose(job, {"V100": 3})
    back = [p for p in props if p.plan.counts == (("V100", 4),)]
    assert back and back[0].speedup == pytest.approx(2.5)
    assert back[0].add == ("V100", 3) and back[0].release == ("T4", 6)
    grants = InterJobAllocator(IntraJobPlanner()).allocate([job], free(V100=3, T4=0))
    assert grants == [GpuGrant("a", {"V100": 4})]
    # a homogeneous-only planner never proposes the measured mix, and a banned plan is not a return
    homo_job = ElasticJob("h", 0, 8, cap, {"V100": 4}, heterogeneous=False,
                          measured_plans={(("V100", 4),): 1.0, (("T4", 6), ("V100", 1)): 9.0})
    assert all(len(p.plan.counts) == 1 for p in IntraJobPlanner().propose(homo_job, {"T4": 6}))
    banned = ElasticJob("a", 0, 8, cap, {"V100": 1, "T4": 6}, banned=frozenset({(("V100", 4),)}),
                        measured_plans=job.measured_plans)
    assert all(p.plan.counts != (("V100", 4),) for p in IntraJobPlanner(top_k=8).propose(banned, {"V100": 3}))
