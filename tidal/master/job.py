"""The job master: request handlers and the one executor of its decisions.

Everything here runs on one thread (the master's event loop), reads time only through the
injected ``clock`` and does I/O only through the injected journal and backend, so tests drive
it directly with a fake clock and the HTTP service is a thin layer over it.

State has one owner each (STYLE.md 14):

* ``RoundState`` (``tidal.master.rounds``): the round, its members, the rendezvous;
* ``Commits`` (``tidal.master.commits``): tentative and final steps, the ledger;
* ``Fleet`` (``tidal.master.fleet``): the processes, their records, launches and exits;
* ``EventLog`` (``tidal.master.events``): what the user sees (events, pauses, metrics);
* ``ShardManager`` (``tidal.master.shards``): the data.

The decisions (when a round forms and with whom, who is dead, hung or a straggler) are pure
functions in ``rounds`` and ``liveness`` that return actions (``tidal.master.actions``);
``JobMaster._execute`` applies them. The handlers below validate a request, change the owner's
state and journal it.

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
* Liveness by progress (``tidal.master.liveness``) and the crash-loop rule per worker slot and
  per round (``tidal.master.rounds.failed_again``) end jobs that would otherwise never finish.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import secrets
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from tidal.api import (
    DATA_ERROR_EXIT,
    PS_OUT_OF_MEMORY_EXIT,
    DataQueueStatus,
    DatasetRequest,
    DataWorkerObservation,
    DataWorkerReport,
    Event,
    FinishRequest,
    JobObservation,
    JobState,
    JoinRequest,
    JoinResponse,
    LeaseRequest,
    LeaseResponse,
    PauseObservation,
    RendezvousRequest,
    RendezvousResponse,
    ReportRequest,
    ReportResponse,
    ResourcePlan,
    RestoreFailure,
    ServerReport,
    ShardCounts,
    StatusResponse,
    StreamLagStatus,
    StreamPartitionStatus,
    TimelineResponse,
    WorkerInfo,
    WorkerState,
)
from tidal.api.streams import unpack_id
from tidal.backends.api import Backend
from tidal.brain.api import Planner
from tidal.brain.goldminer import DataWorkerTuner
from tidal.brain.oom import servers_for_memory
from tidal.master import liveness, rounds
from tidal.master.actions import Action, FailJob, FailWorker, FormRound, SetStraggler, SlowSince, StartReform
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
from tidal.master.checkpoints import Checkpoint, CheckpointBook, found_on_disk
from tidal.master.commits import Commits
from tidal.master.dataworkers import START_FAILURES, DataWorkers
from tidal.master.events import EventLog
from tidal.master.fleet import Fleet
from tidal.master.journal import Journal
from tidal.master.membership import WorkerRecord
from tidal.master.planning import (
    Planning,
    available_cpus,
    partition_lag_s,
    stream_busy,
    stream_lag_s,
    worker_lag_s,
    worker_observation,
)
from tidal.master.progress import MemberProgress
from tidal.master.roles import LAUNCHING, RETIRING
from tidal.master.rounds import RoundState
from tidal.master.servers import Servers
from tidal.master.shards import DatasetConfig, ShardManager
from tidal.master.streams import StreamTable

log = logging.getLogger(__name__)
W = WorkerState
F = TypeVar("F", bound=Callable[..., Any])

JOURNAL_PROBE_S = 0.5  # how often a paused master tries its journal again
CHECK_S = 0.5  # how often progress and stragglers are judged
LIVENESS_S = 0.1  # heartbeat leases are seconds long: a scan of every worker per 20 ms tick is waste
TIMELINE_S = 1.0  # one timeline point a second
DATA_WINDOW = 6  # points (one a second) the data queue's rates are measured over
MEMORY_CHECK_S = 1.0  # how often the servers' memory is predicted (--ps-memory; they report every second)
HOT_CHECK_S = 5.0  # the window of the hot-PS planner (tidal.brain.hotps)
MEMORY_SAMPLES = 30  # (samples consumed, bytes held) points the prediction fits
PLAN_WAIT_S = 0.2  # how long a tick waits for the planner before going on (its answer comes at a later tick)
MAX_TIMELINE_PAUSES = 200  # the newest pauses the dashboard is sent


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
        self.clock = clock
        self.store_port = store_port
        self._on_change = on_change  # wakes long-polling rendezvous requests
        # what the job shows its user: kept when the state is reloaded from the journal
        self.log = EventLog(spec.job_id, clock)
        self.paused: str | None = None  # why the job stands still (the journal cannot be written)
        self.paused_since = 0.0
        self._next_journal_probe = 0.0
        # the planner's measurements, decisions and timeline (journaled with each decision)
        self.planning = Planning(planner, clock(), cpus=available_cpus(), lag_slo_s=spec.lag_slo_s)
        self.planning.seed_history(spec.traffic_history, spec.traffic_history_interval_s)
        self._planner_problem: str | None = None  # the last error of the planner, logged once
        # the planner runs in a thread of its own: a forecaster's fit (kale on a week of history)
        # takes seconds, and the master's loop must answer heartbeats meanwhile
        self._planner_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-planner")
        self._planning: tuple[JobObservation, Future[ResourcePlan]] | None = None
        self._next_timeline = 0.0
        self._next_memory_check = 0.0
        self._next_hot_check = 0.0
        # (when, samples consumed, bytes the servers hold): the out-of-memory prediction's points
        self._memory_samples: list[tuple[float, float, float]] = []
        self._oom_warned = False
        self._init_runtime()

    def _init_runtime(self) -> None:
        """Everything rebuilt from the journal by ``resume`` (also when a paused master reloads)."""
        spec = self.spec
        self.state = JobState.RUNNING
        self.incarnation = secrets.token_hex(4)  # this master process, as workers see it
        self.error: str | None = None
        self.target = spec.initial_workers or spec.max_workers
        self.target_override: int | None = spec.initial_workers
        self.checkpoints = CheckpointBook()  # the flash checkpoints workers reported (tidal.master.checkpoints)
        self._restore_choice: Checkpoint | None = None  # the one the round being formed resumes from
        self.checkpoint_problem: str | None = None
        self.shards = ShardManager()
        self.streams = StreamTable() if spec.stream_url else None
        self.stream_stop: str | None = None  # why a stream job ends (drained, stopped): workers finish
        self._stream_quiet_since: float | None = None  # drained, with no commit since
        self._stream_positions: dict[int, int] = {}
        self.rounds = RoundState()
        self.commits = Commits(self.journal, self.shards, self.log, spec.ledger_path, self.streams)
        self.fleet = Fleet(spec, self.backend)
        self.servers = Servers(spec, self.backend)  # parameter servers (--ps)
        self.data = DataWorkers(spec, self.backend)  # data workers (--data-workers)
        # GoldMiner 3.4.1's tuner decides their number for --data-workers MIN:MAX (MIN < MAX) until
        # the user sets one (``tidal scale --data-workers``: ``data_override``)
        self.data_tuner = DataWorkerTuner() if spec.data_workers >= 0 and spec.data_range[0] < spec.data_range[1] \
            else None
        self.data_override: int | None = None
        self.trainer_threads = 0  # the tuner's torch threads per trainer (0: as each one starts)
        self.data_decisions: list[str] = []
        self._data_settled_logged = False
        # the trainers' data-queue counters summed, one point a second: (t, received, built by the
        # trainers, taken, seconds waited), for the rates of ``DataQueueStatus``
        self._data_window: deque[tuple[float, float, float, float, float]] = deque(maxlen=DATA_WINDOW)
        self._next_plan_at = 0.0
        self._next_liveness_check = 0.0
        self._next_data_point = 0.0
        self._next_check = 0.0

    # ------------------------------------------------------------------ views of the owners' state
    @property
    def planner(self) -> Planner:
        return self.planning.planner

    @property
    def planner_decisions(self) -> int:
        """Target changes the planner made (a metric; journaled, so it survives failover)."""
        return self.planning.total

    @property
    def workers(self) -> dict[int, WorkerRecord]:
        return self.fleet.workers

    @property
    def round(self) -> int:
        return self.rounds.round

    @property
    def members(self) -> list[int]:
        return self.rounds.members

    def is_member(self, worker_id: int) -> bool:
        return self.rounds.is_member(worker_id)

    @property
    def reforming(self) -> bool:
        return self.rounds.reforming

    @property
    def checkpoint_step(self) -> int:
        """The newest flash checkpoint a worker reported (-1: none)."""
        return self.checkpoints.newest_step

    @property
    def takes_checkpoints(self) -> bool:
        return bool(self.spec.env.get("TIDAL_CHECKPOINT_EVERY"))

    @property
    def finalized_step(self) -> int:
        return self.commits.finalized_step

    @property
    def progress(self) -> MemberProgress:
        return self.commits.progress

    @property
    def restarts(self) -> int:
        return self.fleet.restarts

    @property
    def events(self) -> Sequence[Event]:
        return self.log.events

    @property
    def metrics(self) -> dict[str, float]:
        return self.log.metrics

    @property
    def pause_events(self) -> dict[int, Event]:
        return self.log.pause_events

    def pauses(self) -> list[Event]:
        return self.log.pauses()

    @property
    def done(self) -> bool:
        return (self.state in (JobState.SUCCEEDED, JobState.FAILED) and not self.fleet.alive_ids()
                and not self.servers.alive())

    # ================================================================== lifecycle
    def start(self) -> None:
        with self.journal.transaction():
            self.journal.put_meta("spec", self.spec.to_json())
            self._save_meta()
        self.commits.open_ledger()
        self.log.add("job", f"job {self.spec.job_id} started: workers {self.spec.min_workers}:{self.spec.max_workers}")

    def resume(self, why: str = "master resumed from journal") -> None:
        """Rebuild from the journal and adopt the workers that are still running."""
        j = self.journal
        meta = j.get_meta("state", {})
        self.state = JobState(meta.get("job_state", "running"))
        self.error = meta.get("error")
        self.target = meta.get("target", self.target)
        self.target_override = meta.get("target_override")
        self.data_override = meta.get("data_override")
        self.checkpoints = CheckpointBook.from_meta(meta.get("checkpoints"))
        self._find_checkpoints()
        rs = self.rounds
        rs.round = meta.get("round", -1)
        rs.members = list(meta.get("members", []))
        rs.assignments = {int(k): RendezvousResponse(**v) for k, v in (j.get_meta("assignments") or {}).items()}
        self.commits.finalized_step = meta.get("finalized_step", -1)
        dataset = meta.get("dataset")
        if self.streams is not None:
            self.streams.restore(j.load_ledger())
            self.streams.see(meta.get("stream_partitions", []))
            self.streams.records = int(meta.get("stream_records", 0))
            self.stream_stop = meta.get("stream_stop")
        else:
            self.shards.restore(DatasetConfig(**dataset) if dataset else None, j.load_shards(), j.load_ledger())
        self.fleet.restore(meta, j.load_workers(), self.clock())
        self.servers.restore(meta, f"{self.spec.job_id}-ps-adopt-{self.clock():.6f}")
        self.data.restore(meta, f"{self.spec.job_id}-data-adopt-{self.clock():.6f}", self.clock())
        # Every member must report to this master before a step is final again. One found dead
        # holds finalization back, as in a running master, until the next round settles its steps:
        # its records of the last steps are only in the survivors' hands, and finalizing those
        # steps on the survivors' reports alone would drop them (the chaos audit found it).
        self.commits.progress = MemberProgress([m for m in rs.members if m in self.workers
                                                and self.workers[m].state is not W.SUCCEEDED])
        if rs.round >= 0:
            for a in rs.assignments.values():
                if a.status == "ready":
                    a.store_port = self.store_port
        self.commits.open_ledger(rewrite=True)
        self.planning.restore(j.get_meta("planner"))
        self.planning.lag.restore(j.get_meta("stream_lag"))
        self.log.add("job", f"{why} at round {rs.round}, step {self.finalized_step}")
        self._persist()

    def close(self) -> None:
        self.commits.close()
        self._planner_pool.shutdown(wait=False, cancel_futures=True)

    # ================================================================== journal outages
    def _pause(self, why: str) -> None:
        if self.paused is not None:
            return
        self.paused = why
        self.paused_since = self.clock()
        self._next_journal_probe = self.paused_since + JOURNAL_PROBE_S
        self.log.add("paused", f"job paused: {why}; workers wait and retry, nothing is dropped")
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
            # exits the fleet saw and did not handle are kept for the reloaded fleet
            exits = self.fleet.pending_exits()
            self._init_runtime()
            self.fleet.pending_exits().extend(exits)
            self.paused = None
            self.resume(f"journal writable again after {paused_for:.1f}s; state reloaded from the journal")
        except JournalUnavailableError as exc:
            self.paused = self.paused or str(exc)
            if paused_for > self.spec.journal_patience_s and self.state is not JobState.FAILED:
                # nothing more can be journaled: fail in memory only (the journal still holds every
                # committed step, so ``tidal master --resume`` can carry on once there is room)
                self.error = f"the journal could not be written for {paused_for:.0f}s: {exc}"
                self.state = JobState.FAILED
                self.log.add("job", f"job failed: {self.error}")
            if self.state is JobState.FAILED:  # a live job keeps process exits for the reload
                self.fleet.kill(self.fleet.alive_ids(), "journal-lost")
                self.fleet.poll()
                exits = self.fleet.pending_exits()
                while exits:
                    worker_id, _ = exits.popleft()
                    rec = self.workers.get(worker_id)
                    if rec is not None and (rec.alive or rec.state is W.LEAVING):
                        rec.move(W.FAILED, now)

    # ================================================================== requests
    @journaled
    def join(self, req: JoinRequest) -> JoinResponse:
        rec = self._worker(req.worker_id)
        now = self.clock()
        rec.pid = req.pid or rec.pid
        rec.last_seen = now
        if rec.state is W.LAUNCHING:
            rec.move(W.JOINED, now)
            self.log.add("join", f"worker {rec.worker_id} joined (pid {rec.pid})", worker=rec.worker_id)
            self._persist_worker(rec)
        return JoinResponse(
            job_id=self.spec.job_id, round=self.round,
            heartbeat_interval_s=self.spec.heartbeat_interval_s,
            collective_timeout_s=self.spec.collective_timeout_s, incarnation=self.incarnation,
        )

    @journaled
    def rendezvous(self, req: RendezvousRequest) -> RendezvousResponse:
        rec = self._worker(req.worker_id)
        now = self.clock()
        rec.last_seen = now
        rs = self.rounds
        if self.state is not JobState.RUNNING:
            # it exits 0 on this answer: a process the master cannot reap (adopted after a
            # failover) is then known to have ended cleanly, as one that called finish
            rec.finished = True
            return RendezvousResponse(status="finished")
        if req.after_round > rs.round:
            raise StaleRoundMasterError(f"round {req.after_round} is ahead of the master's round {rs.round}")
        assigned = rs.assignments.get(req.worker_id)
        if assigned is not None and req.after_round < rs.round and assigned.round == rs.round:
            return assigned  # a re-poll for an assignment already made
        if assigned is not None and assigned.status == "leave":
            return assigned
        if rec.state is W.LEAVING:
            return RendezvousResponse(status="leave")
        if rec.state is W.LAUNCHING:
            raise StaleRoundMasterError(f"worker {req.worker_id} has not joined; join first")
        if rs.is_member(req.worker_id) and req.after_round == rs.round and not rs.reforming:
            self._start_reform(f"worker {req.worker_id} left the collective")
        self._check_records(req)
        if self.streams is not None:
            new, gone = self.streams.see(req.stream_partitions)
            if new or gone:
                self.log.add("stream", f"partitions {sorted(self.streams.partitions)} (worker {req.worker_id} sees "
                                       f"new: {new}, gone: {gone}); assigned at the next round")
                if rs.round >= 0 and not rs.reforming:
                    self._start_reform("stream partitions changed")
        if req.restore_failed is not None:
            self._restore_failed(req.restore_failed)
            if self.state is not JobState.RUNNING:
                return RendezvousResponse(status="finished")
        if rec.state in (W.JOINED, W.ACTIVE):
            rec.move(W.WAITING, now)
        prior = rs.waiting.get(req.worker_id)
        rs.waiting[req.worker_id] = req
        rs.waiting_since.setdefault(req.worker_id, now)
        rec.applied_step = max(rec.applied_step, req.applied_step)
        if prior is None or (prior.after_round, prior.applied_step) != (req.after_round, req.applied_step):
            # A long-poll's re-poll changes nothing the round depends on: the tick (every 20 ms)
            # re-checks time-based conditions, and 2,000 re-polls a second must not each scan
            # every worker.
            self._try_close_round()
        assigned = rs.assignments.get(req.worker_id)
        if assigned is not None and assigned.round == rs.round and req.worker_id not in rs.waiting:
            return assigned
        if assigned is not None and assigned.status == "leave":
            return assigned
        return RendezvousResponse(status="waiting", round=rs.round)

    @journaled
    def server_report(self, req: ServerReport) -> None:
        """A parameter server's report; its first registers its address (tidal.master.servers).

        Raises:
            WorkerGoneError: the job is over, or the server is not one of the job's (it exits).
        """
        if self.state in (JobState.SUCCEEDED, JobState.FAILED):
            raise WorkerGoneError(f"the job has {self.state.value}")
        if req.server_id not in self.servers.records:
            raise WorkerGoneError(f"no parameter server {req.server_id} in this job")
        registered = self.servers.report(req, self.clock())
        if registered is not None:
            self.log.add("ps", f"parameter server {req.server_id} listens at {req.address} (pid {req.pid})")
            self._persist()
            self._try_close_round()

    def _prevent_ps_oom(self, now: float) -> None:
        """DLRover-RM 5.3, live: from the bytes the servers hold against the samples consumed,
        predict whether they pass ``--ps-memory`` each before the job ends (a stream job: within
        ``--ps-oom-horizon`` at the rate records are committed), and if so add servers now (the
        shards then spread over more of them: tidal.brain.oom.servers_for_memory)."""
        servers, cfg = self.servers, self.shards.config
        held = servers.bytes_held()
        if held is None or (self.streams is None and (cfg is None or cfg.epochs is None)):
            return
        progress = self.committed_samples()
        samples = self._memory_samples
        if progress > (samples[-1][1] if samples else 0) and held > 0:
            samples.append((now, float(progress), float(held)))
            del samples[:-MEMORY_SAMPLES]
        busy = servers.move is not None or servers.target != len(servers.in_map())
        if len(samples) < 3 or busy or not self.spec.ps_oom_prevention:
            return
        history = [(p, h) for _, p, h in samples]
        if self.streams is None:
            assert cfg is not None and cfg.epochs is not None
            total, when = float(cfg.size * cfg.epochs), "at the end of the job"
        else:  # a stream never ends: the records committed within the horizon at the recent rate
            span = samples[-1][0] - samples[0][0]
            rate = (history[-1][0] - history[0][0]) / span if span > 0 else 0.0
            horizon = self.spec.ps_oom_horizon_s
            total, when = history[-1][0] + rate * horizon, f"within {horizon:g} s at {rate:,.0f} records/s"
        high = self.spec.ps_range[1]
        plan = servers_for_memory(history, total, self.spec.ps_memory, servers.target, high)
        mib = 2.0**20
        predicted = (f"the servers' tables are predicted to hold {plan.forecast.predicted_gb / mib:.1f} MiB {when}, "
                     f"over {servers.target} x {self.spec.ps_memory / mib:.1f} MiB (--ps-memory)")
        if plan.servers > servers.target:
            self.log.add("ps", f"out-of-memory prevention: {predicted}: {servers.target} -> {plan.servers} "
                               "parameter servers" + ("" if plan.enough else " (the most --ps allows; not enough)"))
            servers.target = plan.servers
            self._persist()
        elif not plan.enough and not self._oom_warned:
            self._oom_warned = True
            self.log.add("error", f"out-of-memory prevention: {predicted}, and --ps allows no more than {high}")

    def _balance_hot_servers(self, now: float) -> None:
        """DLRover 4.2's adjust stage for a hot server, live: from the servers' busy shares and
        rows pulled per virtual shard over the last HOT_CHECK_S, the planner
        (tidal.brain.hotps) picks shards to move off a server much busier than its peers; they
        move at the next re-form like any change of the map."""
        if not self.rounds.members:
            return
        plan = self.servers.hot_plan(now, HOT_CHECK_S)
        if plan is None:
            return
        self.servers.planned_map = plan.new_map
        self.log.add("ps", plan.describe())

    def _launch_servers(self) -> None:
        new = self.servers.launch(self._persist)
        if new:
            self.log.add("launch", f"launched parameter servers {new} ({self.spec.ps_shards} virtual shards)")
            self._persist()

    def _reconcile_data(self, now: float) -> None:
        launched, retired = self.data.reconcile(now, self._persist)
        self.data.refresh(now)
        if launched:
            self.log.add("launch", f"launched data workers {launched}")
        if retired:
            self.log.add("data", f"retired data workers {retired}: off the trainers' lists, stopped in a moment")
        if launched or retired:
            self._persist()
        if now >= self._next_data_point:
            self._next_data_point = now + TIMELINE_S
            counts = [r.data_counts for r in self.workers.values() if r.data_counts]
            received, built, taken, waited = (float(sum(c[k] for c in counts))
                                              for k in ("received", "built_here", "taken", "wait_s"))
            self._data_window.append((now, received, built, taken, waited))
            if self.data_tuner is not None and self.data_override is None:
                self._tune_data(now)

    def _tune_data(self, now: float) -> None:
        """GoldMiner 3.4.1's job-level tuner (tidal.brain.goldminer.DataWorkerTuner), once a second."""
        assert self.data_tuner is not None
        active = self._active()
        data = self._data_observation(active)
        if data is None or not active:
            return
        obs = JobObservation(job_id=self.spec.job_id, min_workers=self.spec.min_workers,
                             max_workers=self.spec.max_workers, current_workers=len(active),
                             target_workers=self.target, now_s=now - self.planning.started_at,
                             samples_per_s=data.samples_per_s, committed_samples=self.committed_samples(), data=data)
        plan = self.data_tuner.plan(obs)
        low, high = self.spec.data_range
        wanted = min(max(plan.data_workers, low), high)
        if plan.worker_cpu and plan.worker_cpu != (self.trainer_threads or data.trainer_threads):
            self.log.add("data", f"data-worker tuner: trainers' CPUs {self.trainer_threads or data.trainer_threads} -> "
                                 f"{plan.worker_cpu}: {plan.reason}")
            self.data_decisions.append(f"{now - self.planning.started_at:.1f}s: trainers' CPUs -> {plan.worker_cpu}: "
                                       f"{plan.reason}")
            self.trainer_threads = plan.worker_cpu
        if wanted != self.data.target:
            self.log.add("data", f"data-worker tuner: {self.data.target} -> {wanted}: {plan.reason}")
            self.data_decisions.append(f"{now - self.planning.started_at:.1f}s: {self.data.target} -> {wanted}: "
                                       f"{plan.reason}")
            self.data.target = wanted
            self._data_settled_logged = self.data_tuner.done
            self._persist()
        elif self.data_tuner.done and not self._data_settled_logged:
            self._data_settled_logged = True
            self.log.add("data", f"data-worker tuner: {plan.reason}")
            self.data_decisions.append(f"{now - self.planning.started_at:.1f}s: {plan.reason}")

    def data_queue(self) -> DataQueueStatus | None:
        """The trainers' data queues over the last ``DATA_WINDOW`` seconds (None: no data workers)."""
        if self.spec.data_workers < 0:
            return None
        active = [r.data_counts for r in self._active() if r.data_counts]
        queued = int(sum(c["queued"] for c in active))
        redispatched = int(sum(r.data_counts.get("redispatched", 0) for r in self.workers.values()))
        w = self._data_window
        if len(w) < 2 or w[-1][0] <= w[0][0]:
            return DataQueueStatus(queued=queued, redispatched=redispatched)
        span = w[-1][0] - w[0][0]
        (_, r0, b0, t0, s0), (_, r1, b1, t1, s1) = w[0], w[-1]
        trainers = max(1, len(active))
        return DataQueueStatus(queued=queued, enqueue_per_s=round((r1 - r0) / span, 2),
                               dequeue_per_s=round((t1 - t0) / span, 2),
                               built_by_trainers_per_s=round((b1 - b0) / span, 2),
                               wait_share=round(min(1.0, (s1 - s0) / span / trainers), 4), redispatched=redispatched)

    def _handle_data_exits(self) -> None:
        """A data worker that ends while the job runs is replaced (it holds nothing: the trainers
        re-dispatch what it was building); one that was retired is just gone."""
        reports = self.fleet.data_reports
        while reports:
            data_id, code, why = reports[0]
            prior = self.data.records.get(data_id)
            retiring = prior is not None and prior.state == RETIRING
            never_served = prior is not None and prior.state == LAUNCHING
            rec = self.data.exited(data_id, code)
            if rec is not None:
                built = rec.report.batches if rec.report is not None else 0
                if retiring or self.state is not JobState.RUNNING:
                    self.log.add("data", f"data worker {data_id} stopped (built {built} batches)")
                else:
                    # a script's own error ends it with a positive code and says why in its log
                    tail = self.data.log_tail(data_id) if code is None or code > 0 else ""
                    self.log.add("failure", f"data worker {data_id} {why}{': ' + tail if tail else ''}; "
                                            "the trainers re-dispatch its batches and a new one starts")
                    if never_served:
                        self.data.start_failures += 1
                        if self.data.start_failures >= START_FAILURES:
                            self._fail_job(f"{START_FAILURES} data workers in a row ended before serving; the last "
                                           f"{why}{': ' + tail if tail else ''}")
                self._persist()
                self.data.refresh(self.clock())
            reports.popleft()

    def _handle_server_exits(self) -> None:
        """A parameter server that ends while the job runs is replaced, and the next round
        restores every server from the newest checkpoint (tidal.master.servers); one that ran
        out of memory, or a job without checkpoints, fails (its rows cannot come back, and
        training on without them would be a silent loss)."""
        reports = self.fleet.server_reports
        while reports:
            server_id, code, why = reports[0]
            retiring = server_id in self.servers.records and self.servers.records[server_id].state == RETIRING
            rec = self.servers.exited(server_id, code)
            if rec is not None and retiring:
                self.log.add("ps", f"parameter server {server_id} stopped (its shards moved away)")
                self._persist()
            elif rec is not None and self.state is JobState.RUNNING and code != PS_OUT_OF_MEMORY_EXIT \
                    and self.takes_checkpoints and server_id in self.servers.shard_map:
                new = self.servers.replace(server_id, f"parameter server {server_id} was lost", self._persist)
                self.log.add("ps", f"parameter server {server_id} {why}: server {new} takes its place, and every "
                                   "server goes back to the newest checkpoint with the model")
                self._execute([StartReform(f"parameter server {server_id} lost")])
            elif rec is not None and self.state in (JobState.RUNNING, JobState.FINISHING):
                tail = self.servers.log_tail(server_id)
                advice = ("raise --ps-memory, or let tidal add servers before they fill: --ps MIN:MAX without "
                          "--no-ps-oom-prevention" if code == PS_OUT_OF_MEMORY_EXIT else
                          "its rows cannot be restored without --checkpoint-every")
                self._fail_job(f"parameter server {server_id} {why}{': ' + tail if tail else ''} ({advice})")
            elif rec is not None:
                self._persist()
            reports.popleft()

    def _check_records(self, req: RendezvousRequest) -> None:
        """Records a rendezvous carries must be committable: anything else is a 400 now, not a
        crash when the round closes."""
        if not req.records:
            return
        cfg = self.shards.config
        if self.streams is None and cfg is None:
            raise BadRequestError("records before any shard was leased")
        for r in req.records:
            if r.step > req.applied_step:
                raise BadRequestError(f"record of step {r.step} is beyond applied_step {req.applied_step}")
            if self.streams is not None:  # packed ids: read after ``start``, ``first`` to ``end``
                if not r.start < r.first <= r.end:
                    raise BadRequestError(f"record ids ({r.start}, {r.first}..{r.end}] are not in order")
            elif cfg is not None and not r.start < r.end <= cfg.size:
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
        if req.compute_s or req.comm_s:  # a worker that measured its split (an older one sends none)
            rec.data_s, rec.compute_s, rec.comm_s = req.data_s, req.compute_s, req.comm_s
        if req.rss_bytes:
            rec.cpu_percent, rec.rss_bytes = req.cpu_percent, req.rss_bytes
        if req.stream_backlog >= 0:
            rec.stream_backlog, rec.stream_lag = req.stream_backlog, dict(req.stream_lag)
            rec.stream_oldest_ms, rec.stream_busy = req.stream_oldest_ms, req.stream_busy
            rec.stream_capacity = req.stream_capacity
            rec.stream_oldest_by_partition = dict(req.stream_oldest_by_partition)
            rec.stream_measured_ms = req.stream_measured_ms
            if req.stream_appended:
                self.planning.arrivals.note(req.worker_id, req.stream_measured_ms / 1000.0 or now, req.stream_appended, now)
            rec.stream_queued = req.stream_queued
            rec.stream_forwarded_out, rec.stream_forwarded_in = req.stream_forwarded_out, req.stream_forwarded_in
            rec.stream_batch, rec.stream_queue_upper = req.stream_batch, req.stream_queue_upper
            rec.stream_intake_spread = req.stream_intake_spread
        if req.threads:
            rec.threads = req.threads
        if req.data_queued >= 0:
            rec.data_counts = {"received": req.data_received, "built_here": req.data_built_here,
                               "taken": req.data_taken, "wait_s": req.data_wait_s, "queued": req.data_queued,
                               "redispatched": req.data_redispatched}
        if req.stream_malformed > rec.stream_malformed:
            self.log.add("stream", f"worker {rec.worker_id} skipped {req.stream_malformed - rec.stream_malformed} "
                                   f"malformed records ({req.stream_malformed} in all)", worker=rec.worker_id)
            rec.stream_malformed = req.stream_malformed
        self._note_checkpoint(req.checkpoint_step, req.checkpoint_problem)
        if req.round == self.round and self.is_member(req.worker_id) and rec.state in (W.ACTIVE, W.WAITING):
            rec.progressed(req.applied_step, now)
            for r in req.records:
                if r.worker != req.worker_id:
                    raise BadRequestError("a report may only carry the worker's own records")
                if r.step > req.applied_step:
                    raise BadRequestError(f"record of step {r.step} is beyond applied_step {req.applied_step}")
                self.commits.add_reported(r)
            if req.incarnation == self.incarnation:
                # only a worker that knows this master has resent what a predecessor lost
                self.commits.progress.update(req.worker_id, req.applied_step)
                self.commits.finalize_reported(self._save_meta)
        for pause in req.pauses:
            self.log.record_pause(pause.round, pause.seconds)
        trim: dict[int, int] = {}
        if self.streams is not None and self.spec.trim_after_commit:
            assigned = self.rounds.assignments.get(req.worker_id)
            positions = self.streams.positions
            trim = {p: positions[p] for p in (assigned.stream if assigned is not None else ()) if p in positions}
        return ReportResponse(round=self.round, reform=self.reforming, finalized_step=self.finalized_step,
                              incarnation=self.incarnation, stop=self.stream_stop is not None, stream_committed=trim,
                              data_workers=self.data.serving,
                              threads=self.trainer_threads, resume_step=self._resume_candidate())

    @journaled
    def data_report(self, req: DataWorkerReport) -> None:
        """A data worker's report; its first registers its address (tidal.master.dataworkers).

        Raises:
            WorkerGoneError: the job is over, or the data worker is not one of the job's, or was
                retired (it exits).
        """
        if self.state in (JobState.SUCCEEDED, JobState.FAILED):
            raise WorkerGoneError(f"the job has {self.state.value}")
        try:
            registered = self.data.report(req, self.clock())
        except KeyError:
            raise WorkerGoneError(f"data worker {req.data_worker_id} is not one of this job's running ones") from None
        if registered is not None:
            self.log.add("data", f"data worker {req.data_worker_id} serves at {req.address} (pid {req.pid})")
            self.data.refresh(self.clock())
            self._persist()

    def _note_checkpoint(self, step: int, problem: str) -> None:
        """A worker's newest flash checkpoint (journaled with the next meta write) and the
        persister's problem (shown once in the log and in the status until it changes)."""
        self.checkpoints.note(step)
        if not problem and step < 0:
            return  # a worker that never saved a checkpoint tells nothing
        if problem and problem != self.checkpoint_problem:
            self.log.add("error", f"checkpoint: {problem}; training goes on, the last good checkpoint is kept")
        self.checkpoint_problem = problem or None

    def _resume_candidate(self) -> int:
        """The step of the checkpoint a resume would load now (-1: none): the workers' persisters
        keep it on disk whatever ``--checkpoint-keep`` says, since the master learns of
        checkpoints later than they are taken (and pruned)."""
        if not self.takes_checkpoints:
            return -1
        chosen = self.checkpoints.choose(self.finalized_step)
        return -1 if chosen is None else chosen.step

    def _find_checkpoints(self) -> None:
        """A restarted master also knows the checkpoints on disk (the step, and the lineage in
        its meta.json): the workers that reported them may be gone with the master."""
        directory = self.spec.env.get("TIDAL_CHECKPOINT_DIR")
        if directory and self.takes_checkpoints:
            for ckpt in found_on_disk(directory):
                self.checkpoints.note(ckpt.step, ckpt.lineage)

    def _restore_failed(self, failed: RestoreFailure) -> None:
        """The source of a resuming round could not load its checkpoint: try the previous one,
        or fail the job when the checkpoint does not fit the script's model (none will)."""
        ckpt = Checkpoint(failed.step, failed.lineage)
        if failed.fatal:
            self._fail_job(f"cannot resume from the checkpoint of step {failed.step}: {failed.problem}")
            return
        if ckpt not in self.checkpoints.bad:
            self.checkpoints.mark_bad(ckpt)
            self.log.add("error", f"the checkpoint of step {failed.step} could not be loaded ({failed.problem}); "
                                  "resuming from the one before it")

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
        if self.streams is not None and self.stream_stop is None:
            message = f"worker {req.worker_id} says training is over, but a stream job ends only when stopped"
            self.log.add("error", f"finish refused: {message}")
            raise NotExhaustedError(message)
        pending = self.commits.pending_ranges()
        pending += [(r.epoch, r.start, r.end) for r in req.records if r.step <= req.applied_step]
        left = self.shards.unconsumed(pending) if self.streams is None else {}
        if left:
            gaps = list(itertools.islice(self.shards.uncovered(pending), 3))
            message = (f"worker {req.worker_id} says training is over after step {req.applied_step}, but "
                       f"{_samples_left(left)}; first untrained (epoch, start, end): {gaps}")
            self.log.add("error", f"finish refused: {message}")
            raise NotExhaustedError(message)
        rec.finished = True
        self.log.add_metrics(req.metrics)
        if req.records and self.is_member(req.worker_id):
            # what it held unacknowledged, every member's, complete up to its applied step (also
            # for a master it never reported to: one that took over, or before its first report)
            for r in req.records:
                if r.step <= req.applied_step:
                    self.commits.add_reported(r)
            self.commits.progress.update(req.worker_id, req.applied_step)
            self.commits.finalize_reported(self._save_meta)
        # its records were flushed before it said so: it no longer holds finalization back
        # (a member that *fails* keeps holding it back until the next round settles its steps)
        self.commits.progress.remove(req.worker_id)
        self.commits.finalize_reported(self._save_meta)
        if self.state is JobState.RUNNING:
            self.state = JobState.FINISHING
            self.log.add("job", f"training finished (reported by worker {req.worker_id})")
            self._persist()
            self._on_change()

    @journaled
    def scale(self, workers: int) -> int:
        """The user's target: the planner stops deciding until ``scale_auto``.

        Raises:
            BadRequestError: the job is not running, or ``workers`` is outside MIN:MAX.
        """
        self._check_scalable()
        if not self.spec.min_workers <= workers <= self.spec.max_workers:
            raise BadRequestError(
                f"{workers} workers is outside this job's range {self.spec.min_workers}:{self.spec.max_workers}"
            )
        self.target_override = workers
        self.log.add("scale", f"target set to {workers} workers (was {self.target})")
        self.target = workers
        self._persist()
        self.fleet.next_launch_check = 0.0
        self.tick()
        return workers

    @journaled
    def scale_ps(self, servers: int) -> int:
        """The user's number of parameter servers (``tidal scale --ps N``): new ones start now,
        and the virtual shards move at the next re-form (tidal.master.servers).

        Raises:
            BadRequestError: the job is not running, has no servers, or ``servers`` is outside
                its ``--ps MIN:MAX``.
        """
        self._check_scalable()
        low, high = self.spec.ps_range
        if not self.spec.ps:
            raise BadRequestError("this job has no parameter servers (start it with --ps)")
        if not low <= servers <= high:
            raise BadRequestError(f"{servers} parameter servers is outside this job's range {low}:{high} "
                                  "(--ps MIN:MAX)")
        if servers > self.spec.ps_shards:
            raise BadRequestError(f"{servers} parameter servers for {self.spec.ps_shards} virtual shards")
        self.log.add("scale", f"parameter servers: target {servers} (was {self.servers.target})")
        self.servers.target = servers
        self._persist()
        self.tick()
        return servers

    @journaled
    def scale_data(self, count: int) -> int:
        """The user's number of data workers (``tidal scale --data-workers N``): new ones start
        now; retired ones leave the trainers' lists at once and stop a moment later.

        Raises:
            BadRequestError: the job is not running, has no data workers, or ``count`` is outside
                its ``--data-workers MIN:MAX``.
        """
        self._check_scalable()
        if self.spec.data_workers < 0:
            raise BadRequestError("this job has no data workers (start it with --data-workers)")
        low, high = self.spec.data_range
        if not low <= count <= high:
            raise BadRequestError(f"{count} data workers is outside this job's range {low}:{high} "
                                  "(--data-workers MIN:MAX)")
        self.log.add("scale", f"data workers: target {count} (was {self.data.target})"
                     + ("; the tuner stops deciding" if self.data_tuner is not None else ""))
        self.data.target = self.data_override = count
        self._persist()
        self.tick()
        return count

    @journaled
    def scale_auto(self) -> int:
        """Hand the target back to the planner (``tidal scale --auto``); it decides at once."""
        self._check_scalable()
        self.target_override = None
        self.log.add("scale", f"target back to planner {self.planner.name} (was {self.target} workers, set by hand)")
        self._next_plan_at = 0.0
        self._apply_plan(self.clock())
        self._persist()
        self.fleet.next_launch_check = 0.0
        self.tick()
        return self.target

    def _check_scalable(self) -> None:
        if self.state is not JobState.RUNNING:
            raise BadRequestError(f"job is {self.state.value}; cannot scale")

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
        self.fleet.poll()
        self._handle_backend_reports()
        self._handle_server_exits()
        self._handle_data_exits()
        if now >= self._next_liveness_check:
            self._next_liveness_check = now + LIVENESS_S
            self._execute(liveness.check_heartbeats(
                list(self.workers.values()), now, heartbeat_timeout_s=self.spec.heartbeat_timeout_s,
                start_timeout_s=self.spec.start_timeout_s))
        if self.state is JobState.RUNNING:
            if now >= self._next_check:
                self._next_check = now + CHECK_S
                self._execute(liveness.detect_stragglers(
                    self._active(), now, factor=self.spec.straggler_factor, window_s=self.spec.straggler_window_s))
                self._execute(liveness.check_progress(
                    self.rounds, self.workers, now, round_timeout_s=self.spec.round_timeout_s,
                    progress_timeout_s=self.spec.progress_timeout_s))
            if now >= self._next_plan_at:
                self._next_plan_at = now + self.spec.planner_interval_s
                self._apply_plan(now)
            if now >= self._next_timeline:
                self._next_timeline = now + TIMELINE_S
                active = self._active()
                lag = self._track_lag(now) if self.streams is not None else None
                busy = stream_busy(self._member_records()) if self.streams is not None else None
                self.planning.record(now, sum(r.samples_per_s for r in active), len(active), self.target, lag, busy,
                                     ready=self._ready(active), arrivals_per_s=self.stream_arrivals_per_s())
            if self.streams is not None and self.spec.stop_when_drained_s is not None:
                self._check_drained(now)
            if self.spec.ps:
                self._launch_servers()
                if self.spec.ps_memory and now >= self._next_memory_check:
                    self._next_memory_check = now + MEMORY_CHECK_S
                    self._prevent_ps_oom(now)
                if self.spec.ps_hot_balance and now >= self._next_hot_check:
                    self._next_hot_check = now + HOT_CHECK_S
                    self._balance_hot_servers(now)
            if self.spec.data_workers >= 0:
                self._reconcile_data(now)
            self._launch_missing(now)
            cause = rounds.reform_cause(self.rounds, self.workers, self.target)
            if cause is None and self.servers.change_ready() and self.servers.move is None and self.rounds.members:
                cause = self.servers.change_cause()
            if cause is not None:
                self._execute([StartReform(cause)])
            self._try_close_round()
        elif self.state is JobState.FINISHING and not self.fleet.alive_ids():
            self._settle()
        elif self.state is JobState.FAILED:
            self.fleet.kill(self.fleet.alive_ids(), "job-failed")
        if self.state in (JobState.SUCCEEDED, JobState.FAILED) and self.servers.alive():
            self.servers.kill(self.state.value)  # the workers are done with them
        if self.state is not JobState.RUNNING and self.data.alive():
            self.data.kill(self.state.value)  # no trainer asks for batches any more

    def stop(self) -> str:
        """``tidal stop``: a stream job's workers finish at their next step boundary (what they
        trained is committed); the job then succeeds.

        Raises:
            BadRequestError: not a stream job (a dataset job ends when its data are trained), or
                it has ended.
        """
        if self.streams is None:
            raise BadRequestError("only a stream job stops: a dataset job ends once every sample is trained "
                                  "(interrupt its `tidal run` to abort it)")
        if self.state is not JobState.RUNNING:
            raise BadRequestError(f"the job is {self.state.value}")
        if self.stream_stop is None:
            self.stream_stop = "stopped (tidal stop)"
            self.log.add("job", "stream job stops: tidal stop")
            self._persist()
        return self.stream_stop

    def stream_status(self) -> list[StreamPartitionStatus]:
        if self.streams is None:
            return []
        owners = {p: w for w, a in self.rounds.assignments.items() if a.status == "ready" for p in a.stream}
        now = self.clock()
        out = []
        for p in sorted(self.streams.partitions):
            owner = owners.get(p)
            rec = self.workers.get(owner) if owner is not None else None
            lag = rec.stream_lag.get(p, -1) if rec else -1
            lag_s = partition_lag_s(now, self.spec.time_scale, rec, p) if rec and lag >= 0 else -1.0
            out.append(StreamPartitionStatus(partition=p, committed=unpack_id(self.streams.positions.get(p, 0)),
                                             worker=owner, lag=lag, lag_s=lag_s))
        return out

    def _stream_lag_status(self) -> StreamLagStatus | None:
        """The stream's lag against its SLO and the rate records arrive at (trace time)."""
        if self.streams is None:
            return None
        status = self.planning.lag.status(self.spec.time_scale)
        if status is not None:
            status.arrivals_per_s = self.stream_arrivals_per_s()
        return status

    def stream_arrivals_per_s(self) -> float | None:
        """Records arriving per second in trace time (``planning.ArrivalMeter``; None: not
        counted yet, or not a stream job)."""
        if self.streams is None:
            return None
        rate = self.planning.arrivals.rate(sorted(self.streams.partitions), self.clock())
        return None if rate is None else round(rate / self.spec.time_scale, 3)

    def _member_records(self) -> list[WorkerRecord]:
        """The records of the round's members (those the master still knows)."""
        return [self.workers[m] for m in self.rounds.members if m in self.workers]

    def _track_lag(self, now: float) -> float | None:
        """The stream's lag now (trace time; None: no member reported yet), added to the SLO
        bookkeeping, which is journaled (a master that takes over carries on from it)."""
        members = self._member_records()
        lag = stream_lag_s(now, self.spec.time_scale, members)
        if lag is not None:
            self.planning.lag.observe(now, lag, self.spec.time_scale)
            self.journal.put_meta("stream_lag", self.planning.lag.to_meta())
        return lag

    def _check_drained(self, now: float) -> None:
        """``--stop-when-drained S``: every member has read everything of its partitions, all of it
        is committed, and no commit came for S seconds: the job stops (its workers finish)."""
        assert self.streams is not None and self.spec.stop_when_drained_s is not None
        if self.stream_stop is not None:
            return
        members = [self.workers[m] for m in self.rounds.members]
        positions = dict(self.streams.positions)
        drained = (bool(members) and not self.rounds.reforming and not self.commits.tentative
                   and all(r.alive and r.stream_backlog == 0 for r in members))
        if not drained or positions != self._stream_positions:
            self._stream_positions = positions
            self._stream_quiet_since = now if drained else None
            return
        if self._stream_quiet_since is None:
            self._stream_quiet_since = now
        elif now - self._stream_quiet_since >= self.spec.stop_when_drained_s:
            self.stream_stop = f"every partition drained and nothing new for {self.spec.stop_when_drained_s:g} s"
            self.log.add("job", f"stream job stops: {self.stream_stop}")
            self._persist()

    def _handle_backend_reports(self) -> None:
        """Exits and launch errors, each dropped only once handled: a journal failure keeps it for
        the reload."""
        exits, errors = self.fleet.pending_exits(), self.fleet.pending_errors()
        while errors:
            worker_id, err = errors[0]
            rec = self.workers.get(worker_id)
            if rec is not None:
                # out of descriptors, processes or disk is the machine's fault, not the script's
                self._worker_failed(rec, None, err.message, counts=not err.retryable)
            errors.popleft()
        while exits:
            worker_id, ev = exits[0]
            rec = self.workers.get(worker_id)
            if rec is not None:
                self._process_exited(rec, ev.exit_code)
            exits.popleft()

    def _execute(self, actions: Sequence[Action]) -> None:
        """The one place the decisions' actions change state."""
        now = self.clock()
        for action in actions:
            if isinstance(action, FailWorker):
                rec = self.workers[action.worker_id]
                self._worker_failed(rec, None, action.why)
                if action.kill is not None:
                    self.fleet.kill([rec.worker_id], action.kill)
            elif isinstance(action, StartReform):
                self._start_reform(action.cause)
            elif isinstance(action, FormRound):
                self._form_round(action, now)
            elif isinstance(action, FailJob):
                self._fail_job(action.reason)
            elif isinstance(action, SlowSince):
                self.workers[action.worker_id].slow_since = action.since
            elif isinstance(action, SetStraggler):
                rec = self.workers[action.worker_id]
                rec.straggler, rec.size_factor = action.straggler, action.size_factor
                self.log.add("straggler", action.message, worker=rec.worker_id)

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
        if self.streams is not None:
            return None  # a stream has no end: what was trained is committed (the finish flushed it)
        left = self.shards.unconsumed()
        if left:
            return f"the workers finished, but {_samples_left(left)}"
        cfg = self.shards.config
        if cfg is None:
            return None
        # epochs=None audits the epochs the ledger has: ``unconsumed`` already saw every other one
        audit = audit_ranges(((c.epoch, c.start, c.end) for c in self.journal.load_ledger()), cfg.size, cfg.epochs)
        return None if audit.ok else f"the journal's ledger is not exactly once: {audit.summary()}"

    def _apply_plan(self, now: float) -> None:
        """Measure, then ask the planner for a target (unless the user set one). The job never
        stops because its planner failed: a plan that raises keeps the current target (logged
        once per distinct error), one outside MIN:MAX is clamped (and said so). A change is
        journaled with the observation it rested on and the planner's reason."""
        active = self._active()
        ready = self._measure(now, active)
        if self._planning is None:
            if self.target_override is not None:
                return  # measured all the same: the planner decides from it once handed back
            obs = self._observe(now, active, ready)
            self._planning = (obs, self._planner_pool.submit(self.planner.plan, obs))
        obs, future = self._planning
        try:
            # a quick planner's answer is applied at once; a slow one's at a later tick
            plan = future.result(timeout=PLAN_WAIT_S)
        except TimeoutError:
            return
        except Exception as exc:  # a policy's bug must not stop the job
            self._planning = None
            self._planner_failed(exc)
            return
        self._planning = None
        if self.target_override is not None:
            return  # the user took over while the planner thought
        try:
            wanted = int(plan.workers)
        except Exception as exc:  # a policy's bug must not stop the job
            self._planner_failed(exc)
            return
        self._planner_problem = None
        self.planning.last_plan = plan
        target = min(max(wanted, self.spec.min_workers), self.spec.max_workers)
        if target != self.target:
            clamped = f", clamped from {wanted} to MIN:MAX" if target != wanted else ""
            reason = f"{plan.reason}{clamped}"
            self.log.add("scale", f"planner {self.planner.name}: {self.target} -> {target} workers ({reason})")
            self.planning.decided(obs, plan, target, reason)
            self.target = target
            with self.journal.transaction():
                self._save_meta_and_workers()
                self.journal.put_meta("planner", self.planning.to_meta())

    def _planner_failed(self, exc: Exception) -> None:
        """Keep the current target; say so once per distinct error."""
        problem = f"planner {self.planner.name} failed: {type(exc).__name__}: {exc}"
        if problem != self._planner_problem:
            self._planner_problem = problem
            self.log.add("error", f"{problem}; keeping {self.target} workers")
            log.error("job %s: %s", self.spec.job_id, problem, exc_info=exc)

    def _measure(self, now: float, active: list[WorkerRecord]) -> bool:
        """Close the throughput interval since the previous call; whether the job is ``_ready``
        (only then does the interval count)."""
        ready = self._ready(active)
        self.planning.measure(now, len(active), self.committed_samples(), ready)
        return ready

    def _ready(self, active: list[WorkerRecord]) -> bool:
        """Whether the job runs at its target with nothing starting, re-forming or leaving (a
        scaled-in worker counts until it has exited)."""
        return (not self.reforming and len(active) == self.target
                and all(r.state in (W.ACTIVE, W.SUCCEEDED, W.FAILED) for r in self.workers.values()))

    def _observe(self, now: float, active: list[WorkerRecord], ready: bool) -> JobObservation:
        """What the planner sees now."""
        cfg = self.shards.config
        stream = None
        if self.streams is not None:
            members = self._member_records()
            stream = self.planning.observe_stream(
                now, self.spec.planner_interval_s, self.spec.time_scale, self.committed_samples(), members, ready,
                partitions=sorted(self.streams.partitions))
        return self.planning.observe(
            job_id=self.spec.job_id, now=now, min_workers=self.spec.min_workers, max_workers=self.spec.max_workers,
            target=self.target, active=active, ready=ready, applied_step=self.finalized_step,
            batch_size=0 if cfg is None else cfg.batch_size, committed=self.committed_samples(),
            total=0 if cfg is None or cfg.epochs is None else cfg.size * cfg.epochs, pauses=self.log.pauses(),
            stream=stream, time_scale=self.spec.time_scale,
            ps=self.servers.observation([r.cpu_percent / 100 for r in active], self.planning.cpus),
            data=self._data_observation(active),
        )

    def _data_observation(self, active: list[WorkerRecord]) -> DataWorkerObservation | None:
        """The data-worker side of the observation (None: the job has none)."""
        q = self.data_queue()
        if q is None:
            return None
        low, high = self.spec.data_range
        serving = len(self.data.serving)
        threads = [r.threads for r in active]
        # with logical workers the model must not depend on the trainers' threads: not tunable
        tunable = bool(threads) and min(threads) > 0 and "TIDAL_LOGICAL_WORKERS" not in self.spec.env
        return DataWorkerObservation(count=serving, target=self.data.target, low=low, high=high,
                                     trainer_threads=min(threads) if tunable else 0,
                                     trainer_threads_max=max(1, int(self.planning.cpus or os.cpu_count() or 1)),
                                     trainer_cpu=sum(r.cpu_percent for r in active) / 100 / max(1, len(active)),
                                     samples_per_s=sum(r.samples_per_s for r in active),
                                     batches_per_s=q.enqueue_per_s, enqueue_per_s=q.enqueue_per_s,
                                     dequeue_per_s=q.dequeue_per_s, built_by_trainers_per_s=q.built_by_trainers_per_s,
                                     wait_share=q.wait_share)

    def committed_samples(self) -> int:
        """Samples in committed ranges, over every epoch (a stream job: records committed)."""
        return self.streams.records if self.streams is not None else self.shards.samples_done

    def _launch_missing(self, now: float) -> None:
        # journal first: a process the journal does not know would be an orphan after a reload
        new = self.fleet.launch_missing(self.target, now, self._persist)
        if not new:
            return
        self._handle_backend_reports()  # launches that failed at once
        for rec in new:
            if rec.state is W.LAUNCHING:
                where = f" (pid {rec.pid})" if rec.pid else ""  # a ray node gets its pid once placed
                self.log.add("launch", f"launched worker {rec.worker_id}{where}", worker=rec.worker_id)
        self._persist()

    # ================================================================== rounds
    def _start_reform(self, cause: str) -> None:
        if not self.rounds.reforming:
            self.rounds.start_reform(cause, self.clock())
            log.info("job %s: re-forming round %d: %s", self.spec.job_id, self.round, cause)

    def _try_close_round(self) -> None:
        if self.state is not JobState.RUNNING or not self.servers.ready:
            return
        self._restore_choice = self.checkpoints.choose(self.finalized_step) if self.takes_checkpoints else None
        restore_from = None if not self.takes_checkpoints else self._restore_choice.step if self._restore_choice else -1
        decision = rounds.decide_round(
            self.rounds, self.workers, now=self.clock(), target=self.target, min_workers=self.spec.min_workers,
            start_grace_s=self.spec.start_grace_s, finalized_step=self.finalized_step,
            round_failure_limit=self.spec.round_failure_limit, restore_from=restore_from, lost=self.servers.lost)
        if isinstance(decision, FormRound) and not self._servers_settled(decision):
            return
        if decision is not None:
            self._execute([decision])

    def _servers_settled(self, form: FormRound) -> bool:
        """Whether the round may form as far as the parameter servers go: no change of their
        shard map is wanted, or the shards have moved (tidal.master.servers). Starts the move."""
        servers = self.servers
        if servers.move is None:
            if not servers.change_ready() or form.restore:
                return True
            watermark = self.rounds.waiting[form.source].ps_watermark
            move = servers.begin_move(watermark)
            moving = sum(len(v) for v in move.moves().values())
            self.log.add("ps", f"moving {moving} virtual shards: {len(set(move.old_map))} -> "
                               f"{len(set(move.new_map))} parameter servers, at step {form.resume_step}")
            return False
        if not servers.move.done.is_set():
            return False
        move = servers.move
        if move.error is not None or move.void is not None:
            servers.move = None
            servers.target = len(servers.in_map())
            servers.planned_map = None
            self.log.add("error", f"moving virtual shards failed, the servers keep their map "
                                  f"({len(servers.in_map())} servers): {move.error or move.void}")
            self._persist()
            return True
        stopped = servers.end_move(self._persist)
        self.log.add("ps", f"moved {move.rows} rows in {move.seconds:.3f} s; parameter servers now "
                           f"{servers.in_map()}" + (f"; stopping {stopped}" if stopped else ""))
        return True

    def _form_round(self, form: FormRound, now: float) -> None:
        rs = self.rounds
        prev_round = rs.round
        rs.failed_rounds, rs.round_failure = form.failed_rounds, form.round_failure
        restore_lineage = self._restore_choice.lineage if form.restore and self._restore_choice else 0
        source_req = rs.waiting[form.source]
        records, applied = source_req.records, source_req.applied_step
        if form.restore:
            lost = self.finalized_step
            voided = self.commits.rollback(form.resume_step)
            self.checkpoints.rollback(form.resume_step)
            where = (f"the checkpoint of step {form.resume_step}" if form.resume_step >= 0
                     else "scratch (no checkpoint it can load)")
            what = self.servers.lost or "every worker holding the model was lost"
            self.log.add("restore", f"{what} after step {lost}: resuming from {where}; the {voided} samples "
                                    "of the steps after it are trained again")
            records, applied = [], form.resume_step  # what survivors applied after it is void
        self.servers.lost = None  # journaled with the round
        committed = self.commits.settle_round(records, applied, form.has_state, form.members)
        stream = self.streams.assign(form.members) if self.streams is not None else {}
        rs.round = prev_round + 1
        rs.round_start_step = form.resume_step
        cause = rs.reform_cause or ("start" if prev_round < 0 else "re-form")
        self.log.note_round(rs.round, cause)
        rs.members = form.members
        rs.reforming, rs.reform_cause, rs.reform_started = False, "", 0.0
        rs.assignments = {}
        source_rank = form.members.index(form.source)
        for rank, w in enumerate(form.members):
            rec = self.workers[w]
            rec.rank = rank
            if self.streams is not None:
                rec.stream_capacity = 0.0  # not measured in this round yet (observe_stream waits for it)
            rec.move(W.ACTIVE, now)
            rec.progressed_at = now
            self.fleet.trained(rec)
            rs.assignments[w] = RendezvousResponse(
                status="ready", round=rs.round, rank=rank, world_size=len(form.members),
                store_host=self.spec.host, store_port=self.store_port, source_rank=source_rank,
                sync_state=form.sync_state, applied_step=form.resume_step, restore=form.restore,
                lineage=self.checkpoints.lineage, restore_lineage=restore_lineage, stream=stream.get(w, {}),
                stream_skip=self.streams.skips(stream.get(w, {})) if self.streams is not None else {},
                ps=self.servers.addresses(), ps_shard_map=self.servers.positions(),
            )
        for w in form.leaving:
            rec = self.workers[w]
            rec.move(W.LEAVING, now)
            rec.rank = -1
            rs.assignments[w] = RendezvousResponse(status="leave", round=rs.round)
            self.log.add("leave", f"worker {w} leaves (scale-in)", worker=w)
        rs.waiting.clear()
        rs.waiting_since.clear()
        rs.assignments_dirty = True  # journaled with this round, not on every commit
        self.commits.write(committed, self._save_meta_and_workers)
        self.log.add("round", f"round {rs.round}: {len(form.members)} workers {form.members}, "
                              f"resume after step {form.resume_step} ({cause})")
        self._on_change()

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
            self.rounds.waiting.pop(rec.worker_id, None)
            self.log.add("exit", f"worker {rec.worker_id} exited (code {code})", worker=rec.worker_id)
            if was_member and self.state is JobState.RUNNING:
                # the script ended its training loop on its own: the job is finishing
                self.state = JobState.FINISHING
                self.log.add("job", f"worker {rec.worker_id} finished its script")
            self._persist_worker(rec)
            return
        if code == DATA_ERROR_EXIT and self.state in (JobState.RUNNING, JobState.FINISHING):
            # a batch that cannot be built fails the same way on any worker: no restart helps
            rec.move(W.FAILED, now)
            rec.exit_code = code
            self._persist_worker(rec)
            self._fail_job(f"worker {rec.worker_id}: {self.fleet.log_tail(rec.worker_id) or 'a batch could not be built'}")
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
        self.rounds.leave_rendezvous(rec.worker_id)
        self.log.add("failure", f"worker {rec.worker_id} failed: {why}", worker=rec.worker_id)
        log.warning("job %s: worker %d failed: %s", self.spec.job_id, rec.worker_id, why)
        if self.state is JobState.FINISHING and rec.ever_active:
            # a worker that trained and then failed while finishing (a full checkpoint dir, a
            # crash in the final evaluation): its script did not succeed, so neither did the job
            tail = self.fleet.log_tail(rec.worker_id)
            self._fail_job(f"worker {rec.worker_id} {why} while the job was finishing{': ' + tail if tail else ''}")
            return
        if self.state is not JobState.RUNNING:
            self._persist_worker(rec)
            return
        failures = self.fleet.count_failure(rec, now, counts)
        if was_member:
            self.rounds.restart_reform(f"worker {rec.worker_id} failed", now)
        if failures >= self.spec.crash_loop_limit:
            tail = self.fleet.log_tail(rec.worker_id)
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
            self.fleet.kill(self.fleet.alive_ids(), "interrupted")
        self.paused = None  # the reconcile loop must see the exits now, not probe the journal

    def _fail_job(self, message: str) -> None:
        self.error = message
        self._set_state(JobState.FAILED)
        self.fleet.kill(self.fleet.alive_ids(), "job-failed")

    def _set_state(self, state: JobState) -> None:
        if self.state is state:
            return
        self.state = state
        self.log.add("job", f"job {state.value}" + (f": {self.error}" if self.error else ""))
        self._persist()
        self._on_change()

    # ================================================================== views
    def _active(self) -> list[WorkerRecord]:
        return [self.workers[m] for m in self.members if self.workers[m].state is W.ACTIVE]

    def timeline(self) -> TimelineResponse:
        """What the dashboard draws (``GET /v1/timeline``)."""
        t0 = self.planning.started_at
        return TimelineResponse(
            job_id=self.spec.job_id, state=self.state, planner=self.planner.name,
            points=list(self.planning.timeline),
            pauses=[PauseObservation(at_s=round(p.time - t0, 3), seconds=p.seconds or 0.0, cause=p.cause or "")
                    for p in self.log.pauses()[-MAX_TIMELINE_PAUSES:]],
            decisions=list(self.planning.decisions),
            workers=[worker_observation(r) for r in self._active()],
            lag_slo_s=self.spec.lag_slo_s if self.streams is not None else None,
        )

    def status(self) -> StatusResponse:
        now = self.clock()
        return StatusResponse(
            job_id=self.spec.job_id, state=self.state, target_workers=self.target,
            min_workers=self.spec.min_workers, max_workers=self.spec.max_workers, round=self.round,
            reforming=self.reforming, finalized_step=self.finalized_step,
            workers=[
                WorkerInfo(
                    worker_id=r.worker_id, pid=r.pid, state=r.state, rank=r.rank if r.state is W.ACTIVE else -1,
                    applied_step=r.applied_step, samples_per_s=round(r.samples_per_s, 1),
                    straggler=r.straggler, exit_code=r.exit_code, stream_backlog=r.stream_backlog,
                    stream_busy=round(r.stream_busy, 3), stream_capacity=round(r.stream_capacity, 1),
                    stream_queued=r.stream_queued,
                    stream_forwarded_out=r.stream_forwarded_out, stream_forwarded_in=r.stream_forwarded_in,
                    stream_batch=r.stream_batch, stream_queue_upper=r.stream_queue_upper,
                    stream_intake_spread=round(r.stream_intake_spread, 4),
                    stream_lag_s=round(worker_lag_s(now, self.spec.time_scale, r), 3) if r.stream_backlog >= 0 else -1.0,
                )
                for r in sorted(self.workers.values(), key=lambda r: r.worker_id)
            ],
            shards=[ShardCounts(epoch=e, todo=t, doing=d, done=dn, samples_done=sd, samples_total=st)
                    for e, t, d, dn, sd, st in self.shards.counts()],
            events=self.log.recent(50),
            metrics=dict(self.metrics),
            error=self.error,
            paused=self.paused,
            planner=self.planning.status(overridden=self.target_override is not None),
            checkpoint_step=self.checkpoint_step, checkpoint_problem=self.checkpoint_problem,
            stream=self.stream_status(), stream_stop=self.stream_stop,
            stream_lag=self._stream_lag_status(),
            servers=self.servers.info(), ps_shard_map=self.servers.shard_map,
            ps_target=self.servers.target if self.spec.ps else 0,
            ps_range=list(self.spec.ps_range) if self.spec.ps else [],
            data_workers=self.data.info(), data_target=self.data.target if self.spec.data_workers >= 0 else 0,
            data_range=list(self.spec.data_range) if self.spec.data_workers >= 0 else [],
            data_queue=self.data_queue(), data_decisions=self.data_decisions[-20:],
        )

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

    def _save_meta(self) -> None:
        """The master's meta row: every owner's part (the journal's ``state`` key)."""
        cfg = self.shards.config
        rs = self.rounds
        if rs.assignments_dirty:
            self.journal.put_meta("assignments", {str(k): v.model_dump() for k, v in rs.assignments.items()})
            rs.assignments_dirty = False
        self.journal.put_meta("state", {
            "job_state": self.state.value, "round": rs.round, "members": rs.members,
            "finalized_step": self.finalized_step, "target": self.target,
            "target_override": self.target_override, "error": self.error, "checkpoint_step": self.checkpoint_step,
            "checkpoints": self.checkpoints.to_meta(),
            "stream_partitions": sorted(self.streams.partitions) if self.streams is not None else [],
            "stream_records": self.streams.records if self.streams is not None else 0,
            "stream_stop": self.stream_stop,
            **self.fleet.to_meta(),
            **self.servers.to_meta(),
            **self.data.to_meta(), "data_override": self.data_override,
            "dataset": None if cfg is None else {
                "size": cfg.size, "batch_size": cfg.batch_size, "batches_per_shard": cfg.batches_per_shard,
                "shuffle": cfg.shuffle, "seed": cfg.seed, "epochs": cfg.epochs,
            },
        })

    def _save_workers(self) -> None:
        for rec in self.workers.values():
            self.journal.save_worker(rec.worker_id, rec.to_row())

    def _save_meta_and_workers(self) -> None:
        self._save_meta()
        self._save_workers()

    def _persist(self) -> None:
        with self.journal.transaction():
            self._save_meta_and_workers()

    def _persist_worker(self, rec: WorkerRecord) -> None:
        self.journal.save_worker(rec.worker_id, rec.to_row())


def _samples_left(left: dict[int, int]) -> str:
    parts = ", ".join(f"epoch {e}: {n}" for e, n in sorted(left.items())[:4])
    return f"{sum(left.values())} samples were never trained ({parts}{', ...' if len(left) > 4 else ''})"


def new_token() -> str:
    return secrets.token_urlsafe(24)
