"""The master's decisions as pure functions: a view of the state and a time in, actions out.

No master, no journal, no backend: worker records and a ``RoundState`` built by hand, the time
passed as a number (STYLE.md 2 and 8).
"""

from __future__ import annotations

from tidal.api import RendezvousRequest, WorkerState
from tidal.master.actions import FailJob, FailWorker, FormRound, SetStraggler, SlowSince
from tidal.master.liveness import check_heartbeats, check_progress, detect_stragglers
from tidal.master.membership import WorkerRecord
from tidal.master.rounds import RoundState, decide_round, failed_again, reform_cause

W = WorkerState
NOW = 1000.0


def rec(worker_id: int, state: WorkerState = W.ACTIVE, **kw: object) -> WorkerRecord:
    r = WorkerRecord(worker_id, state, launched_at=kw.pop("launched_at", NOW), last_seen=kw.pop("last_seen", NOW))
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def waiting(rs: RoundState, worker_id: int, applied: int = -1, after: int | None = None, failure: str = "",
            since: float = NOW) -> None:
    rs.waiting[worker_id] = RendezvousRequest(worker_id=worker_id, after_round=rs.round if after is None else after,
                                              applied_step=applied, failure=failure)
    rs.waiting_since[worker_id] = since


def decide(rs: RoundState, workers: dict[int, WorkerRecord], **kw: object) -> FormRound | FailJob | None:
    args: dict[str, object] = {"now": NOW, "target": 2, "min_workers": 1, "start_grace_s": 5.0, "finalized_step": -1,
                               "round_failure_limit": 3}
    args.update(kw)
    return decide_round(rs, workers, **args)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- rounds
def test_the_first_round_waits_for_every_launched_worker_or_min_and_the_grace() -> None:
    rs = RoundState()
    workers = {0: rec(0, W.WAITING), 1: rec(1, W.LAUNCHING)}
    waiting(rs, 0)
    assert decide(rs, workers) is None  # worker 1 may still come
    assert decide(rs, workers, now=NOW + 4.9) is None
    form = decide(rs, workers, now=NOW + 5.0)  # MIN (1) is here and the grace is over
    assert isinstance(form, FormRound) and form.members == [0] and form.sync_state
    assert decide(rs, workers, min_workers=2, now=NOW + 60) is None  # below MIN: never


def test_a_round_forms_only_when_every_live_member_is_at_the_rendezvous() -> None:
    rs = RoundState(round=3, reforming=True)
    rs.members = [0, 1, 2]
    workers = {0: rec(0, W.WAITING, rank=0), 1: rec(1, rank=1), 2: rec(2, W.FAILED, rank=2)}
    waiting(rs, 0, applied=7)
    assert decide(rs, workers, target=3) is None  # worker 1 is still training
    waiting(rs, 1, applied=8)
    form = decide(rs, workers, target=3, finalized_step=6)
    assert isinstance(form, FormRound)
    assert form.members == [0, 1] and form.source == 1 and form.resume_step == 8  # the most advanced
    assert form.sync_state  # they hold different steps


def test_no_round_while_the_running_round_is_not_re_forming() -> None:
    rs = RoundState(round=0)
    rs.members = [0]
    waiting(rs, 1)
    assert decide(rs, {0: rec(0), 1: rec(1, W.WAITING)}) is None


def test_the_source_tie_goes_to_the_lowest_previous_rank_and_newcomers_fill_the_room() -> None:
    rs = RoundState(round=1, reforming=True)
    rs.members = [4, 2]
    workers = {4: rec(4, W.WAITING, rank=0), 2: rec(2, W.WAITING, rank=1), 9: rec(9, W.WAITING), 7: rec(7, W.WAITING)}
    for w in (4, 2):
        waiting(rs, w, applied=5)
    for w in (9, 7):
        waiting(rs, w)
    form = decide(rs, workers, target=3)
    assert isinstance(form, FormRound)
    assert form.source == 4 and form.members == [4, 2, 7] and form.leaving == [9]
    assert form.sync_state  # a newcomer needs the state


def test_scale_in_lets_stragglers_leave_first() -> None:
    rs = RoundState(round=2, reforming=True)
    rs.members = [0, 1, 2]
    workers = {0: rec(0, W.WAITING, rank=0, straggler=True), 1: rec(1, W.WAITING, rank=1),
               2: rec(2, W.WAITING, rank=2)}
    for w in workers:
        waiting(rs, w, applied=3)
    form = decide(rs, workers, target=2)
    assert isinstance(form, FormRound) and form.members == [1, 2] and form.leaving == [0]
    assert not form.sync_state  # the same step everywhere: nothing to send


def test_losing_every_holder_of_the_model_fails_the_job() -> None:
    rs = RoundState(round=2, reforming=True)
    rs.members = [0]
    waiting(rs, 5)
    decision = decide(rs, {0: rec(0, W.FAILED), 5: rec(5, W.WAITING)}, finalized_step=10)
    assert isinstance(decision, FailJob) and "no survivor" in decision.reason


def test_losing_every_holder_of_the_model_resumes_from_the_checkpoint_when_the_job_takes_them() -> None:
    rs = RoundState(round=2, reforming=True)
    rs.members = [0, 1]
    waiting(rs, 5)
    waiting(rs, 6)
    workers = {0: rec(0, W.FAILED), 1: rec(1, W.FAILED), 5: rec(5, W.WAITING), 6: rec(6, W.WAITING)}
    form = decide(rs, workers, finalized_step=10, restore_from=7)
    assert isinstance(form, FormRound) and form.restore and form.resume_step == 7
    assert form.members == [5, 6] and form.source == 5 and form.sync_state and not form.has_state
    scratch = decide(rs, workers, finalized_step=10, restore_from=-1)  # no checkpoint it can load
    assert isinstance(scratch, FormRound) and scratch.restore and scratch.resume_step == -1


