"""The reporter (tidal.worker.reporter.Reporter) against a hand-written master, without a thread.

``FakeMaster`` implements what the reporter calls of ``tidal.worker.client.MasterClient``
(``post``): it keeps every request and answers as a test sets it (a round, a re-form, the
finalized step, an incarnation, or an error). The clock is a number the test moves; the
reporter's ``report_if_due`` is what its thread does every tick. Steps are handed over as the
step runner does: the step count moves and ``record_step`` is called under the shared lock.
"""

from __future__ import annotations

import threading
from typing import TypeVar

import pytest
from pydantic import BaseModel

from tidal.api import (
    MAX_RECORDS_PER_REQUEST,
    ReportRequest,
    ReportResponse,
    StaleRoundError,
    StepRecord,
    TidalError,
)
from tidal.worker.api import MasterUnreachableError, WorkerGoneError
from tidal.worker.reporter import REPORT_INTERVAL_S, STALL_ABORT_S, Reporter
from tidal.worker.step import AppliedStep

T = TypeVar("T", bound=BaseModel)
ME, OTHER = 3, 5
HEARTBEAT_S = 0.5


class FakeMaster:
    """The master's ``/v1/report`` as the reporter sees it (``MasterClient.post``)."""

    def __init__(self) -> None:
        self.requests: list[ReportRequest] = []
        self.round = 0
        self.reform = False
        self.finalized_step = -1
        self.incarnation = "m1"
        self.error: TidalError | None = None  # raised instead of answering, as the client does
        self.answered = threading.Event()

    def post(self, path: str, body: BaseModel, response: type[T], patience_s: float | None = None) -> T:
        assert path == "/v1/report" and isinstance(body, ReportRequest)
        self.requests.append(body.model_copy(deep=True))
        if self.error is not None:
            raise self.error
        self.answered.set()
        return response.model_validate(ReportResponse(round=self.round, reform=self.reform,
                                                      finalized_step=self.finalized_step,
                                                      incarnation=self.incarnation).model_dump())

    def last(self) -> ReportRequest:
        return self.requests[-1]


class WaitingComm:
    """A communicator whose collective in flight has waited ``stalled_s`` (``RoundComm``'s
    ``stalled_for``/``abort``)."""

    def __init__(self, stalled_s: float) -> None:
        self.stalled_s = stalled_s
        self.aborts = 0

    def stalled_for(self) -> float:
        return self.stalled_s

    def abort(self) -> bool:
        self.aborts += 1
        return True


class Worker:
    """The job's side of the reporter: the shared lock, the step count, the clock."""

    def __init__(self, master: FakeMaster) -> None:
        self.lock = threading.Lock()
        self.applied_step = -1
        self.now = 100.0
        self.read_unlocked = 0  # the step count read without the lock
        self.reporter = Reporter(master, ME, lock=self.lock, applied_step=self._step_count,
                                 clock=lambda: self.now, heartbeat_interval_s=HEARTBEAT_S)

    def _step_count(self) -> int:
        if not self.lock.locked():
            self.read_unlocked += 1
        return self.applied_step

    def apply(self, step: int, *, mine: int = 4, others: bool = True, seconds: float = 0.1) -> None:
        """What the step runner's publish does: the count and the records move under the lock."""
        records = [StepRecord(step=step, worker=ME, epoch=0, start=8 * step, end=8 * step + mine)]
        if others:
            records.append(StepRecord(step=step, worker=OTHER, epoch=0, start=8 * step + 4, end=8 * step + 8))
        started, self.now = self.now, self.now + seconds
        with self.lock:
            self.applied_step = step
            self.reporter.record_step(AppliedStep(step=step, mine=mine, total=8, records=records,
                                                  started=started, finished=self.now, collective_s=seconds / 2))


def steps_of(records: list[StepRecord]) -> list[tuple[int, int]]:
    return [(r.step, r.worker) for r in records]


@pytest.fixture
def master() -> FakeMaster:
    return FakeMaster()


@pytest.fixture
def worker(master: FakeMaster) -> Worker:
    w = Worker(master)
    w.reporter.new_round(0, -1)
    return w


