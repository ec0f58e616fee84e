"""Membership rounds: who trains in which round, and when the next round forms.

``RoundState`` is the rendezvous's state (the round, its members in rank order, the workers
waiting at the rendezvous and the assignments handed out). The decisions are pure functions
over it and the worker records (STYLE.md 2, after torch elastic's ``_RendezvousJoinOp``): they
return an action or None and change nothing; ``JobMaster`` applies what they return.

A round closes when every live member of the current round is at the rendezvous (survivors see
``reform`` in their next report and come). The first round, or a restart from no survivor,
waits for every launched worker, or for MIN of them and ``start_grace_s``. The member with the
highest applied step is the source of the next round's state; ties go to the lowest previous
rank. A scale-in lets stragglers leave first, then the most recent ranks. When no worker at the
rendezvous holds the model any more (every holder died) the round *restores*: its first member
loads the job's flash checkpoint the master chose (``tidal.master.checkpoints``) and is the
source; a job without checkpoints fails instead.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from tidal.api import RendezvousRequest, RendezvousResponse, WorkerState
from tidal.master.actions import FailJob, FormRound
from tidal.master.membership import WorkerRecord

log = logging.getLogger(__name__)
W = WorkerState
NOT_A_MEMBER = 1 << 30  # the "previous rank" of a newcomer: ties for the source go to members


@dataclass
class RoundState:
    round: int = -1
    reforming: bool = False
    reform_cause: str = ""
    reform_started: float = 0.0
    round_start_step: int = -1  # the step the current round resumed after
    failed_rounds: int = 0  # rounds in a row that failed before a step (see ``failed_again``)
    round_failure: str = ""
    waiting: dict[int, RendezvousRequest] = field(default_factory=dict)
    waiting_since: dict[int, float] = field(default_factory=dict)
    assignments: dict[int, RendezvousResponse] = field(default_factory=dict)
    assignments_dirty: bool = False  # journaled with the next round, not on every commit
    _members: list[int] = field(default_factory=list)
    _member_set: frozenset[int] = frozenset()

    @property
    def members(self) -> list[int]:
        """The current round's workers in rank order (``is_member`` for the O(1) test)."""
        return self._members

    @members.setter
    def members(self, workers: list[int]) -> None:
        self._members = list(workers)
        self._member_set = frozenset(workers)

    def is_member(self, worker_id: int) -> bool:
        return worker_id in self._member_set

    def start_reform(self, cause: str, now: float, keep_start: bool = False) -> None:
        """``keep_start``: a failure during a re-form restarts it with its own cause, but the
        round deadline still counts from the re-form's first start."""
        if self.reforming:
            return
        if not keep_start or not self.reform_started:
            self.reform_started = now
        self.reforming = True
        self.reform_cause = cause

    def restart_reform(self, cause: str, now: float) -> None:
        """A member failed: re-form with the cause that matters, keeping the deadline."""
        self.reforming = False
        self.start_reform(cause, now, keep_start=True)

    def leave_rendezvous(self, worker_id: int) -> None:
        self.waiting.pop(worker_id, None)
        self.waiting_since.pop(worker_id, None)


# ---------------------------------------------------------------------------------- decisions
def reform_cause(rs: RoundState, workers: Mapping[int, WorkerRecord], target: int) -> str | None:
    """Why the running round must re-form for the target (a scale-in, or newcomers to let in),
    or None."""
    if rs.round < 0 or rs.reforming or (not rs.waiting and len(rs.members) <= target):
        return None  # nothing to scale in and nobody to let in (the common case, checked every tick)
    members = [m for m in rs.members if workers[m].alive]
    newcomers = [w for w in rs.waiting if not rs.is_member(w)]
    if len(members) > target:
        return f"scale-in to {target}"
    if newcomers and len(members) < target:
        return f"scale-out to {min(target, len(members) + len(newcomers))}"
    return None


