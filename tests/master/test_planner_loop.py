"""The master asks its planner for a target: a planner that fails or overshoots never stops the
job, a user's target overrides the planner until ``scale_auto``, each decision is journaled with
its reason and survives a master's failover. Driven with a fake clock."""

from __future__ import annotations

from pathlib import Path

from tests.test_master import form_round, journaled_round, lease, make_master, report
from tidal.api import JobObservation, JobState, RendezvousRequest, ResourcePlan, StepRecord
from tidal.master.planning import Planning


class ScriptedPlanner:
    """A planner that answers what the test says (a hand-written one, as the brain's are)."""

    name = "scripted"

    def __init__(self) -> None:
        self.workers = 2
        self.error: Exception | None = None
        self.calls = 0
        self.seen: JobObservation | None = None

    def plan(self, obs: JobObservation) -> ResourcePlan:
        self.calls += 1
        self.seen = obs
        if self.error is not None:
            raise self.error
        return ResourcePlan(workers=self.workers, reason="scripted")


def test_a_planner_that_raises_keeps_the_target_and_is_logged_once(tmp_path: Path) -> None:
    master, clock, _ = make_master(tmp_path, "1:4")
    planner = master.planning.planner = ScriptedPlanner()
    master.target_override = None
    master.tick()
    assert master.target == 2
    planner.error = ZeroDivisionError("division by zero")
    for _ in range(5):
        clock.now += 1.0
        master.tick()
    assert planner.calls == 6 and master.state is JobState.RUNNING and master.target == 2
    errors = [e.message for e in master.events if e.kind == "error"]
    assert errors == ["planner scripted failed: ZeroDivisionError: division by zero; keeping 2 workers"]
    planner.error, planner.workers = None, 3
    clock.now += 1.0
    master.tick()
    assert master.target == 3  # back to deciding


def test_a_plan_outside_min_max_is_clamped_and_says_so(tmp_path: Path) -> None:
    master, clock, _ = make_master(tmp_path, "2:4")
    planner = master.planning.planner = ScriptedPlanner()
    master.target_override = None
    planner.workers = 1  # below MIN
    master.tick()
    assert master.target == 2
    assert any("4 -> 2 workers (scripted, clamped from 1 to MIN:MAX)" in e.message for e in master.events)
    planner.workers = 9  # above MAX
    clock.now += 1.0
    master.tick()
    assert master.target == 4
    assert master.planner_decisions == 2


def test_the_planner_is_asked_at_its_interval(tmp_path: Path) -> None:
    master, clock, _ = make_master(tmp_path, "1:4", planner_interval_s=5.0)
    planner = master.planning.planner = ScriptedPlanner()
    master.target_override = None
    for _ in range(10):
        master.tick()
        clock.now += 1.0
    assert planner.calls == 2  # at t=0 and t=5


def test_a_users_target_overrides_the_planner_until_auto(tmp_path: Path) -> None:
    master, clock, _ = make_master(tmp_path, "1:4")
    planner = master.planning.planner = ScriptedPlanner()
    master.target_override = None
    master.tick()
    assert master.scale(4) == 4
    calls = planner.calls
    clock.now += 10.0
    master.tick()
    assert master.target == 4 and planner.calls == calls  # the planner is not asked
    assert master.scale_auto() == 2  # it decides at once
    assert master.target_override is None
    assert any("back to planner scripted" in e.message for e in master.events)


def test_decisions_are_journaled_shown_and_survive_failover(tmp_path: Path) -> None:
    first, successor, clock, _, _, _ = journaled_round(tmp_path, 1)
    planner = first.planning.planner = ScriptedPlanner()
    first.target_override = None
    planner.workers = 1
    clock.now += 1.0
    first.tick()
    assert first.target == 1
    st = first.status().planner
    assert st is not None and st.name == "scripted" and st.decisions == 1
    assert st.last is not None and (st.last.from_workers, st.last.to_workers, st.last.reason) == (2, 1, "scripted")
    assert st.last.inputs["workers"] == 2  # what it saw when it decided
    # a master taking over from the journal knows the decision (and counts on from it)
    second = successor(2)
    second.resume()
    restored = second.status().planner
    assert restored is not None and restored.decisions == 1
    assert restored.last is not None and restored.last.reason == "scripted" and restored.last.to_workers == 1
    assert second.planner_decisions == 1
    assert second.timeline().decisions[-1].to_workers == 1


def test_the_observation_carries_throughput_per_count_and_the_workers_split(tmp_path: Path) -> None:
    master, clock, _ = make_master(tmp_path, "2:2", planner_interval_s=1.0)
    planner = master.planning.planner = ScriptedPlanner()
    master.target_override = None
    master.tick()
    form_round(master, [0, 1])
    shards = {w: lease(master, w) for w in (0, 1)}
    pos = {w: shards[w][0] for w in (0, 1)}
    for step in range(4):  # one step a second, 10 samples per worker and step
        clock.now += 1.0
        for w in (0, 1):
            if pos[w] >= shards[w][1]:
                shards[w] = lease(master, w)
                pos[w] = shards[w][0]
            report(master, w, step, [StepRecord(step=step, worker=w, epoch=0, start=pos[w], end=pos[w] + 10)])
            pos[w] += 10
        master.tick()
    obs = planner.seen
    assert obs is not None and obs.current_workers == 2 and obs.batch_size == 10
    assert obs.committed_samples > 0
    points = {p.workers: p for p in obs.throughput}
    # 20 samples a second; the first interval after the round is left out
    assert 2 in points and points[2].samples_per_s == 20.0
    assert [w.worker_id for w in obs.workers] == [0, 1]


