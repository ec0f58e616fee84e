"""A worker's reports to the master: heartbeats, step records, pauses, from a background thread.

The master's exactly-once ledger learns who trained which range of which step from these
records: a step is final once every member of its round reported it (tidal.master), and the
response says up to which step everything is durable (``finalized_step``) and whether the
round re-forms. So the reporter

* keeps every worker's records of each applied step until the master acknowledges the step as
  final (a rendezvous or a finish carries them: ``held_records``), and sends this worker's own
  records once, batched: one request per ``REPORT_INTERVAL_S`` at most while records wait, a bare
  heartbeat every ``heartbeat_interval_s`` otherwise (a worker at 50 steps/s still sends 4
  requests/s; the last records are flushed by ``Job.finish``);
* keeps what a failed request carried for the next one, and re-sends its own records above
  ``finalized_step`` to a master that restarted (a new ``incarnation``: the records it had not
  journaled are lost with it);
* turns the master's answers into what the training thread acts on: ``reform_notice`` (sent to
  every member in the next step header), ``gone`` (a 410: the master declared this worker
  failed), and, when the round re-forms while a collective has waited ``STALL_ABORT_S``, aborts
  that collective (NCCL: a survivor would otherwise wait for its dead peer until the timeout).

It shares one lock with the step runner (tidal.worker.step): the runner moves the state's step
count and calls ``record_step`` under it, and the reporter reads the step count and takes the
records under it, so a report never claims a step without its records.

The reporter is driven by its job (tidal.worker.job.Job) through its public methods; the clock,
the intervals and the client are injected, so it is tested without a master or a thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import psutil
from pydantic import BaseModel

from tidal.api import (
    MAX_PAUSES_PER_REPORT,
    MAX_RECORDS_PER_REQUEST,
    PauseReport,
    ReportRequest,
    ReportResponse,
    StaleRoundError,
    StepRecord,
    TidalError,
)
from tidal.worker.api import WorkerGoneError
from tidal.worker.step import AppliedStep

log = logging.getLogger(__name__)
T = TypeVar("T", bound=BaseModel)

REPORT_INTERVAL_S = 0.25  # at most one request per interval while records or pauses wait
STALL_ABORT_S = 1.0  # a collective waiting this long when the master re-forms waits for a dead peer
REPORT_PATIENCE_S = 0.5  # a report is not retried longer: the next one carries the same records
MAX_STEP_PART_S = 1e6  # ReportRequest's bound on data_s, compute_s, comm_s


class ReportClient(Protocol):
    """The master's control plane as the reporter uses it (tidal.worker.client.MasterClient)."""

    def post(self, path: str, body: BaseModel, response: type[T], patience_s: float | None = None) -> T:
        """POST ``body`` and parse the answer as ``response``.

        Raises:
            tidal.api.StaleRoundError: 409, the round moved on.
            tidal.worker.api.WorkerGoneError: 410, the master declared this worker failed.
            tidal.api.TidalError: any other refusal, or the master unreachable for ``patience_s``.
        """
        ...


class StalledCollective(Protocol):
    """The round's communicator as the reporter sees it (tidal.worker.comm.RoundComm)."""

    def stalled_for(self) -> float:
        """Seconds the collective in flight has waited so far (0: none in flight)."""
        ...

    def abort(self) -> bool:
        """Abort the collective in flight from another thread; True if it could be aborted."""
        ...