def test_a_survivor_is_the_source_even_when_the_job_takes_checkpoints() -> None:
    rs = RoundState(round=2, reforming=True)
    rs.members = [0, 1]
    waiting(rs, 1, applied=12)
    waiting(rs, 5)
    form = decide(rs, {0: rec(0, W.FAILED), 1: rec(1, W.WAITING), 5: rec(5, W.WAITING)}, finalized_step=10,
                  restore_from=7)
    assert isinstance(form, FormRound) and not form.restore and form.source == 1 and form.resume_step == 12


def test_a_first_round_is_no_resume() -> None:
    rs = RoundState()
    waiting(rs, 0)
    form = decide(rs, {0: rec(0, W.WAITING)}, target=1, restore_from=-1)
    assert isinstance(form, FormRound) and not form.restore and form.resume_step == -1


def test_rounds_that_keep_failing_before_a_step_fail_the_job() -> None:
    rs = RoundState(round=4, reforming=True, round_start_step=9, failed_rounds=2)
    rs.members = [0, 1]
    workers = {0: rec(0, W.WAITING, rank=0), 1: rec(1, W.WAITING, rank=1)}
    waiting(rs, 0, applied=9, failure="ncclInvalidUsage")
    waiting(rs, 1, applied=9)
    assert failed_again(rs, [0, 1]) == (3, "ncclInvalidUsage")
    decision = decide(rs, workers)
    assert isinstance(decision, FailJob) and "3 rounds in a row" in decision.reason
    waiting(rs, 1, applied=10)  # a step was applied since: the count starts over
    form = decide(rs, workers)
    assert isinstance(form, FormRound) and form.failed_rounds == 0


def test_reform_causes() -> None:
    rs = RoundState(round=0)
    rs.members = [0, 1]
    workers = {0: rec(0), 1: rec(1), 2: rec(2, W.WAITING)}
    assert reform_cause(rs, workers, target=2) is None
    assert reform_cause(rs, workers, target=1) == "scale-in to 1"
    waiting(rs, 2, after=-1)
    assert reform_cause(rs, workers, target=3) == "scale-out to 3"
    rs.reforming = True
    assert reform_cause(rs, workers, target=1) is None  # already re-forming


# ----------------------------------------------------------------------------- liveness
def test_heartbeat_and_start_timeouts() -> None:
    workers = [rec(0, last_seen=NOW - 6), rec(1, last_seen=NOW - 4), rec(2, W.LAUNCHING, launched_at=NOW - 200, pid=7),
               rec(3, last_seen=NOW - 60, finished=True),
               # placed by Ray 100 s after its launch: 100 s of 180 since its process started
               rec(4, W.LAUNCHING, launched_at=NOW - 200, pid=8, create_time=NOW - 100),
               # not placed yet (no process): the backend's --wait-for-resources decides
               rec(5, W.LAUNCHING, launched_at=NOW - 500)]
    actions = check_heartbeats(workers, NOW, heartbeat_timeout_s=5.0, start_timeout_s=180.0)
    assert [(a.worker_id, a.kill) for a in actions] == [(0, "hb-0"), (2, "start-2")]
    assert "missed heartbeats for 6.0s" in actions[0].why


def test_members_that_never_reach_the_rendezvous_fail_after_the_round_timeout() -> None:
    rs = RoundState(round=3, reforming=True, reform_started=NOW - 61, reform_cause="worker 7 failed")
    rs.members = [0, 1, 2]
    waiting(rs, 0, applied=4)
    workers = {0: rec(0, W.WAITING), 1: rec(1), 2: rec(2, step_s=30.0)}  # worker 2's steps are long
    actions = check_progress(rs, workers, NOW, round_timeout_s=60.0, progress_timeout_s=300.0)
    assert actions == [FailWorker(1, "did not reach the rendezvous 61s after the re-form began (worker 7 failed)",
                                  kill="late-1-3")]


def test_a_member_that_applies_no_step_while_its_peers_do_is_replaced() -> None:
    rs = RoundState(round=1)
    rs.members = [0, 1, 2]
    workers = {0: rec(0, applied_step=50, progressed_at=NOW), 1: rec(1, applied_step=50, progressed_at=NOW),
               2: rec(2, applied_step=20, progressed_at=NOW - 301)}
    actions = check_progress(rs, workers, NOW, round_timeout_s=60.0, progress_timeout_s=300.0)
    assert [(a.worker_id, a.kill) for a in actions] == [(2, "stuck-2-1")]
    workers[2].progressed_at = NOW - 299
    assert check_progress(rs, workers, NOW, round_timeout_s=60.0, progress_timeout_s=300.0) == []


def test_a_straggler_needs_a_lasting_slowness_and_is_forgiven_once_it_catches_up() -> None:
    workers = [rec(0, compute_s_per_sample=1.0), rec(1, compute_s_per_sample=1.0), rec(2, compute_s_per_sample=4.0)]
    first = detect_stragglers(workers, NOW, factor=2.0, window_s=2.0)
    assert first == [SlowSince(2, NOW)]  # noted, not yet a straggler
    workers[2].slow_since = NOW
    later = detect_stragglers(workers, NOW + 2.0, factor=2.0, window_s=2.0)
    assert len(later) == 1 and isinstance(later[0], SetStraggler)
    assert later[0].straggler and later[0].size_factor == 0.25
    workers[2].straggler, workers[2].compute_s_per_sample = True, 1.1
    caught_up = detect_stragglers(workers, NOW + 3.0, factor=2.0, window_s=2.0)
    assert SlowSince(2, None) in caught_up
    assert any(isinstance(a, SetStraggler) and not a.straggler and a.size_factor == 1.0 for a in caught_up)