def test_throughput_is_measured_only_while_the_count_holds() -> None:
    p = Planning(ScriptedPlanner(), started_at=0.0)
    p.measure(0.0, 1, 0, ready=True)
    p.measure(1.0, 1, 100, ready=True)  # the first interval at a count: left out
    p.measure(2.0, 1, 300, ready=True)
    p.measure(3.0, 1, 500, ready=True)
    assert p.points == {1: [400.0, 2.0]}
    p.measure(4.0, 2, 600, ready=False)  # scaling: not measured
    p.measure(5.0, 2, 700, ready=True)
    p.measure(6.0, 2, 1000, ready=True)  # first interval at 2: left out
    p.measure(7.0, 2, 1400, ready=True)
    assert p.points[2] == [400.0, 1.0]
    assert [(t.workers, t.samples_per_s) for t in p.throughput()] == [(1, 200.0), (2, 400.0)]
    restored = Planning(ScriptedPlanner(), started_at=99.0)
    restored.restore(p.to_meta())
    assert restored.points == p.points and restored.started_at == 0.0


def test_a_slow_planner_does_not_hold_up_the_master(tmp_path: Path) -> None:
    import threading
    import time

    master, clock, _ = make_master(tmp_path, "1:4")
    planner = master.planning.planner = ScriptedPlanner()
    master.target_override = None
    release = threading.Event()
    scripted = planner.plan

    def slow(obs: JobObservation) -> ResourcePlan:  # a forecaster fitting a week of history
        release.wait(30)
        return scripted(obs)

    planner.plan = slow  # type: ignore[method-assign]
    planner.workers = 3
    t0 = time.monotonic()
    for _ in range(5):  # the master goes on ticking (heartbeats, rounds) while the planner thinks
        master.tick()
        clock.now += 1.0
    assert time.monotonic() - t0 < 3.0 and master.target != 3 and planner.calls == 0
    release.set()
    deadline = time.monotonic() + 10
    while master.target != 3 and time.monotonic() < deadline:
        master.tick()
        clock.now += 1.0
    assert master.target == 3 and planner.calls == 1  # applied at a later tick, asked once meanwhile


def test_a_job_with_servers_shows_the_planner_their_cores(tmp_path: Path) -> None:
    """The observation of a ``--ps`` job carries the servers' reports (DLRover's idle-PS-CPU
    and hot-PS rules read them): cores used, in shard-map order, and the largest RSS."""
    from tidal.api import ServerReport

    master, clock, _ = make_master(tmp_path, "1:4", ps=2)
    planner = master.planning.planner = ScriptedPlanner()
    master.target_override = None
    master.tick()  # launches the servers
    for sid, (cpu, rss) in enumerate([(0.25, 300 << 20), (0.5, 700 << 20)]):
        master.server_report(ServerReport(server_id=sid, address=f"tcp://127.0.0.1:{4000 + sid}", pid=100 + sid,
                                          cpu=cpu, rss_bytes=rss))
    planner.workers = 3  # a change: a decision kept with its inputs
    clock.now += 1.0
    master.tick()
    seen = planner.seen
    assert seen is not None and seen.ps is not None
    assert (seen.ps.ps, seen.ps.ps_cpu, seen.ps.ps_cpu_used) == (2, 1, [0.25, 0.5])
    assert seen.ps.ps_mem_used_gb == (700 << 20) / 2**30
    assert master.planning.decisions[-1].inputs["ps_cpu_used"] == [0.25, 0.5]


def test_a_job_without_servers_shows_none(tmp_path: Path) -> None:
    master, _, _ = make_master(tmp_path, "1:4")
    planner = master.planning.planner = ScriptedPlanner()
    master.target_override = None
    master.tick()
    assert planner.seen is not None and planner.seen.ps is None


def test_the_timeline_says_when_the_job_is_ready_and_a_leaver_counts_until_it_exits(tmp_path: Path) -> None:
    """``TimelinePoint.ready``: at the target, nothing starting, re-forming or leaving, as the
    planner is told. A scaled-in worker keeps the job unready until its process has exited (the
    simulator models that wait: ``tidal.sim.online.Migration.scale_in_settle_s``)."""
    master, clock, backend = make_master(tmp_path, "1:2")
    master.tick()
    assert master.timeline().points[-1].ready is False  # nobody has joined
    form_round(master, [0, 1])
    clock.now += 1.0
    master.tick()
    assert master.round == 0 and master.timeline().points[-1].ready is True
    master.scale(1)
    first_round = master.round
    for w in (0, 1):
        master.rendezvous(RendezvousRequest(worker_id=w, after_round=first_round, applied_step=-1))
    clock.now += 1.0
    master.tick()
    answer = master.rendezvous(RendezvousRequest(worker_id=1, after_round=first_round, applied_step=-1))
    assert master.round == first_round + 1 and answer.status == "leave"
    clock.now += 1.0
    master.tick()
    assert master.timeline().points[-1].ready is False  # worker 1 is still on its way out
    backend.exit("worker-1", 0)
    clock.now += 1.0
    master.tick()
    assert master.timeline().points[-1].ready is True