class Reporter:
    """Sends this worker's heartbeats, step records and pauses; keeps what the master lacks.

    Args:
        client: the master's control plane.
        worker_id: this worker's id.
        lock: shared with the step runner, which holds it while the state's step count moves and
            ``record_step`` is called; the reporter holds it while it reads both.
        applied_step: the state's step count (read under ``lock``).
        clock: monotonic seconds.
        interval_s: the least time between two requests that carry records or pauses.
        heartbeat_interval_s: the longest time between two requests (the master's, from its
            ``JoinResponse``; ``start`` may set it).
        tick_s: how often the thread looks whether a request is due.
    """

    def __init__(self, client: ReportClient, worker_id: int, *, lock: AbstractContextManager[Any],
                 applied_step: Callable[[], int], clock: Callable[[], float] = time.monotonic,
                 interval_s: float = REPORT_INTERVAL_S, heartbeat_interval_s: float = 0.5,
                 tick_s: float = 0.05) -> None:
        self._client = client
        self._worker_id = worker_id
        self._lock = lock
        self._applied_step = applied_step
        self._clock = clock
        self._interval_s = interval_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._tick_s = tick_s
        self._send_lock = threading.Lock()  # a flush waits for the thread's request in flight
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_sent = float("-inf")  # the first look sends a heartbeat at once
        # what the training thread told: its round, and its communicator while it is a member
        self._round = -1
        self._comm: StalledCollective | None = None
        # under ``lock``: every worker's records of applied, unacknowledged steps; this worker's
        # records and pauses not yet sent; the master's last acknowledged step and incarnation
        self._records: dict[int, list[StepRecord]] = {}
        self._unsent: list[StepRecord] = []
        self._pauses: list[PauseReport] = []
        self._acked = -1
        # after a rollback, until the round's state is in place (``joined``), the most this worker
        # may claim to have applied: the checkpoint's step (its state still holds the voided steps)
        self._applied_cap: int | None = None
        self._incarnation = ""
        # this worker's throughput (exponential averages over its applied steps) and pause
        self._samples_per_s = 0.0
        self._compute_per_sample = 0.0
        self._pause_from: float | None = None
        self._last_step_end = clock()
        # where a step's time goes, seconds per step (running means; None: not measured yet):
        # data, from the previous step's end in this round to this step's begin (the loader's
        # lease; it reads the batch after the begin); compute, from the begin to the
        # collectives, the optimizer step included; comm, the collectives (``AppliedStep.comm_s``)
        self._prev_end: float | None = None  # the previous step's end in this round
        self._data_s: float | None = None
        self._compute_s: float | None = None
        self._comm_s: float | None = None
        # what the master said, for the training thread
        self._reform_notice = False
        self._gone: str | None = None
        self._usage = ProcessUsage(clock)
        # the newest flash checkpoint and the persister's newest problem (set by the job)
        self.checkpoint_step = -1
        self.checkpoint_problem = ""
        self.resume_step = -1  # the checkpoint the master would resume from (the persister keeps it)
        # a stream job: set by its loader; ``stream_stop``: the master ended the job (drained or stopped)
        self.stream_backlog = -1
        self.stream_lag: dict[int, int] = {}
        self.stream_oldest_ms = 0
        self.stream_oldest_by_partition: dict[int, int] = {}
        self.stream_measured_ms = 0
        self.stream_appended: dict[int, int] = {}
        self.stream_busy = -1.0
        self.stream_capacity = -1.0
        self.stream_malformed = 0
        self.stream_queued, self.stream_forwarded_out, self.stream_forwarded_in = -1, 0, 0  # global shuffling
        self.stream_batch, self.stream_queue_upper = 0, 0
        self.stream_intake_spread = -1.0
        self.stream_stop = False
        # with data workers (tidal.data.dispatch): the loader's dispatcher, whose counters go into
        # each report, and the data workers' addresses as of the last answer
        self.data_feed: Any = None
        self.data_workers: list[str] = []
        self.threads_wanted = 0  # torch threads the master asks this trainer to use (0: as it is)
        self.stream_committed: dict[int, int] = {}

    # ------------------------------------------------------------------ the thread
    def start(self, heartbeat_interval_s: float | None = None, incarnation: str = "") -> None:
        """Report from a daemon thread from now on (``heartbeat_interval_s``: the master's;
        ``incarnation``: the master this worker joined, whose reports then count from the first:
        a worker that trains and finishes before its first report would otherwise leave its
        steps unfinalized, the master waiting to know its reports complete)."""
        if heartbeat_interval_s is not None:
            self._heartbeat_interval_s = heartbeat_interval_s
        if incarnation:
            with self._lock:
                self._incarnation = incarnation
        self._thread = threading.Thread(target=self._run, name="tidal-reporter", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (its request in flight, if any, may still end within ``timeout_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self._tick_s):
            self.report_if_due()

    def report_if_due(self) -> None:
        """Send a report if records or pauses waited ``interval_s`` or the heartbeat is due
        (what the thread does every ``tick_s``)."""
        now = self._clock()
        with self._lock:
            have = bool(self._unsent or self._pauses)
        since = now - self._last_sent
        if (have and since >= self._interval_s) or since >= self._heartbeat_interval_s:
            self.flush()
            self._last_sent = now

    def flush(self) -> None:
        """Send a report now (after the thread's request in flight, if any)."""
        with self._send_lock:
            self._send()

    # ------------------------------------------------------------------ what the job tells
    def record_step(self, applied: AppliedStep) -> None:
        """Keep an applied step's records for the master, and this worker's throughput and
        step-time split.

        Called under ``lock``, with the step count already moved to ``applied.step`` (the step
        runner's publish): the reporter never sees the step without its records."""
        if applied.mine:
            wall = applied.finished - applied.started
            rate = applied.mine / max(wall, 1e-9)
            compute = max(wall - applied.collective_s, 0.0) / applied.mine
            a = 0.2 if self._samples_per_s else 1.0
            self._samples_per_s = (1 - a) * self._samples_per_s + a * rate
            self._compute_per_sample = (1 - a) * self._compute_per_sample + a * compute
            comm = min(applied.comm_s, wall)
            self._compute_s = _smooth(self._compute_s, wall - comm)
            self._comm_s = _smooth(self._comm_s, comm)
            if self._prev_end is not None:
                self._data_s = _smooth(self._data_s, max(applied.started - self._prev_end, 0.0))
        if applied.records:
            self._records[applied.step] = applied.records
        self._unsent.extend(r for r in applied.records if r.worker == self._worker_id)
        if self._pause_from is not None:
            self._pauses.append(PauseReport(round=max(self._round, 0), seconds=applied.finished - self._pause_from))
            self._pause_from = None
        self._last_step_end = self._prev_end = applied.finished

    def new_round(self, round_: int, acked_step: int, rollback: bool = False) -> None:
        """The rendezvous put this worker in ``round_`` (before its group forms): closing the
        previous round finalized every step up to ``acked_step``, the source's, so nothing held
        is pending any more, and reports name the new round from now on. ``rollback``: the
        round resumes from a checkpoint of ``acked_step``, and the steps after it come again."""
        with self._lock:
            self._round = round_
            self._acked = acked_step if rollback else max(self._acked, acked_step)
            self._applied_cap = acked_step if rollback else None  # otherwise no member is ahead of the source
            self._unsent = []
            self._records.clear()

    def joined(self, comm: StalledCollective) -> None:
        """The round formed: the master's re-form notices count from now (the last one is
        answered), and a collective of ``comm`` stalled at a re-form is aborted."""
        with self._lock:
            self._reform_notice = False
            self._comm = comm
            self._applied_cap = None

    def left(self, *, pause: bool = False) -> None:
        """The worker left its round; ``pause``: to re-form, so the time until its next applied
        step is a pause the master is told of (it counts from the last applied step)."""
        with self._lock:
            self._comm = None
            self._prev_end = None  # the wait for the next round is a pause, not a data wait
            if pause and self._pause_from is None:
                self._pause_from = self._last_step_end

    # ------------------------------------------------------------------ what the job reads
    @property
    def reform_notice(self) -> bool:
        """The master asked this worker's round to re-form (cleared when the next one forms)."""
        return self._reform_notice

    @property
    def gone(self) -> str | None:
        """Why the master declared this worker failed (a 410 answer), or None."""
        return self._gone

    def held_records(self) -> list[StepRecord]:
        """Every worker's records of the steps this worker applied and the master has not
        acknowledged as final (what a rendezvous or a finish carries)."""
        with self._lock:
            return [r for step in sorted(self._records) if step > self._acked for r in self._records[step]]

    # ------------------------------------------------------------------ one report
    def _send(self) -> None:
        with self._lock:
            unsent, self._unsent = self._unsent, []
            pauses, self._pauses = self._pauses[:MAX_PAUSES_PER_REPORT], self._pauses[MAX_PAUSES_PER_REPORT:]
            applied = self._applied_step()
            if self._applied_cap is not None:
                # a report of the new round before its state is in place must not finalize
                # steps a rollback voided (their records of the new lineage would come "late")
                applied = min(applied, self._applied_cap)
            # records belong to the round they were made in, even after the worker left it
            round_ = self._round
            if len(unsent) > MAX_RECORDS_PER_REQUEST:
                unsent, applied = self._oldest_steps(unsent, applied)
        req = ReportRequest(
            worker_id=self._worker_id, round=round_, applied_step=applied,
            records=unsent, compute_s_per_sample=self._compute_per_sample,
            samples_per_s=self._samples_per_s, pauses=pauses, incarnation=self._incarnation,
            data_s=_bounded(self._data_s), compute_s=_bounded(self._compute_s), comm_s=_bounded(self._comm_s),
            **self._usage.read(), checkpoint_step=self.checkpoint_step,
            checkpoint_problem=self.checkpoint_problem[:1000], stream_backlog=self.stream_backlog,
            stream_malformed=self.stream_malformed, stream_lag=self.stream_lag,
            stream_oldest_ms=self.stream_oldest_ms, stream_oldest_by_partition=self.stream_oldest_by_partition,
            stream_measured_ms=self.stream_measured_ms, stream_appended=self.stream_appended,
            stream_busy=self.stream_busy,
            stream_capacity=self.stream_capacity,
            stream_queued=self.stream_queued, stream_forwarded_out=self.stream_forwarded_out,
            stream_forwarded_in=self.stream_forwarded_in, stream_batch=self.stream_batch,
            stream_queue_upper=self.stream_queue_upper, stream_intake_spread=self.stream_intake_spread,
            **self._data_counts(),
        )
        try:
            resp = self._client.post("/v1/report", req, ReportResponse, patience_s=REPORT_PATIENCE_S)
        except StaleRoundError:
            return  # the round moved on; these records were settled at the rendezvous
        except WorkerGoneError as exc:
            self._gone = str(exc)
            return
        except TidalError as exc:
            log.debug("worker %d: report failed: %s", self._worker_id, exc)
            with self._lock:  # keep them for the next try (a restarted master needs them)
                self._unsent = unsent + self._unsent
                self._pauses = pauses + self._pauses
            return
        with self._lock:
            if self._incarnation and resp.incarnation != self._incarnation:
                # a restarted master lost the records it had not finalized: send ours again
                own = [r for step in sorted(self._records) if step > resp.finalized_step
                       for r in self._records[step] if r.worker == self._worker_id]
                self._unsent = own + [r for r in self._unsent if r not in own]
            self._incarnation = resp.incarnation
            self.stream_stop = self.stream_stop or resp.stop
            self.data_workers = resp.data_workers
            self.threads_wanted = resp.threads
            self.resume_step = resp.resume_step
            if resp.stream_committed:
                self.stream_committed = dict(resp.stream_committed)
            if resp.round == self._round and resp.reform and self._comm is not None:
                self._reform_notice = True
                self._abort_stalled_collective(self._comm)
            if resp.finalized_step > self._acked and resp.round == self._round:
                self._acked = resp.finalized_step
                for s in [s for s in self._records if s <= self._acked]:
                    del self._records[s]

    def _data_counts(self) -> dict[str, Any]:
        feed = self.data_feed
        if feed is None:
            return {}
        import torch  # loaded already: the feed exists only in a training process
        return {"data_received": feed.received, "data_built_here": feed.built_here, "data_taken": feed.taken,
                "data_redispatched": feed.redispatched, "data_dropped": feed.dropped, "data_queued": feed.queued,
                "data_wait_s": round(feed.wait_s, 6), "threads": torch.get_num_threads()}

    def _oldest_steps(self, unsent: list[StepRecord], applied: int) -> tuple[list[StepRecord], int]:
        """After a long outage more records are held than one request may carry: send the oldest
        whole steps and claim no step beyond them (the master finalizes a step once every member
        claims it: a claim ahead of the records sent would finalize the step without them). The
        rest stays for the next report. Called with the lock held."""
        first_left = unsent[MAX_RECORDS_PER_REQUEST].step
        send = [r for r in unsent if r.step < first_left]
        if not send:  # one step with more records than a request takes: cannot happen (one per EST)
            send = unsent[:MAX_RECORDS_PER_REQUEST]
        self._unsent = unsent[len(send):] + self._unsent
        return send, min(applied, send[-1].step)

    def _abort_stalled_collective(self, comm: StalledCollective) -> None:
        """The master re-forms the round while this worker's collective has waited for
        ``STALL_ABORT_S``: a peer is gone (a healthy step-boundary collective takes milliseconds).
        Abort it so the training thread goes to the rendezvous now rather than after the
        collective timeout (NCCL only: see ``RoundComm.abort``)."""
        if comm.stalled_for() >= STALL_ABORT_S and comm.abort():
            log.warning("worker %d: aborted a collective stalled for %.1fs: the round re-forms",
                        self._worker_id, comm.stalled_for())


class ProcessUsage:
    """This process's CPU (percent of one core) and resident memory, measured at most once per
    ``interval_s`` (psutil reads /proc: cheap, but not free at four reports a second)."""

    def __init__(self, clock: Callable[[], float], interval_s: float = 1.0) -> None:
        self._clock, self._interval_s = clock, interval_s
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # the first call only starts the measurement
        self._next = clock() + interval_s
        self._last = {"cpu_percent": 0.0, "rss_bytes": 0}

    def read(self) -> dict[str, Any]:
        now = self._clock()
        if now >= self._next:
            self._next = now + self._interval_s
            try:
                self._last = {"cpu_percent": min(self._proc.cpu_percent(None), 1e5),
                              "rss_bytes": int(self._proc.memory_info().rss)}
            except psutil.Error:  # a report must not fail for want of a measurement
                pass
        return self._last


def _smooth(mean: float | None, value: float) -> float:
    """The running mean kept of each step time: the first value, then a fifth of each new one
    (the smoothing of the throughput above)."""
    return value if mean is None else 0.8 * mean + 0.2 * value


def _bounded(seconds: float | None) -> float:
    """A step time as the report carries it: 0 when not measured, at most the wire's bound (a
    script that stood still for weeks between two steps must not make the report invalid)."""
    return min(seconds or 0.0, MAX_STEP_PART_S)