def test_own_records_are_batched_and_sent_once(master: FakeMaster, worker: Worker) -> None:
    worker.apply(0)
    worker.apply(1)
    worker.reporter.report_if_due()  # the first look sends at once
    [req] = master.requests
    assert (req.worker_id, req.round, req.applied_step) == (ME, 0, 1)
    assert steps_of(req.records) == [(0, ME), (1, ME)]  # only this worker's, both steps in one request
    assert req.samples_per_s == pytest.approx(40.0) and req.compute_s_per_sample == pytest.approx(0.0125)
    assert worker.read_unlocked == 0  # the step count is read together with the records

    worker.apply(2)  # 0.1 s later: records wait for the interval
    worker.reporter.report_if_due()
    assert len(master.requests) == 1
    worker.now += REPORT_INTERVAL_S
    worker.reporter.report_if_due()
    assert steps_of(master.last().records) == [(2, ME)]
    assert master.last().incarnation == "m1"  # learned from the first answer

    worker.now += REPORT_INTERVAL_S
    worker.reporter.report_if_due()  # nothing waits, and the heartbeat is not due
    assert len(master.requests) == 2
    worker.now += HEARTBEAT_S
    worker.reporter.report_if_due()
    assert len(master.requests) == 3 and master.last().records == []  # a bare heartbeat


def test_a_failed_report_is_kept_and_sent_again(master: FakeMaster, worker: Worker) -> None:
    worker.apply(0)
    worker.reporter.left(pause=True)  # to re-form: a pause runs from step 0's end
    worker.reporter.new_round(1, -1)
    worker.now += 2.0
    worker.apply(1, others=False)
    master.error = MasterUnreachableError("master unreachable")
    worker.reporter.flush()
    assert steps_of(master.last().records) == [(1, ME)]
    [pause] = master.last().pauses
    assert (pause.round, pause.seconds) == (1, pytest.approx(2.1))
    master.error = None
    worker.apply(2, others=False)
    worker.reporter.flush()
    assert steps_of(master.last().records) == [(1, ME), (2, ME)]  # the failed ones first
    assert master.last().pauses == [pause]
    worker.reporter.flush()
    assert master.last().records == [] and master.last().pauses == []  # and then not again


def test_a_restarted_master_is_sent_the_records_it_had_not_finalized(master: FakeMaster, worker: Worker) -> None:
    for step in range(4):
        worker.apply(step)
    worker.reporter.flush()
    assert steps_of(master.last().records) == [(s, ME) for s in range(4)]
    worker.reporter.flush()
    assert master.last().records == []  # the same master: nothing is sent twice

    master.incarnation, master.finalized_step = "m2", 1  # restarted from its journal
    worker.reporter.flush()  # a heartbeat learns it
    assert master.last().records == []
    worker.apply(4)
    worker.reporter.flush()
    # this worker's own records above the finalized step, then the new one; not the other worker's
    assert steps_of(master.last().records) == [(2, ME), (3, ME), (4, ME)]
    assert master.last().incarnation == "m2"
    worker.reporter.flush()
    assert master.last().records == []


def test_acknowledged_steps_are_no_longer_held(master: FakeMaster, worker: Worker) -> None:
    for step in range(3):
        worker.apply(step)
    assert steps_of(worker.reporter.held_records()) == [(s, w) for s in range(3) for w in (ME, OTHER)]
    master.round, master.finalized_step = 1, 1  # the answer of another round acknowledges nothing
    worker.reporter.flush()
    assert len(worker.reporter.held_records()) == 6
    master.round = 0
    worker.reporter.flush()
    assert steps_of(worker.reporter.held_records()) == [(2, ME), (2, OTHER)]
    master.finalized_step = 0  # an older acknowledgement brings nothing back
    worker.reporter.flush()
    assert steps_of(worker.reporter.held_records()) == [(2, ME), (2, OTHER)]


def test_a_new_round_settles_what_was_held(master: FakeMaster, worker: Worker) -> None:
    worker.apply(0)
    worker.apply(1)
    worker.reporter.new_round(4, 0)  # the rendezvous carried the records; the source was at step 0
    assert worker.reporter.held_records() == []
    worker.reporter.flush()
    assert (master.last().round, master.last().records) == (4, [])
    worker.apply(2)
    assert steps_of(worker.reporter.held_records()) == [(2, ME), (2, OTHER)]


def test_a_rollback_round_claims_no_voided_step_before_its_state_is_in_place(master: FakeMaster,
                                                                            worker: Worker) -> None:
    """A round that resumes from a checkpoint of step 1 while this worker's state still holds
    step 3: until the state is restored (``joined``), its reports say step 1, or the master
    would finalize steps 2 and 3 of the new lineage before their records come (a lost server's
    restore found it: those samples then counted as never trained)."""
    for step in range(4):
        worker.apply(step)
    worker.reporter.new_round(2, 1, rollback=True)
    worker.reporter.flush()
    assert (master.last().round, master.last().applied_step, master.last().records) == (2, 1, [])
    worker.applied_step = 1  # the checkpoint's state is loaded, then the round forms
    worker.reporter.joined(WaitingComm(0.0))
    worker.apply(2)
    worker.reporter.flush()
    assert master.last().applied_step == 2 and steps_of(master.last().records) == [(2, ME)]