def decide_round(rs: RoundState, workers: Mapping[int, WorkerRecord], *, now: float, target: int,
                 min_workers: int, start_grace_s: float, finalized_step: int,
                 round_failure_limit: int, restore_from: int | None = None,
                 lost: str | None = None) -> FormRound | FailJob | None:
    """Form the next round when everyone it needs is at the rendezvous; None: not yet.

    ``restore_from``: when every worker holding the model is gone, the step of the checkpoint to
    resume from (``tidal.master.checkpoints``; -1: none usable, start again from scratch); None:
    the job takes no checkpoints, and then such a loss fails it. ``lost``: something beside the
    workers that holds part of the model was lost (a parameter server, named): the round
    resumes from the checkpoint even though workers hold the model, or fails the job if none can.
    """
    if not rs.waiting:
        return None
    if rs.round >= 0 and not rs.reforming:
        return None
    members = [m for m in rs.members if workers[m].alive]
    if any(m not in rs.waiting for m in members):
        return None  # survivors still training; they see ``reform`` in their next report
    newcomers = sorted(w for w in rs.waiting if not rs.is_member(w))
    if rs.round < 0 or not members:
        # the first round (or a restart from nothing) waits for every launched worker, or for
        # MIN of them and a grace period
        pending = [w for w, r in workers.items() if r.state in (W.LAUNCHING, W.JOINED)]
        oldest = min(rs.waiting_since.get(w, now) for w in rs.waiting)
        enough = len(newcomers) >= min(target, min_workers)
        if pending and not (enough and now - oldest >= start_grace_s):
            return None
    candidates = members + newcomers
    if len(candidates) < min_workers:
        return None
    chosen = choose_members(rs, workers, members, newcomers, target)
    failed_rounds, round_failure = failed_again(rs, candidates)
    if failed_rounds >= round_failure_limit:
        return FailJob(f"{failed_rounds} rounds in a row failed before a step was applied; the last: {round_failure}")
    reqs = {w: rs.waiting[w] for w in chosen}
    with_state = [w for w in chosen if reqs[w].applied_step >= 0]
    # a lost server took rows of every step any member applied: nothing trained is whole
    restore = (not with_state and finalized_step >= 0) or (lost is not None and (bool(with_state) or finalized_step >= 0))
    if restore:
        if lost is not None and (restore_from is None or (restore_from < 0 and with_state)):
            # the workers' models are not the fresh one: a restart from scratch cannot use them
            return FailJob(f"{lost} after step {finalized_step}, and no checkpoint holds its part of the model "
                           "(--checkpoint-every lets a job restore it; the first is taken after its first steps)")
        if restore_from is None:
            return FailJob(f"every worker holding the model was lost after step {finalized_step}; "
                           "there is no survivor to take the state from (--checkpoint-every lets a job resume)")
        source, resume_step = chosen[0], restore_from
    elif with_state:
        source = max(with_state, key=lambda w: (reqs[w].applied_step, -old_rank(rs, workers, w)))
        resume_step = max(reqs[source].applied_step, finalized_step)
    else:
        source, resume_step = chosen[0], finalized_step
    sync = (rs.round < 0 or any(not rs.is_member(w) for w in chosen)
            or len({reqs[w].applied_step for w in chosen}) > 1)
    staying = set(chosen)  # thousands of candidates: no list scan per candidate
    return FormRound(members=chosen, leaving=[w for w in candidates if w not in staying], source=source,
                     resume_step=resume_step, has_state=bool(with_state), sync_state=sync or restore,
                     failed_rounds=failed_rounds, round_failure=round_failure, restore=restore)


def choose_members(rs: RoundState, workers: Mapping[int, WorkerRecord], members: list[int],
                   newcomers: list[int], target: int) -> list[int]:
    keep = list(members)
    if len(keep) > target:
        # scale-in: stragglers leave first, then the most recent ranks
        keep.sort(key=lambda w: (workers[w].straggler, workers[w].rank))
        keep = sorted(keep[:target], key=lambda w: workers[w].rank)
    room = max(0, target - len(keep))
    return keep + newcomers[:room]


def failed_again(rs: RoundState, candidates: list[int]) -> tuple[int, str]:
    """Rounds in a row that ended in a failure (a member reports a broken collective or a group
    that did not form) without any step applied, counting the one now closing; and the last
    failure. The job fails once ``round_failure_limit`` is reached: the runtime's crash loop."""
    back = [rs.waiting[w] for w in candidates]
    failures = [r.failure for r in back if r.failure and r.after_round == rs.round]
    top = max((r.applied_step for r in back), default=-1)
    if rs.round >= 0 and failures and top <= rs.round_start_step:
        return rs.failed_rounds + 1, failures[0]
    return 0, rs.round_failure


def old_rank(rs: RoundState, workers: Mapping[int, WorkerRecord], worker_id: int) -> int:
    return workers[worker_id].rank if rs.is_member(worker_id) else NOT_A_MEMBER
