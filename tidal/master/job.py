"""The job master's state machine: membership rounds, rendezvous, step commits, shards, workers.

Everything here runs on one thread (the master's event loop), reads time only through the
injected ``clock`` and does I/O only through the injected journal and backend, so tests drive
it directly with a fake clock and the HTTP service is a thin layer over it.

Commit protocol (DESIGN.md section 4, "Data, exactly once"):

* Every step each worker all-gathers ``(samples, epoch, start, end)`` with its peers before the
  gradient reduction, so every worker that applies step ``s`` knows every range of step ``s``.
* Workers report their own records asynchronously. The records of step ``s`` are *final* when
  every member of the round has reported ``applied_step >= s``: then every survivor, whoever
  dies next, holds a model that includes step ``s``. Only final records reach the shard table,
  the journal and the ledger.
* When a round ends (failure, scale), the member with the highest ``applied_step`` becomes the
  source of state for the next round and its records of not-yet-final steps are finalized; the
  others are discarded (a dead worker may have applied a step no survivor applied: those samples
  go back to TODO). Then every DOING shard returns to TODO from its first uncommitted index.

No false success (DESIGN.md 4):

* State changes only together with the journal. A request or tick whose journal write fails
  leaves the master *paused*: it answers 503 to every request that would change state (workers
  retry with backoff and keep their records), probes the journal, and once a write succeeds it
  reloads its whole state from the journal (as a restarted master would, with a new
  incarnation, so workers resend what was not final). Whatever changed in memory without
  reaching the journal is thereby rolled back.
* ``finish`` is accepted only when no sample is left, and the job is SUCCEEDED only when every
  shard of every epoch is DONE and the journal's ledger covers every epoch exactly once;
  otherwise it is FAILED with the reason.
* Liveness by progress: a re-form that has not closed ``round_timeout_s`` after it began fails
  the members that never reached the rendezvous (a worker whose main thread hangs keeps
  heartbeating); a member that applies no step for ``progress_timeout_s`` while its peers do is
  replaced. The crash-loop rule counts consecutive start failures of one worker *slot*.
"""

from __future__ import annotations

import functools
import itertools
import logging
import secrets
import statistics
from collections import deque
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path
from typing import Any, TextIO, TypeVar

from tidal.api import (
    DatasetRequest,
    Event,
    FinishRequest,
    JobSnapshot,
    JobState,
    JoinRequest,
    JoinResponse,
    LeaseRequest,
    LeaseResponse,
    RendezvousRequest,
    RendezvousResponse,
    ReportRequest,
    ReportResponse,
    ShardCounts,
    StatusResponse,
    StepRecord,
    TidalError,
    WorkerInfo,
    WorkerState,
)
from tidal.backends.api import Backend, BackendEvent, WorkerSpec
from tidal.brain.api import Planner
from tidal.master.api import (
    BadRequestError,
    JobSpec,
    JournalUnavailableError,
    NotExhaustedError,
    StaleRoundMasterError,
    UnknownWorkerError,
    WorkerGoneError,
)
from tidal.master.audit import audit_ranges
from tidal.master.journal import Journal
from tidal.master.membership import ALIVE, WorkerRecord
from tidal.master.progress import MemberProgress
from tidal.master.shards import CommittedRange, DatasetConfig, ShardManager

log = logging.getLogger(__name__)
W = WorkerState
F = TypeVar("F", bound=Callable[..., Any])

LAUNCH_BATCH = 32  # processes started per tick: a huge target must not stall the event loop
MAX_PAUSES = 1000  # pause records kept (one per round); older ones are dropped
MAX_METRICS = 256  # keys of worker-sent metrics kept
JOURNAL_PROBE_S = 0.5  # how often a paused master tries its journal again


def journaled(method: F) -> F:
    """A request handler that changes state: refused with 503 while the journal is unavailable,
    and one whose journal write fails pauses the job (its in-memory changes are rolled back by
    the reload from the journal when the journal is writable again)."""

    @functools.wraps(method)
    def wrapper(self: JobMaster, *args: Any, **kwargs: Any) -> Any:
        if self.paused is not None:
            raise JournalUnavailableError(f"the job is paused: {self.paused}")
        try:
            return method(self, *args, **kwargs)
        except JournalUnavailableError as exc:
            self._pause(str(exc))
            raise

    return wrapper  # type: ignore[return-value]


