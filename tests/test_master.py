"""The job master's state machine, driven directly with an injected clock and a hand-written backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tidal.api import (
    JobState,
    JoinRequest,
    LeaseRequest,
    RendezvousRequest,
    ReportRequest,
    StepRecord,
    WorkerState,
)
from tidal.backends.api import NodeSpec, parse_node_id
from tidal.backends.fake import FakeBackend
from tidal.brain.planners import MaxWorkersPlanner
from tidal.master.api import BadRequestError, JobSpec, StaleRoundMasterError
from tidal.master.job import JobMaster
from tidal.master.journal import MemoryJournal

pytestmark = pytest.mark.speed_free


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def worker_of(spec: NodeSpec) -> int:
    return parse_node_id(spec.node_id)[1]


def make_master(tmp_path: Path, workers: str = "2:2", **spec_args: object) -> tuple[JobMaster, FakeClock, FakeBackend]:
    low, high = (int(x) for x in workers.split(":"))
    options: dict[str, object] = {"start_grace_s": 60.0, "heartbeat_timeout_s": 5.0, **spec_args}
    spec = JobSpec(job_id="t", argv=["python", "x.py"], min_workers=low, max_workers=high, token="tok",
                   job_dir=str(tmp_path), ledger_path=str(tmp_path / "ledger.jsonl"), **options)  # type: ignore[arg-type]
    clock, backend = FakeClock(), FakeBackend()
    master = JobMaster(spec, MemoryJournal(), backend, MaxWorkersPlanner(), clock, store_port=1)
    master.start()
    return master, clock, backend


def form_round(master: JobMaster, ids: list[int], applied: int = -1) -> None:
    for w in ids:
        master.join(JoinRequest(worker_id=w, pid=10_000 + w))
    for w in ids:
        master.rendezvous(RendezvousRequest(worker_id=w, after_round=master.round, applied_step=applied))
    master.tick()


def lease(master: JobMaster, w: int, epoch: int = 0) -> tuple[int, int]:
    resp = master.lease(LeaseRequest(worker_id=w, round=master.round, epoch=epoch, dataset_size=100,
                                     batch_size=10, batches_per_shard=2, shuffle=False))
    assert resp.shard is not None
    return resp.shard.start, resp.shard.end


def report(master: JobMaster, w: int, applied: int, records: list[StepRecord]) -> None:
    master.report(ReportRequest(worker_id=w, round=master.round, applied_step=applied, records=records,
                                incarnation=master.incarnation))


def test_first_round_waits_for_slow_starters_for_the_grace_period(tmp_path: Path) -> None:
    master, clock, _ = make_master(tmp_path, "1:2", start_grace_s=5.0)
    master.tick()
    form_round(master, [0])
    assert master.round == -1
    clock.now += 5.0
    master.tick()
    assert master.round == 0 and master.members == [0]  # MIN joined, the grace period is over


def test_first_round_forms_when_every_launched_worker_waits(tmp_path: Path) -> None:
    master, _, backend = make_master(tmp_path)
    master.tick()
    assert [s.node_id for s in backend.launched] == ["worker-0", "worker-1"]
    master.join(JoinRequest(worker_id=0, pid=1))
    master.rendezvous(RendezvousRequest(worker_id=0, after_round=-1, applied_step=-1))
    assert master.round == -1  # worker 1 has not joined
    form_round(master, [1])
    assert master.round == 0
    a0 = master.rendezvous(RendezvousRequest(worker_id=0, after_round=-1, applied_step=-1))
    assert (a0.status, a0.rank, a0.world_size, a0.sync_state) == ("ready", 0, 2, True)


def test_missed_heartbeats_fail_the_worker_and_launch_a_replacement(tmp_path: Path) -> None:
    master, clock, backend = make_master(tmp_path)
    master.tick()
    form_round(master, [0, 1])
    clock.now += 4.0
    report(master, 0, -1, [])
    clock.now += 2.0  # worker 1 silent for 6 s > 5 s
    master.tick()
    assert master.workers[1].state is WorkerState.FAILED
    assert backend.terminated == ["worker-1"]
    assert master.reforming
    master.tick()
    assert [s.node_id for s in backend.launched] == ["worker-0", "worker-1", "worker-2"]


def test_records_are_final_only_when_every_member_applied_the_step(tmp_path: Path) -> None:
    master, _, _ = make_master(tmp_path)
    master.tick()
    form_round(master, [0, 1])
    a, b = lease(master, 0), lease(master, 1)
    r0 = [StepRecord(step=s, worker=0, epoch=0, start=a[0] + 10 * s, end=a[0] + 10 * s + 10) for s in range(2)]
    r1 = [StepRecord(step=s, worker=1, epoch=0, start=b[0] + 10 * s, end=b[0] + 10 * s + 10) for s in range(2)]
    report(master, 0, 1, r0)
    assert master.finalized_step == -1
    report(master, 1, 0, r1[:1])
    assert master.finalized_step == 0
    report(master, 1, 1, r1[1:])
    assert master.finalized_step == 1
    lines = (tmp_path / "ledger.jsonl").read_text().splitlines()
    assert len(lines) == 4


def test_a_step_only_the_dead_worker_applied_goes_back_to_todo(tmp_path: Path) -> None:
    master, _, backend = make_master(tmp_path, "1:2")
    master.tick()
    form_round(master, [0, 1])
    a, b = lease(master, 0), lease(master, 1)
    step0 = [StepRecord(step=0, worker=0, epoch=0, start=a[0], end=a[0] + 10),
             StepRecord(step=0, worker=1, epoch=0, start=b[0], end=b[0] + 10)]
    step1 = [StepRecord(step=1, worker=0, epoch=0, start=a[0] + 10, end=a[0] + 20),
             StepRecord(step=1, worker=1, epoch=0, start=b[0] + 10, end=b[0] + 20)]
    # worker 1 applied step 1 and reported it; worker 0 never finished step 1
    report(master, 1, 1, [r for r in step0 + step1 if r.worker == 1])
    backend.exit(f"worker-{1}", -9)
    master.tick()
    assert master.reforming
    # the survivor is at step 0 and carries both workers' records of step 0
    master.rendezvous(RendezvousRequest(worker_id=0, after_round=0, applied_step=0, records=step0))
    assert master.round == 1 and master.finalized_step == 0
    ledger = (tmp_path / "ledger.jsonl").read_text().splitlines()
    assert len(ledger) == 2  # step 0 of both workers; worker 1's step 1 was discarded
    # its range is leasable again from where step 0 ended
    assert lease(master, 0) == (a[0] + 10, a[1])
    assert lease(master, 0) == (b[0] + 10, b[1])


def test_crash_loop_fails_the_job_with_the_scripts_error(tmp_path: Path) -> None:
    master, clock, backend = make_master(tmp_path, "1:1")
    (tmp_path / "logs").mkdir()
    for _ in range(3):
        master.tick()
        worker = worker_of(backend.launched[-1])
        (tmp_path / "logs" / f"worker-{worker}.log").write_text("Traceback...\nValueError: bad config\n")
        backend.exit(f"worker-{worker}", 1)
        master.tick()
        clock.now += 10
    assert master.state is JobState.FAILED
    assert master.error is not None and "bad config" in master.error
    assert len(backend.launched) == 3


def test_scale_outside_the_range_is_refused(tmp_path: Path) -> None:
    master, _, _ = make_master(tmp_path, "1:3")
    with pytest.raises(BadRequestError):
        master.scale(4)
    with pytest.raises(BadRequestError):
        master.scale(0)
    assert master.scale(2) == 2


def test_stale_rounds_are_refused(tmp_path: Path) -> None:
    master, _, _ = make_master(tmp_path)
    master.tick()
    form_round(master, [0, 1])
    with pytest.raises(StaleRoundMasterError):
        master.report(ReportRequest(worker_id=0, round=7, applied_step=-1))
    with pytest.raises(StaleRoundMasterError):
        master.lease(LeaseRequest(worker_id=0, round=3, epoch=0, dataset_size=10, batch_size=1))


def test_straggler_needs_lasting_slowness_and_gets_smaller_shards(tmp_path: Path) -> None:
    master, clock, _ = make_master(tmp_path)
    master.tick()
    form_round(master, [0, 1])
    for _ in range(4):
        master.report(ReportRequest(worker_id=0, round=0, applied_step=-1, compute_s_per_sample=1e-4))
        master.report(ReportRequest(worker_id=1, round=0, applied_step=-1, compute_s_per_sample=4e-4))
        master.tick()
        clock.now += 0.5
    assert not master.workers[1].straggler  # 1.5 s of slowness is not yet enough
    clock.now += 1.0
    master.tick()
    assert master.workers[1].straggler and master.workers[1].size_factor == pytest.approx(0.25)
    start, end = lease(master, 1)
    assert end - start < 20  # a split shard


def test_a_dead_member_holds_finalization_back_until_the_round_settles(tmp_path: Path) -> None:
    master, _, backend = make_master(tmp_path, "1:2")
    master.tick()
    form_round(master, [0, 1])
    a, b = lease(master, 0), lease(master, 1)
    recs = {w: [StepRecord(step=s, worker=w, epoch=0, start=base + 10 * s, end=base + 10 * s + 10) for s in range(2)]
            for w, base in ((0, a[0]), (1, b[0]))}
    report(master, 0, 1, recs[0])
    report(master, 1, 0, recs[1][:1])
    assert master.finalized_step == 0
    backend.exit(f"worker-{1}", -9)  # worker 1 applied step 1 too, but died before reporting it
    master.tick()
    assert master.finalized_step == 0  # worker 0's report alone must not finalize step 1
    master.rendezvous(RendezvousRequest(worker_id=0, after_round=0, applied_step=1, records=recs[0] + recs[1]))
    assert master.finalized_step == 1
    assert len((tmp_path / "ledger.jsonl").read_text().splitlines()) == 4


def test_member_progress_minimum() -> None:
    from tidal.master.progress import MemberProgress

    p = MemberProgress([1, 2, 3])
    p.update(1, 5)
    p.update(2, 7)
    assert p.minimum() is None  # 3 has not reported
    p.update(3, 6)
    assert p.minimum() == 5
    p.update(1, 9)
    assert p.minimum() == 6
    p.remove(3)
    assert p.minimum() == 7
    p.update(4, 0)  # not a member: ignored
    assert p.minimum() == 7


def journaled_round(tmp_path: Path, min_workers: int) -> tuple[JobMaster, Any, FakeClock, FakeBackend, tuple, tuple]:
    """A master on a SQLite journal with round 0 of workers 0 and 1, each holding a lease; returns
    it, a factory for its successor on the same journal, the clock, the backend and the leases."""
    from tidal.master.journal import SqliteJournal

    journal_path = tmp_path / "journal.sqlite"
    spec = JobSpec(job_id="t", argv=["python", "x.py"], min_workers=min_workers, max_workers=2, token="tok",
                   job_dir=str(tmp_path), ledger_path=str(tmp_path / "ledger.jsonl"), start_grace_s=60.0)
    clock, backend = FakeClock(), FakeBackend()

    def successor(store_port: int) -> JobMaster:
        # a restarted master: a new backend instance on the same machine, adopting what runs
        on = backend if store_port == 1 else backend.restarted()
        return JobMaster(spec, SqliteJournal(journal_path), on, MaxWorkersPlanner(), clock, store_port=store_port)

    first = successor(1)
    first.start()
    first.tick()
    form_round(first, [0, 1])
    return first, successor, clock, backend, lease(first, 0), lease(first, 1)


def test_a_resumed_master_finalizes_after_every_member_reports_again(tmp_path: Path) -> None:
    first, successor, _, _, a, b = journaled_round(tmp_path, 2)
    recs = {w: [StepRecord(step=s, worker=w, epoch=0, start=base + 10 * s, end=base + 10 * s + 10) for s in range(2)]
            for w, base in ((0, a[0]), (1, b[0]))}
    report(first, 0, 0, recs[0][:1])
    report(first, 1, 0, recs[1][:1])
    assert first.finalized_step == 0
    report(first, 0, 1, recs[0][1:])  # step 1 of worker 0 reaches the old master only
    first.close()

    second = successor(2)
    second.resume()
    assert (second.round, second.members, second.finalized_step) == (0, [0, 1], 0)
    assert second.incarnation != first.incarnation
    # the first report to the new master does not count: the worker has not resent yet
    second.report(ReportRequest(worker_id=1, round=0, applied_step=1, records=recs[1][1:],
                                incarnation=first.incarnation))
    assert second.finalized_step == 0
    report(second, 0, 1, recs[0][1:])  # worker 0 resends its step 1 record
    report(second, 1, 1, [])
    assert second.finalized_step == 1
    lines = (tmp_path / "ledger.jsonl").read_text().splitlines()
    assert len(lines) == 4  # the ledger was rewritten from the journal, then extended
    assert second.rounds.assignments[0].store_port == 2  # the new store for rounds to come


def test_a_member_found_dead_on_resume_holds_finalization_until_the_round_settles(tmp_path: Path) -> None:
    first, successor, _, backend, a, b = journaled_round(tmp_path, 1)
    recs = [StepRecord(step=s, worker=w, epoch=0, start=base + 10 * s, end=base + 10 * s + 10)
            for s in range(2) for w, base in ((0, a[0]), (1, b[0]))]
    report(first, 0, 0, [r for r in recs if r.worker == 0 and r.step == 0])
    report(first, 1, 0, [r for r in recs if r.worker == 1 and r.step == 0])
    assert first.finalized_step == 0
    first.close()
    backend.exit("worker-1", -9)  # worker 1 dies with the master, after applying step 1

    second = successor(2)
    second.resume()
    second.tick()  # the backend reports it gone
    assert second.workers[1].state is WorkerState.FAILED
    report(second, 0, 1, [r for r in recs if r.worker == 0 and r.step == 1])
    assert second.finalized_step == 0  # worker 1's record of step 1 is not here yet
    # the survivor carries every record of step 1 to the rendezvous: the round settles it
    second.rendezvous(RendezvousRequest(worker_id=0, after_round=0, applied_step=1, records=recs))
    assert second.finalized_step == 1
    ledger = (tmp_path / "ledger.jsonl").read_text().splitlines()
    assert len(ledger) == 4  # both workers' steps 0 and 1


def test_each_worker_slot_gets_its_own_gpu_and_knows_whether_it_shares(tmp_path: Path) -> None:
    master, _, backend = make_master(tmp_path, "2:2", gpus=["3", "5"])
    master.tick()
    assert [(s.env["CUDA_VISIBLE_DEVICES"], s.env["TIDAL_OWN_GPU"]) for s in backend.launched] == [("3", "1"), ("5", "1")]
    backend.exit(f"worker-{1}", -9)
    master.tick()
    master.tick()
    assert backend.launched[-1].env["CUDA_VISIBLE_DEVICES"] == "5"  # the replacement takes its slot's GPU
    (tmp_path / "shared").mkdir()
    (tmp_path / "cpu").mkdir()
    shared, _, backend = make_master(tmp_path / "shared", "1:3", gpus=["0"])
    shared.tick()
    assert {(s.env["CUDA_VISIBLE_DEVICES"], s.env["TIDAL_OWN_GPU"]) for s in backend.launched} == {("0", "0")}
    cpu, _, backend = make_master(tmp_path / "cpu", "1:1")
    cpu.tick()
    assert "CUDA_VISIBLE_DEVICES" not in backend.launched[0].env


def test_rounds_that_keep_failing_before_a_step_fail_the_job(tmp_path: Path) -> None:
    master, _, _ = make_master(tmp_path, "2:2", round_failure_limit=4)
    master.tick()
    form_round(master, [0, 1])
    why = "cannot form the process group: ncclInvalidUsage: Duplicate GPU detected"
    for _ in range(3):
        for w in (0, 1):
            master.rendezvous(RendezvousRequest(worker_id=w, after_round=master.round, applied_step=-1, failure=why))
        assert master.state is JobState.RUNNING
    for w in (0, 1):
        master.rendezvous(RendezvousRequest(worker_id=w, after_round=master.round, applied_step=-1, failure=why))
    assert master.state is JobState.FAILED
    assert master.error is not None and "4 rounds in a row failed" in master.error and "Duplicate GPU" in master.error


def test_a_round_that_applied_a_step_resets_the_failure_count(tmp_path: Path) -> None:
    master, _, _ = make_master(tmp_path, "2:2", round_failure_limit=2)
    master.tick()
    form_round(master, [0, 1])
    for step in range(5):  # every round trains a step before a peer's collective breaks
        for w in (0, 1):
            master.rendezvous(RendezvousRequest(worker_id=w, after_round=master.round, applied_step=step,
                                                failure="gradient all-reduce failed"))
    assert master.state is JobState.RUNNING and master.round == 5