def test_a_stale_round_drops_the_records_it_carried(master: FakeMaster, worker: Worker) -> None:
    worker.apply(0)
    master.error = StaleRoundError("round 0 is closed")
    worker.reporter.flush()
    assert steps_of(master.last().records) == [(0, ME)]
    master.error = None
    worker.reporter.flush()
    assert master.last().records == []  # settled at the rendezvous, not sent again
    assert worker.reporter.gone is None


def test_a_worker_the_master_declared_failed_is_gone(master: FakeMaster, worker: Worker) -> None:
    master.error = StaleRoundError("round 0 is closed")
    worker.reporter.flush()
    assert worker.reporter.gone is None
    master.error = WorkerGoneError("worker 3 was declared failed; it must exit")
    worker.reporter.flush()
    assert worker.reporter.gone == "worker 3 was declared failed; it must exit"


@pytest.mark.parametrize(("stalled_s", "aborts"), [(STALL_ABORT_S + 0.5, 1), (STALL_ABORT_S - 0.5, 0), (0.0, 0)],
                         ids=["stalled", "slow", "idle"])
def test_a_reform_notice_is_kept_and_aborts_only_a_stalled_collective(
        master: FakeMaster, worker: Worker, stalled_s: float, aborts: int) -> None:
    comm = WaitingComm(stalled_s)
    worker.reporter.joined(comm)
    worker.reporter.flush()
    assert worker.reporter.reform_notice is False
    master.reform = True
    worker.reporter.flush()
    assert worker.reporter.reform_notice is True
    assert comm.aborts == aborts
    worker.reporter.joined(WaitingComm(0.0))  # the next round formed: the notice was answered
    assert worker.reporter.reform_notice is False


def test_a_reform_notice_counts_only_for_the_round_this_worker_is_in(master: FakeMaster, worker: Worker) -> None:
    master.reform = True
    worker.reporter.flush()  # assigned round 0, but its group has not formed yet
    assert worker.reporter.reform_notice is False
    comm = WaitingComm(STALL_ABORT_S + 1)
    worker.reporter.joined(comm)
    master.round = 1  # about another round
    worker.reporter.flush()
    assert worker.reporter.reform_notice is False
    worker.reporter.left()
    master.round = 0
    worker.reporter.flush()  # it left the round already
    assert worker.reporter.reform_notice is False and comm.aborts == 0


def test_the_thread_reports_until_stopped(master: FakeMaster) -> None:
    reporter = Reporter(master, ME, lock=threading.Lock(), applied_step=lambda: -1, tick_s=0.01)
    reporter.start(heartbeat_interval_s=0.01)
    try:
        assert master.answered.wait(10), "no heartbeat"
    finally:
        reporter.stop()
    assert master.requests[0].worker_id == ME


def test_after_a_long_outage_the_oldest_steps_go_first_and_no_step_is_claimed_ahead_of_them(
        master: FakeMaster, worker: Worker) -> None:
    # more records than one request may carry (the master unreachable for a long while): before,
    # building the request raised and the reporter thread died, so the worker stopped heartbeating
    master.error = MasterUnreachableError("master unreachable")
    steps = MAX_RECORDS_PER_REQUEST + 10
    for step in range(steps):
        worker.apply(step, others=False)
    worker.reporter.flush()
    master.error = None
    worker.reporter.flush()
    first = master.last()
    assert len(first.records) == MAX_RECORDS_PER_REQUEST
    assert first.applied_step == MAX_RECORDS_PER_REQUEST - 1  # not the step count: no record of later steps here
    worker.reporter.flush()
    second = master.last()
    assert [r.step for r in second.records] == list(range(MAX_RECORDS_PER_REQUEST, steps))
    assert second.applied_step == steps - 1


def test_the_first_report_counts_for_the_master_the_worker_joined(master: FakeMaster, worker: Worker) -> None:
    """A worker that trains and finishes before its first report: that report carries the
    incarnation its join returned, so the master finalizes its steps at once (without it they
    stayed tentative and the finished job had 'samples never trained')."""
    worker.reporter.start(HEARTBEAT_S, incarnation="m1")
    worker.reporter.stop()
    worker.apply(0)
    worker.reporter.flush()
    assert master.last().incarnation == "m1" and steps_of(master.last().records) == [(0, ME)]
