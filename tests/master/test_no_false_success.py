"""The master's state machine never ends a job "succeeded" with samples untrained (DESIGN.md 4).

Driven directly with an injected clock, the hand-written FakeBackend and a journal that can be
made to refuse writes, as a full disk does. The same faults against real processes and a real
full filesystem are in tests/test_faults.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.test_master import form_round, make_master, worker_of
from tidal.api import (
    FinishRequest,
    JobState,
    JoinRequest,
    LeaseRequest,
    PauseReport,
    RendezvousRequest,
    ReportRequest,
    StepRecord,
    WorkerState,
)
from tidal.master.api import JournalUnavailableError, NotExhaustedError
from tidal.master.events import MAX_PAUSES
from tidal.master.job import JobMaster
from tidal.master.journal import MemoryJournal

SIZE, BATCH, PER_SHARD = 100, 10, 2  # 5 shards of 20 samples, 2 steps each


class RefusingJournal(MemoryJournal):
    """A MemoryJournal that refuses every write while ``full`` is set, as a full disk does."""

    def __init__(self) -> None:
        super().__init__()
        self.full = False

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with super().transaction():
            yield
            self._check()  # the commit fails: nothing of the transaction is kept

    def _write(self, kind: str, payload: Any) -> None:
        self._check()
        super()._write(kind, payload)

    def _check(self) -> None:
        if self.full:
            raise JournalUnavailableError("cannot write the journal: database or disk is full")


def with_refusing_journal(master: JobMaster) -> RefusingJournal:
    """Put a RefusingJournal under ``master`` and form round 0 with worker 0."""
    journal = RefusingJournal()
    master.journal = journal
    master.start()
    master.tick()
    form_round(master, [0])
    return journal


def lease(master: JobMaster, w: int, epoch: int = 0) -> tuple[int, int] | None:
    resp = master.lease(LeaseRequest(worker_id=w, round=master.round, epoch=epoch, dataset_size=SIZE,
                                     batch_size=BATCH, batches_per_shard=PER_SHARD, shuffle=False, epochs=1))
    return (resp.shard.start, resp.shard.end) if resp.shard else None


def train_all(master: JobMaster, workers: list[int]) -> list[StepRecord]:
    """Lease every shard of epoch 0 round-robin; one step per batch, all workers in each step."""
    records: list[StepRecord] = []
    step = 0
    while True:
        shards = {w: lease(master, w) for w in workers}
        if all(s is None for s in shards.values()):
            return records
        for offset in range(0, BATCH * PER_SHARD, BATCH):
            records += [StepRecord(step=step, worker=w, epoch=0, start=s[0] + offset, end=s[0] + offset + BATCH)
                        for w, s in shards.items() if s is not None]
            step += 1


def report_all(master: JobMaster, workers: list[int], records: list[StepRecord]) -> int:
    last = max(r.step for r in records)
    for w in workers:
        master.report(ReportRequest(worker_id=w, round=master.round, applied_step=last,
                                    records=[r for r in records if r.worker == w], incarnation=master.incarnation))
    return last


def test_a_refused_journal_write_pauses_the_job_and_rolls_back(tmp_path: Path) -> None:
    master, clock, backend = make_master(tmp_path, "1:1")
    journal = with_refusing_journal(master)
    first = lease(master, 0)
    journal.full = True
    with pytest.raises(JournalUnavailableError):
        lease(master, 0)  # the shard table moved in memory, the journal refused it
    assert master.paused is not None and "disk is full" in master.paused
    assert master.status().paused == master.paused
    # every request that would change state is a 503 while paused; workers retry
    with pytest.raises(JournalUnavailableError):
        master.report(ReportRequest(worker_id=0, round=0, applied_step=-1))
    clock.now += 1.0
    master.tick()
    assert master.paused is not None  # still full: still paused
    journal.full = False
    clock.now += 1.0
    master.tick()
    assert master.paused is None and master.state is JobState.RUNNING
    # the lease the journal never saw was rolled back: the same shard is handed out again
    assert lease(master, 0) != first
    counts = master.shards.counts()[0]
    assert counts[2] == 2  # DOING: the first lease and the one just made, not three
    assert backend.terminated == []


def test_commits_refused_by_the_journal_are_resent_after_the_reload(tmp_path: Path) -> None:
    master, clock, _ = make_master(tmp_path, "1:1")
    journal = with_refusing_journal(master)
    records = train_all(master, [0])
    journal.full = True
    with pytest.raises(JournalUnavailableError):
        report_all(master, [0], records)
    journal.full = False
    clock.now += 1.0
    master.tick()
    assert master.finalized_step == -1 and master.shards.unconsumed() == {0: SIZE}
    # the worker sees the new incarnation in its next answer and resends its records
    assert master.report(ReportRequest(worker_id=0, round=0, applied_step=9)).incarnation == master.incarnation
    report_all(master, [0], records)
    assert master.shards.unconsumed() == {}
    assert len((tmp_path / "ledger.jsonl").read_text().splitlines()) == len(records)


def test_a_journal_gone_for_good_fails_the_job_with_the_reason(tmp_path: Path) -> None:
    master, clock, backend = make_master(tmp_path, "1:1", journal_patience_s=30.0)
    journal = with_refusing_journal(master)
    journal.full = True
    with pytest.raises(JournalUnavailableError):
        lease(master, 0)
    clock.now += 31.0
    master.tick()
    assert master.state is JobState.FAILED and "could not be written for 31s" in (master.error or "")
    assert backend.terminated == ["worker-0"]
    master.tick()
    assert master.done


def test_a_stray_finish_is_refused_while_samples_are_left(tmp_path: Path) -> None:
    master, _, _ = make_master(tmp_path, "2:2")
    master.tick()
    form_round(master, [0, 1])
    lease(master, 0)
    with pytest.raises(NotExhaustedError, match="100 samples were never trained"):
        master.finish(FinishRequest(worker_id=1))
    assert master.state is JobState.RUNNING and not master.workers[1].finished


def test_finish_counts_the_records_the_master_has_not_finalized_yet(tmp_path: Path) -> None:
    master, _, backend = make_master(tmp_path, "2:2")
    master.tick()
    form_round(master, [0, 1])
    records = train_all(master, [0, 1])
    last = max(r.step for r in records)
    # worker 0 flushed its own records; worker 1's report of the last steps has not come yet
    master.report(ReportRequest(worker_id=0, round=0, applied_step=last,
                                records=[r for r in records if r.worker == 0], incarnation=master.incarnation))
    with pytest.raises(NotExhaustedError):
        master.finish(FinishRequest(worker_id=0, applied_step=last))  # without the step headers' records
    master.finish(FinishRequest(worker_id=0, applied_step=last, records=records))
    assert master.state is JobState.FINISHING
    report_all(master, [1], records)
    master.finish(FinishRequest(worker_id=1, applied_step=last, records=records))
    backend.exit(f"worker-{0}", 0)
    backend.exit(f"worker-{1}", 0)
    master.tick()
    assert master.state is JobState.SUCCEEDED, master.error


def test_a_script_that_stops_early_does_not_succeed(tmp_path: Path) -> None:
    master, _, backend = make_master(tmp_path, "1:1")
    master.tick()
    form_round(master, [0])
    records = train_all(master, [0])
    report_all(master, [0], records[:4])
    backend.exit(f"worker-{0}", 0)  # exit 0 without finishing the data
    master.tick()
    master.tick()
    assert master.state is JobState.FAILED
    assert master.error is not None and "60 samples were never trained (epoch 0: 60)" in master.error


def test_a_worker_that_fails_while_finishing_fails_the_job(tmp_path: Path) -> None:
    master, _, backend = make_master(tmp_path, "2:2")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "worker-0.log").write_text("OSError: [Errno 28] No space left on device\n")
    master.tick()
    form_round(master, [0, 1])
    records = train_all(master, [0, 1])
    report_all(master, [0, 1], records)
    master.finish(FinishRequest(worker_id=1))
    backend.exit(f"worker-{1}", 0)
    backend.exit(f"worker-{0}", 1)  # rank 0 could not write the final checkpoint
    master.tick()
    master.tick()
    assert master.state is JobState.FAILED
    assert master.error is not None and "while the job was finishing" in master.error
    assert "No space left" in master.error


def test_a_round_that_does_not_close_in_time_fails_the_absent_members(tmp_path: Path) -> None:
    master, clock, backend = make_master(tmp_path, "1:2", round_timeout_s=10.0)
    master.tick()
    form_round(master, [0, 1])
    # worker 0's collective timed out; worker 1's main thread hangs but its heartbeats go on
    master.rendezvous(RendezvousRequest(worker_id=0, after_round=0, applied_step=-1))
    assert master.reforming
    for _ in range(4):
        clock.now += 3.0
        master.report(ReportRequest(worker_id=1, round=0, applied_step=-1))
        master.rendezvous(RendezvousRequest(worker_id=0, after_round=0, applied_step=-1))  # long-poll again
        master.tick()
    assert master.workers[1].state is WorkerState.FAILED and backend.terminated == ["worker-1"]
    assert any("did not reach the rendezvous 12s after the re-form began" in e.message for e in master.events)
    assert master.round == 1 and master.members == [0]


def test_a_member_that_applies_no_step_while_its_peers_do_is_replaced(tmp_path: Path) -> None:
    master, clock, backend = make_master(tmp_path, "2:2", progress_timeout_s=30.0, heartbeat_timeout_s=5.0)
    master.tick()
    form_round(master, [0, 1])
    for step in range(12):
        clock.now += 3.0
        master.report(ReportRequest(worker_id=0, round=0, applied_step=step))
        master.report(ReportRequest(worker_id=1, round=0, applied_step=0))
        master.tick()
    assert master.workers[1].state is WorkerState.FAILED and backend.terminated == ["worker-1"]
    assert master.workers[0].state is WorkerState.ACTIVE


def later(master: JobMaster, clock: Any, seconds: float) -> None:
    """Time passes; worker 0 (the survivor) keeps heartbeating."""
    clock.now += seconds
    master.report(ReportRequest(worker_id=0, round=master.round, applied_step=-1))
    master.tick()


def test_start_failures_that_are_not_consecutive_do_not_fail_the_job(tmp_path: Path) -> None:
    master, clock, backend = make_master(tmp_path, "2:2", crash_loop_limit=3)
    master.tick()
    form_round(master, [0, 1])
    for _ in range(4):
        victim = max(master.members)
        backend.exit(f"worker-{victim}", -9)  # a trained worker is killed ...
        later(master, clock, 0.2)
        crasher = worker_of(backend.launched[-1])
        backend.exit(f"worker-{crasher}", 1)  # ... its replacement crashes at start ...
        master.tick()
        later(master, clock, 4.0)
        healthy = worker_of(backend.launched[-1])
        master.join(JoinRequest(worker_id=healthy, pid=1))  # ... and the next one trains
        master.rendezvous(RendezvousRequest(worker_id=0, after_round=master.round, applied_step=-1))
        master.rendezvous(RendezvousRequest(worker_id=healthy, after_round=-1, applied_step=-1))
        assert master.is_member(healthy)
    assert master.state is JobState.RUNNING, master.error
    assert {master.workers[w].slot for w in master.members} == {0, 1}


def test_three_consecutive_start_failures_of_one_slot_fail_the_job(tmp_path: Path) -> None:
    master, clock, backend = make_master(tmp_path, "2:2", crash_loop_limit=3)
    master.tick()
    form_round(master, [0, 1])
    backend.exit("worker-1", -9)
    master.tick()
    later(master, clock, 1.0)
    for _ in range(3):
        backend.exit(f"worker-{worker_of(backend.launched[-1])}", 1)
        master.tick()
        later(master, clock, 4.0)
    assert master.state is JobState.FAILED and "3 times in a row" in (master.error or "")


def test_launches_refused_for_lack_of_resources_are_not_crashes(tmp_path: Path) -> None:
    master, clock, backend = make_master(tmp_path, "1:1", crash_loop_limit=3, max_restarts=2)
    backend.refuse, backend.refuse_retryable = "cannot start python: [Errno 24] Too many open files", True
    for _ in range(10):
        master.tick()
        clock.now += 2.0
    assert master.state is JobState.RUNNING and master.restarts == 0
    backend.refuse = None
    master.tick()
    assert backend.launched  # tried again once the machine had room


def test_pause_records_and_metrics_stay_bounded(tmp_path: Path) -> None:
    master, _, _ = make_master(tmp_path, "1:1")
    master.tick()
    form_round(master, [0])
    for r in range(0, 3 * MAX_PAUSES, 64):
        master.report(ReportRequest(worker_id=0, round=0, applied_step=-1,
                                    pauses=[PauseReport(round=r + i, seconds=0.1) for i in range(64)]))
    assert len(master.pause_events) <= MAX_PAUSES
    for i in range(20):
        try:
            master.finish(FinishRequest(worker_id=0, metrics={f"m{i}-{k}": 1.0 for k in range(64)}))
        except NotExhaustedError:
            pass
    assert len(master.metrics) <= 256


def test_the_round_deadline_allows_a_slow_worker_three_of_its_own_steps(tmp_path: Path) -> None:
    master, clock, backend = make_master(tmp_path, "1:2", round_timeout_s=10.0, heartbeat_timeout_s=60.0)
    master.tick()
    form_round(master, [0, 1])
    for step in range(3):  # a large model: 40 s a step
        clock.now += 40.0
        for w in (0, 1):
            master.report(ReportRequest(worker_id=w, round=0, applied_step=step))
    master.rendezvous(RendezvousRequest(worker_id=0, after_round=0, applied_step=2))  # its collective broke
    clock.now += 30.0
    master.report(ReportRequest(worker_id=1, round=0, applied_step=2))
    master.rendezvous(RendezvousRequest(worker_id=0, after_round=0, applied_step=2))
    master.tick()
    assert master.workers[1].state is WorkerState.ACTIVE  # still inside its step: 30 s < 3 x 40 s
    clock.now += 100.0
    master.report(ReportRequest(worker_id=1, round=0, applied_step=2))
    master.rendezvous(RendezvousRequest(worker_id=0, after_round=0, applied_step=2))
    master.tick()
    assert master.workers[1].state is WorkerState.FAILED and backend.terminated == ["worker-1"]


def test_progress_counts_from_the_reload_not_from_the_epoch(tmp_path: Path) -> None:
    # a reloaded (or resumed) master must not read "no progress since 1970" into its members
    master, clock, backend = make_master(tmp_path, "2:2", progress_timeout_s=30.0)
    journal = RefusingJournal()
    master.journal = journal
    master.start()
    master.tick()
    form_round(master, [0, 1])
    for w in (0, 1):
        master.report(ReportRequest(worker_id=w, round=0, applied_step=4, incarnation=master.incarnation))
    master.scale(2)  # journals the worker table, applied steps included
    journal.full = True
    with pytest.raises(JournalUnavailableError):
        lease(master, 0)
    journal.full = False
    clock.now += 1.0
    master.tick()
    assert master.paused is None and master.workers[1].applied_step == 4
    master.report(ReportRequest(worker_id=0, round=0, applied_step=5, incarnation=master.incarnation))
    master.report(ReportRequest(worker_id=1, round=0, applied_step=4, incarnation=master.incarnation))
    clock.now += 1.0
    master.tick()
    assert backend.terminated == [] and master.workers[1].state is WorkerState.ACTIVE


def test_a_worker_that_finishes_before_its_first_heartbeat_succeeds(tmp_path: Path) -> None:
    """The join answers with the master's incarnation, and the worker's one report (its first,
    sent as it finishes) finalizes its steps: the job succeeds with every sample trained once."""
    master, clock, backend = make_master(tmp_path, "1:1")
    master.tick()
    joined = master.join(JoinRequest(worker_id=0, pid=10_000))
    assert joined.incarnation == master.incarnation
    master.rendezvous(RendezvousRequest(worker_id=0, after_round=-1, applied_step=-1))
    master.tick()
    records = train_all(master, [0])
    last = max(r.step for r in records)
    master.report(ReportRequest(worker_id=0, round=master.round, applied_step=last, records=records,
                                incarnation=joined.incarnation))
    master.finish(FinishRequest(worker_id=0, applied_step=last, records=[]))
    assert master.finalized_step == last and master.shards.unconsumed() == {}
    backend.exit("worker-0", 0)
    clock.now += 1.0
    master.tick()
    assert master.state is JobState.SUCCEEDED, master.error


def test_a_finish_to_a_master_the_worker_never_reported_to_commits_its_records(tmp_path: Path) -> None:
    """A worker whose reports never counted here (it joined a predecessor, which died) finishes
    at once: the records its finish carries are final, and the job succeeds."""
    master, clock, backend = make_master(tmp_path, "1:1")
    master.tick()
    form_round(master, [0])
    records = train_all(master, [0])
    last = max(r.step for r in records)
    master.finish(FinishRequest(worker_id=0, applied_step=last, records=records))
    assert master.finalized_step == last and master.shards.unconsumed() == {}
    backend.exit("worker-0", 0)
    clock.now += 1.0
    master.tick()
    assert master.state is JobState.SUCCEEDED, master.error