class JobMaster:
    def __init__(
        self,
        spec: JobSpec,
        journal: Journal,
        backend: Backend,
        planner: Planner,
        clock: Callable[[], float],
        store_port: int,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.spec = spec
        self.journal = journal
        self.backend = backend
        self.planner = planner
        self.clock = clock
        self.store_port = store_port
        self._on_change = on_change  # wakes long-polling rendezvous requests
        # what the job shows its user; kept when the state is reloaded from the journal
        self.events: deque[Event] = deque(maxlen=500)
        self.event_seq = 0
        self.metrics: dict[str, float] = {}
        self.round_causes: dict[int, str] = {}
        self.pause_events: dict[int, Event] = {}
        self.paused: str | None = None  # why the job stands still (the journal cannot be written)
        self.paused_since = 0.0
        self._next_journal_probe = 0.0
        self._ledger: TextIO | None = None
        self._exits: deque[BackendEvent] = deque()  # process exits not yet handled
        self._init_runtime()

    def _init_runtime(self) -> None:
        """Everything rebuilt from the journal by ``resume`` (also when a paused master reloads)."""
        spec = self.spec
        self.state = JobState.RUNNING
        self.incarnation = secrets.token_hex(4)  # this master process, as workers see it
        self.error: str | None = None
        self.target = spec.initial_workers or spec.max_workers
        self.target_override: int | None = spec.initial_workers
        self.workers: dict[int, WorkerRecord] = {}
        self.next_worker_id = 0
        self.shards = ShardManager()

        # membership rounds
        self.round = -1
        self._members: list[int] = []
        self._member_set: frozenset[int] = frozenset()
        self.reforming = False
        self.reform_cause = ""
        self.reform_started = 0.0
        self.round_start_step = -1  # the step the current round resumed after
        self.failed_rounds = 0  # rounds in a row that failed before a step (see _round_failed_again)
        self.round_failure = ""
        self.waiting: dict[int, RendezvousRequest] = {}
        self.waiting_since: dict[int, float] = {}
        self.assignments: dict[int, RendezvousResponse] = {}
        self._assignments_dirty = False

        # step commits
        self.finalized_step = -1
        # step -> (worker, start) -> record: reported, not yet final
        self.tentative: dict[int, dict[tuple[int, int], StepRecord]] = {}
        self.progress = MemberProgress()
        self._next_plan_at = 0.0
        self._next_liveness_check = 0.0
        self._next_straggler_check = 0.0
        self._next_progress_check = 0.0

        self.restarts = 0
        # consecutive start failures per worker slot (a replacement inherits its slot's count;
        # a worker that trains resets it)
        self.slot_failures: dict[int, int] = {}
        self._launch_seq = 0
        self._next_launch_at = 0.0
        self._next_launch_check = 0.0

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

    # ================================================================== lifecycle
    def open_ledger(self, rewrite: bool = False) -> None:
        """Open the ledger file. On resume it is rewritten from the journal (the truth)."""
        path = self.spec.ledger_path
        if not path:
            return
        try:
            if rewrite:
                with open(path, "w") as out:
                    for row in self.journal.load_ledger():
                        out.write(_ledger_line(row))
            self._ledger = open(path, "a")
        except OSError as exc:
            raise JournalUnavailableError(f"cannot write ledger {path}: {exc.strerror}") from exc

    def start(self) -> None:
        with self.journal.transaction():
            self.journal.put_meta("spec", self.spec.to_json())
            self._save_meta()
        self.open_ledger()
        self._event("job", f"job {self.spec.job_id} started: workers {self.spec.min_workers}:{self.spec.max_workers}")

    def resume(self, why: str = "master resumed from journal") -> None:
        """Rebuild from the journal and adopt the workers that are still running."""
        j = self.journal
        meta = j.get_meta("state", {})
        self.state = JobState(meta.get("job_state", "running"))
        self.round = meta.get("round", -1)
        self.members = list(meta.get("members", []))
        self.finalized_step = meta.get("finalized_step", -1)
        self.target = meta.get("target", self.target)
        self.target_override = meta.get("target_override")
        self.next_worker_id = meta.get("next_worker_id", 0)
        self.restarts = meta.get("restarts", 0)
        self.slot_failures = {int(k): v for k, v in (meta.get("slot_failures") or {}).items()}
        self.error = meta.get("error")
        self.assignments = {int(k): RendezvousResponse(**v) for k, v in (j.get_meta("assignments") or {}).items()}
        dataset = meta.get("dataset")
        self.shards.restore(DatasetConfig(**dataset) if dataset else None, j.load_shards(), j.load_ledger())
        now = self.clock()
        for worker_id, row in j.load_workers().items():
            rec = WorkerRecord.from_row(worker_id, row)
            # liveness and progress count from now: the time the master was away is no one's fault
            rec.last_seen = rec.progressed_at = now
            self.workers[worker_id] = rec
            if rec.alive and not self.backend.adopt(worker_id, rec.pid, rec.create_time):
                self._worker_failed(rec, None, "gone while the master was down")
        # Every member must report to this master before a step is final again. One found dead
        # above holds finalization back, as in a running master, until the next round settles its
        # steps: its records of the last steps are only in the survivors' hands, and finalizing
        # those steps on the survivors' reports alone would drop them (the chaos audit found it).
        self.progress = MemberProgress([m for m in self.members if m in self.workers
                                        and self.workers[m].state is not W.SUCCEEDED])
        if self.round >= 0:
            for a in self.assignments.values():
                if a.status == "ready":
                    a.store_port = self.store_port
        self.open_ledger(rewrite=True)
        self._event("job", f"{why} at round {self.round}, step {self.finalized_step}")
        self._persist()

    def close(self) -> None:
        if self._ledger:
            try:
                self._ledger.close()
            except OSError as exc:  # buffered lines on a full disk: the journal has them
                log.warning("job %s: closing the ledger: %s", self.spec.job_id, exc)
            self._ledger = None

    # ================================================================== journal outages
    def _pause(self, why: str) -> None:
        if self.paused is not None:
            return
        self.paused = why
        self.paused_since = self.clock()
        self._next_journal_probe = self.paused_since + JOURNAL_PROBE_S
        self._event("paused", f"job paused: {why}; workers wait and retry, nothing is dropped")
        log.error("job %s: paused: %s", self.spec.job_id, why)

    def _retry_journal(self, now: float) -> None:
        """While paused: probe the journal; once it takes a write, reload the state from it."""
        if now < self._next_journal_probe:
            return
        self._next_journal_probe = now + JOURNAL_PROBE_S
        paused_for = now - self.paused_since
        try:
            with self.journal.transaction():
                self.journal.put_meta("probe", now)
            self.close()
            self._init_runtime()
            self.paused = None
            self.resume(f"journal writable again after {paused_for:.1f}s; state reloaded from the journal")
        except JournalUnavailableError as exc:
            self.paused = self.paused or str(exc)
            if paused_for > self.spec.journal_patience_s and self.state is not JobState.FAILED:
                # nothing more can be journaled: fail in memory only (the journal still holds every
                # committed step, so ``tidal master --resume`` can carry on once there is room)
                self.error = f"the journal could not be written for {paused_for:.0f}s: {exc}"
                self.state = JobState.FAILED
                self._event("job", f"job failed: {self.error}")
            if self.state is JobState.FAILED and self._alive_ids():
                self.backend.terminate(self._alive_ids(), "journal-lost")
            if self.state is JobState.FAILED:  # a live job keeps process exits for the reload
                for ev in self.backend.poll_events():
                    rec = self.workers.get(ev.worker_id)
                    if rec is not None and (rec.alive or rec.state is W.LEAVING):
                        rec.move(W.FAILED, now)

    @property
    def done(self) -> bool:
        return self.state in (JobState.SUCCEEDED, JobState.FAILED) and not self._alive_ids()

    # ================================================================== requests
    @journaled
    def join(self, req: JoinRequest) -> JoinResponse:
        rec = self._worker(req.worker_id)
        now = self.clock()
        rec.pid = req.pid or rec.pid
        rec.last_seen = now
        if rec.state is W.LAUNCHING:
            rec.move(W.JOINED, now)
            self._event("join", f"worker {rec.worker_id} joined (pid {rec.pid})", worker=rec.worker_id)
            self._persist_worker(rec)
        return JoinResponse(
            job_id=self.spec.job_id, round=self.round,
            heartbeat_interval_s=self.spec.heartbeat_interval_s,
            collective_timeout_s=self.spec.collective_timeout_s,
        )

    @journaled
    def rendezvous(self, req: RendezvousRequest) -> RendezvousResponse:
        rec = self._worker(req.worker_id)
        now = self.clock()
        rec.last_seen = now
        if self.state is not JobState.RUNNING:
            return RendezvousResponse(status="finished")
        if req.after_round > self.round:
            raise StaleRoundMasterError(f"round {req.after_round} is ahead of the master's round {self.round}")
        assigned = self.assignments.get(req.worker_id)
        if assigned is not None and req.after_round < self.round and assigned.round == self.round:
            return assigned  # a re-poll for an assignment already made
        if assigned is not None and assigned.status == "leave":
            return assigned
        if rec.state is W.LEAVING:
            return RendezvousResponse(status="leave")
        if self.is_member(req.worker_id) and req.after_round == self.round and not self.reforming:
            self._start_reform(f"worker {req.worker_id} left the collective")
        self._check_records(req)
        if rec.state in (W.JOINED, W.ACTIVE):
            rec.move(W.WAITING, now)
        prior = self.waiting.get(req.worker_id)
        self.waiting[req.worker_id] = req
        self.waiting_since.setdefault(req.worker_id, now)
        rec.applied_step = max(rec.applied_step, req.applied_step)
        if prior is None or (prior.after_round, prior.applied_step) != (req.after_round, req.applied_step):
            # A long-poll's re-poll changes nothing the round depends on: the tick (every 20 ms)
            # re-checks time-based conditions, and 2,000 re-polls a second must not each scan
            # every worker.
            self._try_close_round()
        assigned = self.assignments.get(req.worker_id)
        if assigned is not None and assigned.round == self.round and req.worker_id not in self.waiting:
            return assigned
        if assigned is not None and assigned.status == "leave":
            return assigned
        return RendezvousResponse(status="waiting", round=self.round)

    def _check_records(self, req: RendezvousRequest) -> None:
        """Records a rendezvous carries must be committable: anything else is a 400 now, not a
        crash when the round closes."""
        if not req.records:
            return
        cfg = self.shards.config
        if cfg is None:
            raise BadRequestError("records before any shard was leased")
        for r in req.records:
            if r.step > req.applied_step:
                raise BadRequestError(f"record of step {r.step} is beyond applied_step {req.applied_step}")
            if not r.start < r.end <= cfg.size:
                raise BadRequestError(f"record range [{r.start}, {r.end}) is not inside the dataset")
            if r.worker not in self.workers:  # records may be of an earlier round's members
                raise BadRequestError(f"record of unknown worker {r.worker}")

    @journaled
    def report(self, req: ReportRequest) -> ReportResponse:
        rec = self._worker(req.worker_id)
        now = self.clock()
        rec.last_seen = now
        if req.round >= 0 and req.round != self.round:
            raise StaleRoundMasterError(f"round {req.round} is not the current round {self.round}")
        rec.samples_per_s = req.samples_per_s
        if req.compute_s_per_sample > 0:
            rec.compute_s_per_sample = req.compute_s_per_sample
        if req.round == self.round and self.is_member(req.worker_id) and rec.state in (W.ACTIVE, W.WAITING):
            rec.progressed(req.applied_step, now)
            for r in req.records:
                if r.worker != req.worker_id:
                    raise BadRequestError("a report may only carry the worker's own records")
                if r.step > req.applied_step:
                    raise BadRequestError(f"record of step {r.step} is beyond applied_step {req.applied_step}")
                if r.step > self.finalized_step:
                    self.tentative.setdefault(r.step, {})[(r.worker, r.start)] = r
                elif not self.shards.is_committed(r.epoch, r.start, r.end):
                    # a step was finalized without this record: a protocol bug, never silent
                    self._event("error", f"late record of final step {r.step} from worker {r.worker}")
                    log.error("job %s: late record %s", self.spec.job_id, r)
            if req.incarnation == self.incarnation:
                # only a worker that knows this master has resent what a predecessor lost
                self.progress.update(req.worker_id, req.applied_step)
                self._finalize_reported()
        for pause in req.pauses:
            self._record_pause(pause.round, pause.seconds)
        return ReportResponse(round=self.round, reform=self.reforming, finalized_step=self.finalized_step,
                              incarnation=self.incarnation)

    @journaled
    def lease(self, req: LeaseRequest) -> LeaseResponse:
        rec, first = self._configure_dataset(req)
        shard = self.shards.lease(req.worker_id, req.epoch, rec.size_factor)
        with self.journal.transaction():
            self.journal.save_shards(self.shards.dirty())
            if first:
                self._save_meta()
        if shard is None:
            return LeaseResponse(status="empty")
        return LeaseResponse(status="ok", shard=shard)

    @journaled
    def configure_dataset(self, req: DatasetRequest) -> None:
        _, first = self._configure_dataset(req)
        if first:
            with self.journal.transaction():
                self._save_meta()

    def _configure_dataset(self, req: LeaseRequest | DatasetRequest) -> tuple[WorkerRecord, bool]:
        """A member of the current round names the dataset; True if it was the first to."""
        rec = self._worker(req.worker_id)
        rec.last_seen = self.clock()
        if req.round != self.round or not self.is_member(req.worker_id):
            raise StaleRoundMasterError(f"worker {req.worker_id} is not in round {req.round} (current {self.round})")
        first = self.shards.config is None
        self.shards.configure(DatasetConfig(req.dataset_size, req.batch_size, req.batches_per_shard, req.shuffle,
                                            req.seed, req.epochs))
        return rec, first

    @journaled
    def finish(self, req: FinishRequest) -> None:
        """A worker's training loop is over: accepted only if the master agrees no sample is left.

        Raises:
            NotExhaustedError: samples the master knows of were never trained (409).
        """
        rec = self._worker(req.worker_id)
        pending = [(r.epoch, r.start, r.end) for records in self.tentative.values() for r in records.values()]
        pending += [(r.epoch, r.start, r.end) for r in req.records if r.step <= req.applied_step]
        left = self.shards.unconsumed(pending)
        if left:
            gaps = list(itertools.islice(self.shards.uncovered(pending), 3))
            message = (f"worker {req.worker_id} says training is over after step {req.applied_step}, but "
                       f"{_samples_left(left)}; first untrained (epoch, start, end): {gaps}")
            self._event("error", f"finish refused: {message}")
            raise NotExhaustedError(message)
        rec.finished = True
        for key, value in req.metrics.items():
            if key in self.metrics or len(self.metrics) < MAX_METRICS:
                self.metrics[key[:64]] = value
        # its records were flushed before it said so: it no longer holds finalization back
        # (a member that *fails* keeps holding it back until the next round settles its steps)
        self.progress.remove(req.worker_id)
        self._finalize_reported()
        if self.state is JobState.RUNNING:
            self.state = JobState.FINISHING
            self._event("job", f"training finished (reported by worker {req.worker_id})")
            self._persist()
            self._on_change()

    @journaled
    def scale(self, workers: int) -> int:
        if self.state is not JobState.RUNNING:
            raise BadRequestError(f"job is {self.state.value}; cannot scale")
        if not self.spec.min_workers <= workers <= self.spec.max_workers:
            raise BadRequestError(
                f"{workers} workers is outside this job's range {self.spec.min_workers}:{self.spec.max_workers}"
            )
        self.target_override = workers
        self._event("scale", f"target set to {workers} workers (was {self.target})")
        self.target = workers
        self._persist()
        self._next_launch_check = 0.0
        self.tick()
        return workers

    # ================================================================== periodic work
    def tick(self) -> None:
        """Process exits, heartbeat leases, the planner's target, launches and the rendezvous.

        While the journal is unavailable only the journal is probed; a journal write that fails
        here pauses the job like one in a request.
        """
        now = self.clock()
        if self.paused is not None:
            self._retry_journal(now)
            return
        try:
            self._reconcile(now)
        except JournalUnavailableError as exc:
            self._pause(str(exc))

    def _reconcile(self, now: float) -> None:
        self._exits.extend(self.backend.poll_events())
        while self._exits:
            ev = self._exits[0]  # dropped only once handled: a journal failure keeps it for the reload
            rec = self.workers.get(ev.worker_id)
            if rec is not None:
                self._process_exited(rec, ev.exit_code)
            self._exits.popleft()
        for rec in self._liveness_candidates(now):
            if (rec.state in (W.JOINED, W.WAITING, W.ACTIVE) and not rec.finished
                    and now - rec.last_seen > self.spec.heartbeat_timeout_s):
                self._worker_failed(rec, None, f"missed heartbeats for {now - rec.last_seen:.1f}s")
                self.backend.terminate([rec.worker_id], f"hb-{rec.worker_id}")
            elif rec.state is W.LAUNCHING and now - rec.launched_at > self.spec.start_timeout_s:
                self._worker_failed(rec, None, f"did not join within {self.spec.start_timeout_s:.0f}s")
                self.backend.terminate([rec.worker_id], f"start-{rec.worker_id}")
        if self.state is JobState.RUNNING:
            if now >= self._next_straggler_check:
                self._next_straggler_check = now + 0.5
                self._detect_stragglers()
            if now >= self._next_progress_check:
                self._next_progress_check = now + 0.5
                self._check_progress(now)
            if now >= self._next_plan_at:
                self._next_plan_at = now + 1.0
                self._apply_plan()
            self._launch_missing(now)
            self._maybe_start_reform()
            self._try_close_round()
        elif self.state is JobState.FINISHING and not self._alive_ids():
            self._settle()
        elif self.state is JobState.FAILED:
            alive = self._alive_ids()
            if alive:
                self.backend.terminate(alive, "job-failed")

    def _settle(self) -> None:
        """FINISHING with no process left: SUCCEEDED only if nothing of the data is missing."""
        if not any(r.state is W.SUCCEEDED and r.ever_active for r in self.workers.values()):
            self.error = "no worker finished its script"
        else:
            self.error = self._data_problem()
        self._set_state(JobState.FAILED if self.error else JobState.SUCCEEDED)

    def _data_problem(self) -> str | None:
        """Why the job's data is not wholly trained, or None: every shard of every epoch DONE and
        the journal's ledger covering every epoch exactly once."""
        left = self.shards.unconsumed()
        if left:
            return f"the workers finished, but {_samples_left(left)}"
        cfg = self.shards.config
        if cfg is None:
            return None
        # epochs=None audits the epochs the ledger has: ``unconsumed`` already saw every other one
        audit = audit_ranges(((c.epoch, c.start, c.end) for c in self.journal.load_ledger()), cfg.size, cfg.epochs)
        return None if audit.ok else f"the journal's ledger is not exactly once: {audit.summary()}"

    def _check_progress(self, now: float) -> None:
        """Liveness by progress, not only by heartbeat (a hung main thread still heartbeats)."""
        if self.round < 0:
            return
        if self.reforming:
            waited = now - self.reform_started
            late = [self.workers[m] for m in self.members if self.workers[m].alive and m not in self.waiting
                    and waited > self.workers[m].allowance(self.spec.round_timeout_s)]
            for rec in late:
                self._worker_failed(rec, None, f"did not reach the rendezvous {now - self.reform_started:.0f}s "
                                               f"after the re-form began ({self.reform_cause})")
                self.backend.terminate([rec.worker_id], f"late-{rec.worker_id}-{self.round}")
            return
        active = [self.workers[m] for m in self.members if self.workers[m].state is W.ACTIVE]
        if len(active) < 2:
            return
        ahead = max(r.applied_step for r in active)
        for rec in active:
            stuck_for = now - rec.progressed_at
            if rec.applied_step < ahead and stuck_for > rec.allowance(self.spec.progress_timeout_s):
                self._worker_failed(rec, None, f"applied no step for {stuck_for:.0f}s while its peers reached "
                                               f"step {ahead}")
                self.backend.terminate([rec.worker_id], f"stuck-{rec.worker_id}-{self.round}")

    def _liveness_candidates(self, now: float) -> list[WorkerRecord]:
        """Every worker, ten times a second: leases are seconds long, and with thousands of
        workers a scan on every 20 ms tick is a steady share of the master's CPU."""
        if now < self._next_liveness_check:
            return []
        self._next_liveness_check = now + 0.1
        return list(self.workers.values())

    def _apply_plan(self) -> None:
        if self.target_override is not None:
            return
        plan = self.planner.plan(self.snapshot())
        target = min(max(plan.workers, self.spec.min_workers), self.spec.max_workers)
        if target != self.target:
            self._event("scale", f"planner {self.planner.name}: {self.target} -> {target} workers ({plan.reason})")
            self.target = target
            self._persist()

    def _launch_missing(self, now: float) -> None:
        # a scan of every worker: ten times a second is soon enough for a replacement that
        # takes seconds to start (``scale`` resets it so a user's change acts at once)
        if now < self._next_launch_check:
            return
        self._next_launch_check = now + 0.1
        alive = [r for r in self.workers.values() if r.alive]
        missing = min(self.target - len(alive), LAUNCH_BATCH)
        if missing <= 0 or now < self._next_launch_at:
            return
        taken = {r.slot for r in alive}
        specs = []
        for _ in range(missing):
            worker_id = self.next_worker_id
            self.next_worker_id += 1
            slot = self._free_slot(taken)
            taken.add(slot)
            rec = WorkerRecord(worker_id, W.LAUNCHING, launched_at=now, last_seen=now, slot=slot)
            rec.history.append((now, W.LAUNCHING.value))
            self.workers[worker_id] = rec
            specs.append(self._worker_spec(worker_id))
        # journal first: a process the journal does not know would be an orphan after a reload
        self._persist()
        self._launch_seq += 1
        errors = {e.worker_id: e for e in self.backend.launch(specs, f"{self.spec.job_id}-launch-{self._launch_seq}")}
        pids = self.backend.pids()
        for spec in specs:
            rec = self.workers[spec.worker_id]
            error = errors.get(spec.worker_id)
            if error is not None:
                # out of descriptors, processes or disk is the machine's fault, not the script's
                self._worker_failed(rec, None, error.message, counts=not error.retryable)
                continue
            rec.pid, rec.create_time = pids.get(spec.worker_id, (0, None))
            self._event("launch", f"launched worker {spec.worker_id} (pid {rec.pid})", worker=spec.worker_id)
        self._persist()

    def _free_slot(self, taken: set[int]) -> int:
        """The slot a new worker fills: a vacant one that saw start failures first (so its count
        goes on), else the lowest vacant one, else a new one."""
        vacant = [s for s in self.slot_failures if s not in taken]
        if vacant:
            return min(vacant, key=lambda s: (-self.slot_failures[s], s))
        slot = max([*self.slot_failures, *taken], default=-1) + 1
        self.slot_failures[slot] = 0
        return slot

    def _worker_spec(self, worker_id: int) -> WorkerSpec:
        env = {
            "TIDAL_MASTER_URL": f"http://{self.spec.host}:{self.spec.port}",
            "TIDAL_TOKEN": self.spec.token,
            "TIDAL_JOB_ID": self.spec.job_id,
            "TIDAL_WORKER_ID": str(worker_id),
            "PYTHONUNBUFFERED": "1",
            **self.spec.env,
        }
        gpus = self.spec.gpus
        if gpus:
            # one GPU per worker slot (a replacement takes its slot's GPU); when MAX exceeds the
            # GPUs, workers share them and say so, and their groups use gloo (tidal.worker.placement)
            env["CUDA_VISIBLE_DEVICES"] = gpus[self.workers[worker_id].slot % len(gpus)]
            env["TIDAL_OWN_GPU"] = "1" if self.spec.max_workers <= len(gpus) else "0"
        log_path = str(Path(self.spec.job_dir) / "logs" / f"worker-{worker_id}.log")
        return WorkerSpec(worker_id, list(self.spec.argv), env, self.spec.cwd, log_path)

    # ================================================================== rounds
    def _maybe_start_reform(self) -> None:
        if self.round < 0 or self.reforming or (not self.waiting and len(self.members) <= self.target):
            return  # nothing to scale in and nobody to let in (the common case, checked every tick)
        members = [m for m in self.members if self.workers[m].alive]
        newcomers = [w for w in self.waiting if not self.is_member(w)]
        if len(members) > self.target:
            self._start_reform(f"scale-in to {self.target}")
        elif newcomers and len(members) < self.target:
            self._start_reform(f"scale-out to {min(self.target, len(members) + len(newcomers))}")

    def _start_reform(self, cause: str, keep_start: bool = False) -> None:
        """``keep_start``: a failure during a re-form restarts it with its own cause, but the
        round deadline still counts from the re-form's first start."""
        if not self.reforming:
            if not keep_start or not self.reform_started:
                self.reform_started = self.clock()
            self.reforming = True
            self.reform_cause = cause
            log.info("job %s: re-forming round %d: %s", self.spec.job_id, self.round, cause)

    def _try_close_round(self) -> None:
        """Form the next round when everyone it needs is at the rendezvous."""
        if self.state is not JobState.RUNNING or not self.waiting:
            return
        now = self.clock()
        members = [m for m in self.members if self.workers[m].alive]
        if self.round >= 0 and not self.reforming:
            return
        if any(m not in self.waiting for m in members):
            return  # survivors still training; they see ``reform`` in their next report
        newcomers = sorted(w for w in self.waiting if not self.is_member(w))
        if self.round < 0 or not members:
            # The first round (or a restart from nothing) waits for every launched worker,
            # or for MIN of them and a grace period.
            pending = [w for w, r in self.workers.items() if r.state in (W.LAUNCHING, W.JOINED)]
            oldest = min(self.waiting_since.get(w, now) for w in self.waiting)
            enough = len(newcomers) >= min(self.target, self.spec.min_workers)
            if pending and not (enough and now - oldest >= self.spec.start_grace_s):
                return
        candidates = members + newcomers
        if len(candidates) < self.spec.min_workers:
            return
        chosen = self._choose_members(members, newcomers)
        self._close_round(chosen, candidates, now)

    def _choose_members(self, members: list[int], newcomers: list[int]) -> list[int]:
        keep = list(members)
        if len(keep) > self.target:
            # scale-in: stragglers leave first, then the most recent ranks
            keep.sort(key=lambda w: (self.workers[w].straggler, self.workers[w].rank))
            keep = sorted(keep[: self.target], key=lambda w: self.workers[w].rank)
        room = max(0, self.target - len(keep))
        return keep + newcomers[:room]

    def _close_round(self, chosen: list[int], candidates: list[int], now: float) -> None:
        prev_round = self.round
        reqs = {w: self.waiting[w] for w in chosen}
        if self._round_failed_again(prev_round, candidates):
            self._fail_job(f"{self.failed_rounds} rounds in a row failed before a step was applied; "
                           f"the last: {self.round_failure}")
            return
        with_state = [w for w in chosen if reqs[w].applied_step >= 0]
        # the source: the highest applied step; ties go to the lowest previous rank
        if not with_state and self.finalized_step >= 0:
            self._fail_job(
                f"every worker holding the model was lost after step {self.finalized_step}; "
                "there is no survivor to take the state from"
            )
            return
        if with_state:
            source = max(with_state, key=lambda w: (reqs[w].applied_step, -self._old_rank(w)))
        else:
            source = chosen[0]
        resume_step = reqs[source].applied_step
        resume_step = max(resume_step, self.finalized_step) if with_state else self.finalized_step
        sync = (
            prev_round < 0
            or any(not self.is_member(w) for w in chosen)
            or len({reqs[w].applied_step for w in chosen}) > 1
        )
        # finalize what the source applied, discard every other tentative record
        committed = self._commit_records(
            [r for r in reqs[source].records if self.finalized_step < r.step <= reqs[source].applied_step]
        )
        if reqs[source].applied_step > self.finalized_step and with_state:
            self.finalized_step = reqs[source].applied_step
        self.tentative.clear()
        self.progress = MemberProgress(chosen)
        self.shards.release()

        self.round = prev_round + 1
        self.round_start_step = resume_step
        cause = self.reform_cause or ("start" if prev_round < 0 else "re-form")
        self.round_causes[self.round] = cause
        self.round_causes.pop(self.round - MAX_PAUSES, None)  # a pause reported that late is not kept
        self.members = chosen
        self.reforming = False
        self.reform_cause = ""
        self.reform_started = 0.0
        self.assignments = {}
        source_rank = chosen.index(source)
        for rank, w in enumerate(chosen):
            rec = self.workers[w]
            rec.rank = rank
            rec.move(W.ACTIVE, now)
            rec.progressed_at = now
            if self.slot_failures.get(rec.slot):
                self.slot_failures[rec.slot] = 0  # it trains: its slot's start failures are over
            self.assignments[w] = RendezvousResponse(
                status="ready", round=self.round, rank=rank, world_size=len(chosen),
                store_host=self.spec.host, store_port=self.store_port, source_rank=source_rank,
                sync_state=sync, applied_step=resume_step,
            )
        for w in candidates:
            if w not in chosen:
                rec = self.workers[w]
                rec.move(W.LEAVING, now)
                rec.rank = -1
                self.assignments[w] = RendezvousResponse(status="leave", round=self.round)
                self._event("leave", f"worker {w} leaves (scale-in)", worker=w)
        self.waiting.clear()
        self.waiting_since.clear()
        self._assignments_dirty = True  # journaled with this round, not on every commit
        self._write_commits(committed, extra_meta=True)
        self._event(
            "round",
            f"round {self.round}: {len(chosen)} workers {chosen}, resume after step {resume_step} ({cause})",
        )
        self._on_change()

    def _round_failed_again(self, prev_round: int, candidates: list[int]) -> bool:
        """Count rounds that ended in a failure (a member reports a broken collective or a group
        that did not form) without any step applied; True once ``round_failure_limit`` in a row."""
        back = [self.waiting[w] for w in candidates]
        failures = [r.failure for r in back if r.failure and r.after_round == prev_round]
        top = max((r.applied_step for r in back), default=-1)
        if prev_round >= 0 and failures and top <= self.round_start_step:
            self.failed_rounds += 1
            self.round_failure = failures[0]
        else:
            self.failed_rounds = 0
        return self.failed_rounds >= self.spec.round_failure_limit

    def _old_rank(self, worker_id: int) -> int:
        return self.workers[worker_id].rank if self.is_member(worker_id) else 1 << 30

    # ================================================================== commits
    def _finalize_reported(self) -> None:
        # every live member counts, also one already waiting at the rendezvous: a step is final
        # only when no survivor can be without it (members that failed or exited are removed)
        upto = self.progress.minimum()
        if upto is None or upto <= self.finalized_step:
            return
        records = [r for step in sorted(self.tentative) if step <= upto for r in self.tentative.pop(step).values()]
        committed = self._commit_records(records)
        self.finalized_step = upto
        self._write_commits(committed)

    def _commit_records(self, records: list[StepRecord]) -> list[CommittedRange]:
        out = []
        for r in sorted(records, key=attrgetter("step", "worker")):
            if r.end <= r.start:
                continue
            try:
                if self.shards.commit(r.epoch, r.start, r.end):
                    out.append(CommittedRange(r.epoch, r.start, r.end, r.step, r.worker))
            except TidalError as exc:  # a protocol bug must show, and must not stop the master
                self._event("error", f"cannot commit step {r.step} of worker {r.worker}: {exc}")
                log.error("job %s: cannot commit %s: %s", self.spec.job_id, r, exc)
        return out

    def _write_commits(self, committed: list[CommittedRange], extra_meta: bool = False) -> None:
        with self.journal.transaction():
            self.journal.save_shards(self.shards.dirty())
            self.journal.append_ledger(committed)
            self._save_meta()
            if extra_meta:
                for rec in self.workers.values():
                    self.journal.save_worker(rec.worker_id, rec.to_row())
        if self._ledger and committed:
            try:
                self._ledger.write("".join(_ledger_line(c) for c in committed))
                self._ledger.flush()
            except OSError as exc:  # the journal has the rows: the ledger is rewritten from it on reload
                raise JournalUnavailableError(f"cannot write ledger {self.spec.ledger_path}: {exc.strerror}") from exc

    # ================================================================== failures
    def _process_exited(self, rec: WorkerRecord, code: int | None) -> None:
        rec.exit_code = code if code is not None else rec.exit_code
        if not rec.alive and rec.state is not W.LEAVING:
            self._persist_worker(rec)
            return
        now = self.clock()
        if code == 0 or rec.state is W.LEAVING or (code is None and rec.finished):
            was_member = self.is_member(rec.worker_id) and rec.state is W.ACTIVE
            rec.move(W.SUCCEEDED, now)
            self.waiting.pop(rec.worker_id, None)
            self._event("exit", f"worker {rec.worker_id} exited (code {code})", worker=rec.worker_id)
            if was_member and self.state is JobState.RUNNING:
                # the script ended its training loop on its own: the job is finishing
                self.state = JobState.FINISHING
                self._event("job", f"worker {rec.worker_id} finished its script")
            self._persist_worker(rec)
            return
        self._worker_failed(rec, code, f"exited with code {code}" if code is not None else "process gone")

    def _worker_failed(self, rec: WorkerRecord, code: int | None, why: str, counts: bool = True) -> None:
        """``counts``: the failure counts towards ``max_restarts`` and the crash-loop rule (not
        when the machine, not the script, was at fault: a launch refused for lack of resources)."""
        now = self.clock()
        if not rec.alive:
            return
        was_member = self.is_member(rec.worker_id) and rec.state in (W.ACTIVE, W.WAITING)
        rec.move(W.FAILED, now)
        rec.exit_code = code if code is not None else rec.exit_code
        self.waiting.pop(rec.worker_id, None)
        self.waiting_since.pop(rec.worker_id, None)
        self._event("failure", f"worker {rec.worker_id} failed: {why}", worker=rec.worker_id)
        log.warning("job %s: worker %d failed: %s", self.spec.job_id, rec.worker_id, why)
        if self.state is JobState.FINISHING and rec.ever_active:
            # a worker that trained and then failed while finishing (a full checkpoint dir, a
            # crash in the final evaluation): its script did not succeed, so neither did the job
            tail = self._log_tail(rec.worker_id)
            self._fail_job(f"worker {rec.worker_id} {why} while the job was finishing{': ' + tail if tail else ''}")
            return
        if self.state is not JobState.RUNNING:
            self._persist_worker(rec)
            return
        failures = 0
        if counts:
            self.restarts += 1
            if not rec.ever_active:
                failures = self.slot_failures[rec.slot] = self.slot_failures.get(rec.slot, 0) + 1
                self._next_launch_at = now + min(5.0, 0.5 * 2 ** failures)
        else:
            self._next_launch_at = now + 1.0
        if was_member:
            self.reforming = False  # restart the reform with the cause that matters
            self._start_reform(f"worker {rec.worker_id} failed", keep_start=True)
        if failures >= self.spec.crash_loop_limit:
            tail = self._log_tail(rec.worker_id)
            self._fail_job(
                f"worker script crashed {failures} times in a row before training "
                f"(last exit code {rec.exit_code}){': ' + tail if tail else ''}"
            )
        elif self.restarts > self.spec.max_restarts:
            self._fail_job(f"more than {self.spec.max_restarts} worker failures")
        self._persist()

    def interrupt(self) -> None:
        """Ctrl-C or SIGTERM of the master: fail the job and stop its workers (they run in
        sessions of their own), even when the journal cannot record it any more."""
        try:
            self._fail_job("interrupted")
        except JournalUnavailableError as exc:
            log.error("job %s: interrupted; the journal did not take it: %s", self.spec.job_id, exc)
            self.backend.terminate(self._alive_ids(), "interrupted")
        self.paused = None  # the reconcile loop must see the exits now, not probe the journal

    def _fail_job(self, message: str) -> None:
        self.error = message
        self._set_state(JobState.FAILED)
        alive = self._alive_ids()
        if alive:
            self.backend.terminate(alive, "job-failed")

    def _set_state(self, state: JobState) -> None:
        if self.state is state:
            return
        self.state = state
        self._event("job", f"job {state.value}" + (f": {self.error}" if self.error else ""))
        self._persist()
        self._on_change()

    def _log_tail(self, worker_id: int) -> str:
        path = Path(self.spec.job_dir) / "logs" / f"worker-{worker_id}.log"
        try:
            lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    # ================================================================== stragglers
    def _detect_stragglers(self) -> None:
        """DLRover-RM 5.1: a worker much slower than its peers gets smaller shards and batches."""
        active = [self.workers[m] for m in self.members if self.workers[m].state is W.ACTIVE]
        if len(active) < 2:
            return
        speeds = [r.compute_s_per_sample for r in active if r.compute_s_per_sample > 0]
        if len(speeds) < 2:
            return
        # the peers' median; with three or more workers the median of all is close enough and
        # keeps this O(n log n) for thousands of workers
        median = statistics.median(speeds)
        now = self.clock()
        for rec in active:
            if rec.compute_s_per_sample <= 0:
                continue
            if len(speeds) > 2:
                peer = median
            else:
                peer = next(r.compute_s_per_sample for r in active if r is not rec and r.compute_s_per_sample > 0)
            ratio = rec.compute_s_per_sample / peer
            if ratio <= self.spec.straggler_factor:
                rec.slow_since = None
            elif rec.slow_since is None:
                rec.slow_since = now
            # only a lasting slowness counts: one noisy report on a shared core is no straggler
            slow = rec.slow_since is not None and now - rec.slow_since >= self.spec.straggler_window_s
            if not rec.straggler and slow:
                rec.straggler = True
                rec.size_factor = max(0.25, min(1.0, 1.0 / ratio))
                self._event(
                    "straggler",
                    f"worker {rec.worker_id} is a straggler ({ratio:.1f}x slower per sample than its peers); "
                    f"shards and batches scaled to {rec.size_factor:.2f}",
                    worker=rec.worker_id,
                )
            elif rec.straggler and ratio < 1.2:
                rec.straggler = False
                rec.size_factor = 1.0
                self._event("straggler", f"worker {rec.worker_id} caught up", worker=rec.worker_id)

    # ================================================================== views
    def snapshot(self) -> JobSnapshot:
        active = [self.workers[m] for m in self.members if self.workers[m].state is W.ACTIVE]
        return JobSnapshot(
            job_id=self.spec.job_id, min_workers=self.spec.min_workers, max_workers=self.spec.max_workers,
            current_workers=len(active), samples_per_s=sum(r.samples_per_s for r in active),
            applied_step=self.finalized_step, stragglers=sum(r.straggler for r in active),
        )

    def status(self) -> StatusResponse:
        return StatusResponse(
            job_id=self.spec.job_id, state=self.state, target_workers=self.target,
            min_workers=self.spec.min_workers, max_workers=self.spec.max_workers, round=self.round,
            reforming=self.reforming, finalized_step=self.finalized_step,
            workers=[
                WorkerInfo(
                    worker_id=r.worker_id, pid=r.pid, state=r.state, rank=r.rank if r.state is W.ACTIVE else -1,
                    applied_step=r.applied_step, samples_per_s=round(r.samples_per_s, 1),
                    straggler=r.straggler, exit_code=r.exit_code,
                )
                for r in sorted(self.workers.values(), key=lambda r: r.worker_id)
            ],
            shards=[ShardCounts(epoch=e, todo=t, doing=d, done=dn, samples_done=sd, samples_total=st)
                    for e, t, d, dn, sd, st in self.shards.counts()],
            events=list(self.events)[-50:],
            metrics=dict(self.metrics),
            error=self.error,
            paused=self.paused,
        )

    def _record_pause(self, round_: int, seconds: float) -> None:
        ev = self.pause_events.get(round_)
        cause = self.round_causes.get(round_, "re-form")
        if ev is None:
            self.event_seq += 1
            ev = Event(seq=self.event_seq, time=self.clock(), kind="pause", message=f"training paused {seconds:.3f}s ({cause})",
                       seconds=round(seconds, 4), cause=cause)
            self.pause_events[round_] = ev
            self.events.append(ev)
            while len(self.pause_events) > MAX_PAUSES:
                self.pause_events.pop(min(self.pause_events))
        elif ev.seconds is not None and seconds > ev.seconds:
            ev.seconds = round(seconds, 4)
            ev.message = f"training paused {seconds:.3f}s ({cause})"

    def pauses(self) -> list[Event]:
        return [self.pause_events[r] for r in sorted(self.pause_events)]

    def _event(self, kind: str, message: str, worker: int | None = None) -> None:
        self.event_seq += 1
        self.events.append(Event(seq=self.event_seq, time=self.clock(), kind=kind, worker=worker, message=message))
        log.info("job %s: %s", self.spec.job_id, message)

    # ================================================================== helpers
    def _worker(self, worker_id: int) -> WorkerRecord:
        rec = self.workers.get(worker_id)
        if rec is None:
            raise UnknownWorkerError(f"unknown worker {worker_id}")
        if rec.state is W.FAILED:
            raise WorkerGoneError(f"worker {worker_id} was declared failed; it must exit")
        if rec.state is W.SUCCEEDED:
            raise WorkerGoneError(f"worker {worker_id} has exited")
        return rec

    def _alive_ids(self) -> list[int]:
        return [w for w, r in self.workers.items() if r.state in ALIVE or r.state is W.LEAVING]

    def _save_meta(self) -> None:
        cfg = self.shards.config
        if self._assignments_dirty:
            self.journal.put_meta("assignments", {str(k): v.model_dump() for k, v in self.assignments.items()})
            self._assignments_dirty = False
        self.journal.put_meta("state", {
            "job_state": self.state.value, "round": self.round, "members": self.members,
            "finalized_step": self.finalized_step, "target": self.target,
            "target_override": self.target_override, "next_worker_id": self.next_worker_id,
            "restarts": self.restarts, "error": self.error,
            "slot_failures": {str(k): v for k, v in self.slot_failures.items()},
            "dataset": None if cfg is None else {
                "size": cfg.size, "batch_size": cfg.batch_size, "batches_per_shard": cfg.batches_per_shard,
                "shuffle": cfg.shuffle, "seed": cfg.seed, "epochs": cfg.epochs,
            },
        })

    def _persist(self) -> None:
        with self.journal.transaction():
            self._save_meta()
            for rec in self.workers.values():
                self.journal.save_worker(rec.worker_id, rec.to_row())

    def _persist_worker(self, rec: WorkerRecord) -> None:
        self.journal.save_worker(rec.worker_id, rec.to_row())


def _samples_left(left: dict[int, int]) -> str:
    parts = ", ".join(f"epoch {e}: {n}" for e, n in sorted(left.items())[:4])
    return f"{sum(left.values())} samples were never trained ({parts}{', ...' if len(left) > 4 else ''})"


def _ledger_line(c: CommittedRange) -> str:
    return f'{{"epoch": {c.epoch}, "start": {c.start}, "end": {c.end}, "step": {c.step}, "worker": {c.worker}}}\n'


def new_token() -> str:
    return secrets.token_urlsafe(24)
