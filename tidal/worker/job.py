"""A training process's side of an elastic job: join, rounds, re-forms, reports.

The script's loop stays an ordinary loop::

    job = tidal.worker.init()
    state = job.state(model, optimizer)
    for batch in job.loader(dataset, batch_size=512, epochs=2):
        optimizer.zero_grad()
        loss_fn(model(batch)).backward()
        job.step()                      # reduce gradients, optimizer.step(), commit

Re-forms happen inside ``for`` and ``job.step()``: on a broken collective or the master's
notice, the process leaves the round, rendezvous again, restores (or receives) the committed
state in place and carries on; the loop never sees an exception for it. Two decisions of the
master do end the loop, at the next iteration, and neither one silently: a worker scaled in
(or left over when the job finished) raises ``SystemExit(0)``, a worker the master declared
failed raises ``tidal.worker.api.WorkerGoneError`` (``Job.ensure_round`` says why). Without
``TIDAL_MASTER_URL`` in the environment the same script runs as one local worker with no master
(for debugging).

``Job`` owns membership: the rounds, the rendezvous and the reporter thread. Applying a step
(reduction, ``optimizer.step()``, commit; plain or logical workers) belongs to its
``tidal.worker.step.StepRunner``, which the elastic loader drives (``job.steps``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

import torch

from tidal.api import (
    MAX_RECORDS_PER_REQUEST,
    FinishRequest,
    JoinRequest,
    JoinResponse,
    PauseReport,
    RendezvousRequest,
    RendezvousResponse,
    ReportRequest,
    ReportResponse,
    StaleRoundError,
    StepRecord,
    TidalError,
)
from tidal.worker.api import CollectiveError, FinishRefusedError, UsageError, WorkerGoneError
from tidal.worker.checkpoint import save_checkpoint
from tidal.worker.client import MasterClient
from tidal.worker.comm import RoundComm
from tidal.worker.loader import ElasticDataLoader
from tidal.worker.placement import choose_backend, model_device
from tidal.worker.state import State
from tidal.worker.step import AppliedStep, StepRunner

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 0.25
STALL_ABORT_S = 1.0  # a collective waiting this long when the master re-forms waits for a dead peer


class Job:
    """Membership in an elastic job (or a local single-worker run when ``client`` is None).

    The job owns the rounds (rendezvous, the process group, re-forms) and the reporter thread
    (heartbeats, step records, pauses); applying a step belongs to its ``StepRunner``
    (``job.steps``, tidal.worker.step), which tells the job of every applied step, broken
    collective and re-form through ``step_applied``, ``collective_broke`` and
    ``leave_for_rendezvous``.
    """

    def __init__(self, client: MasterClient | None, worker_id: int, job_id: str, backend: str | None = None,
                 *, logical: int | None = None) -> None:
        self.client = client
        self.worker_id = worker_id
        self.job_id = job_id
        # decided by ``state()`` from the model's parameters (tidal.worker.placement)
        self._forced_backend = backend or os.environ.get("TIDAL_COMM_BACKEND") or None
        self.backend = "gloo"
        self.device = torch.device("cpu")
        self.round = -1
        self.rank = 0
        self.world_size = 1
        self.generation = 0  # bumped on every new round; loaders reset their leases
        self._state: State | None = None
        self._steps: StepRunner | None = None
        self._comm: RoundComm | None = None
        self._in_round = False
        self._reform_notice = False
        self._pause_from: float | None = None
        self._last_step_end = time.monotonic()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._records: dict[int, list[StepRecord]] = {}  # every worker's records of applied, unacked steps
        self._unsent: list[StepRecord] = []  # this worker's records not yet sent
        self._acked = -1
        self._incarnation = ""
        self._pauses: list[PauseReport] = []
        self._samples_per_s = 0.0
        self._compute_per_sample = 0.0
        self.collective_timeout_s = 60.0
        self.heartbeat_interval_s = 0.5
        self._stop = threading.Event()
        self._reporter: threading.Thread | None = None
        self._gone: str | None = None
        self._failure = ""  # why this worker last left a round, for the master (see _rendezvous)
        self.logical = logical  # logical workers (EasyScale ESTs); None: one worker per process
        self.checkpoint_dir: str | None = None

    # ------------------------------------------------------------------ public API
    @property
    def is_local(self) -> bool:
        return self.client is None

    def state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **extras: Any) -> State:
        """Register what is committed, restored and sent to new workers.

        Raises:
            tidal.worker.api.UsageError: called twice, or ``TIDAL_REDUCTION`` names no reduction.
        """
        if self._state is not None:
            raise UsageError("job.state() was already called")
        self.device = model_device(list(model.parameters()))
        self.backend, warning = choose_backend(self.device, self._forced_backend,
                                               own_gpu=os.environ.get("TIDAL_OWN_GPU") == "1")
        if warning and self.worker_id == 0:
            print(warning, file=sys.stderr, flush=True)
        state = State(model, optimizer, **extras)
        self._steps = StepRunner(state, self, worker_id=self.worker_id, lock=self._lock, logical=self.logical,
                                 ledger=self.client is not None,
                                 reduction=os.environ.get("TIDAL_REDUCTION", "ordered"))
        self._state = state
        return state

    @property
    def steps(self) -> StepRunner:
        """The owner of applying steps (tidal.worker.step); the elastic loader drives it.

        Raises:
            tidal.worker.api.UsageError: ``job.state()`` was not called yet.
        """
        if self._steps is None:
            raise UsageError("call job.state(model, optimizer) before iterating the loader")
        return self._steps

    def loader(self, dataset: Any, batch_size: int, epochs: int = 1, **options: Any) -> ElasticDataLoader:
        """An elastic data loader over ``dataset`` (tidal.worker.loader.ElasticDataLoader)."""
        return ElasticDataLoader(self, dataset, batch_size=batch_size, epochs=epochs, **options)

    @property
    def applied_step(self) -> int:
        return self._state.applied_step if self._state else -1

    def step(self) -> bool:
        """Reduce gradients over the round, ``optimizer.step()``, commit. False if the step was
        dropped by a re-form (its samples go back to the queue; the loop just continues).

        With logical workers the gradient is stashed for the current logical worker and the
        step is applied once every local logical worker has had its turn.

        Raises:
            tidal.worker.api.UsageError: no batch of the elastic loader waits for this call.
        """
        return self.steps.step()

    def finish(self, **metrics: float) -> None:
        """Tell the master training is over; ``metrics`` (e.g. ``auc=0.79``) go into its summary.

        The order matters (DESIGN.md 4, "No false success"): the last steps' records first, then
        the final checkpoint (a failure to write it raises here, and the job fails), then the
        finish, which the master accepts only if it agrees that no sample is left.

        Raises:
            tidal.worker.api.FinishRefusedError: the master knows samples that were not trained.
            tidal.worker.api.WorkerGoneError: the master declared this worker failed.
            OSError: the final checkpoint could not be written.
        """
        if self.client is not None:
            self._flush_reports()
            self._check_gone()  # a failed worker's state is not the job's: no checkpoint of it
        if self.checkpoint_dir and self.rank == 0 and self._state is not None and self._state.applied_step >= 0:
            self.checkpoint()
        if self.client is not None:
            held = self._held_records()[-MAX_RECORDS_PER_REQUEST:]
            req = FinishRequest(worker_id=self.worker_id, metrics={k: float(v) for k, v in metrics.items()},
                                applied_step=self.applied_step, records=held)
            try:
                self.client.post_raw("/v1/finish", req)
            except StaleRoundError as exc:  # 409: the master's ledger says the data is not exhausted
                raise FinishRefusedError(f"the master refused to finish the job: {exc}") from None
        self._leave_round()

    def close(self) -> None:
        self._stop.set()
        if self._reporter is not None:
            self._reporter.join(timeout=2)
        self._leave_round()

    def est_contexts(self) -> list[dict[str, Any]]:
        """Every logical worker's context: what it needs to resume anywhere (tidal.worker.logical)."""
        return self._steps.est_contexts() if self._steps is not None else []

    def checkpoint(self, directory: str | None = None) -> str:
        """Write the committed state and every EST's context (all processes hold the same state)."""
        target = directory or self.checkpoint_dir
        if not target:
            raise UsageError("no checkpoint directory: pass one or run with --checkpoint-dir")
        state = self.steps.state
        path = save_checkpoint(target, state.applied_step, state.to_tree(), self.est_contexts())
        return str(path)

    # ------------------------------------------------------------------ what the step runner tells
    @property
    def reform_notice(self) -> bool:
        """The master asked this worker to re-form (set by the reporter, cleared by a new round)."""
        return self._reform_notice

    def step_applied(self, applied: AppliedStep) -> None:
        """Keep an applied step's records for the master and this worker's throughput.

        Called by the step runner under ``self._lock``, with ``state.applied_step`` already
        moved to ``applied.step``: the reporter never sees the step without its records."""
        if applied.mine:
            wall = applied.finished - applied.started
            rate = applied.mine / max(wall, 1e-9)
            compute = max(wall - applied.collective_s, 0.0) / applied.mine
            a = 0.2 if self._samples_per_s else 1.0
            self._samples_per_s = (1 - a) * self._samples_per_s + a * rate
            self._compute_per_sample = (1 - a) * self._compute_per_sample + a * compute
        if applied.records:
            self._records[applied.step] = applied.records
        self._unsent.extend(r for r in applied.records if r.worker == self.worker_id)
        if self._pause_from is not None:
            self._pauses.append(PauseReport(round=max(self.round, 0), seconds=applied.finished - self._pause_from))
            self._pause_from = None
        self._last_step_end = applied.finished

    def collective_broke(self, exc: CollectiveError) -> None:
        """A collective failed (a peer died or left): re-form, telling the master why."""
        log.info("worker %d: collective broke in round %d: %s", self.worker_id, self.round, exc)
        self._failure = str(exc)
        self.leave_for_rendezvous(str(exc))

    def leave_for_rendezvous(self, why: str) -> None:
        """Leave the round now: the step in flight is dropped and the committed state restored;
        the next ``ensure_round`` (the loader's next iteration) rendezvous again."""
        log.debug("worker %d leaves round %d: %s", self.worker_id, self.round, why)
        if self._pause_from is None:
            self._pause_from = self._last_step_end
        self._leave_round()
        if self._state is not None:
            self._state.restore()

    # ------------------------------------------------------------------ rounds
    def ensure_round(self) -> None:
        """Block until this worker is a member of a round with its state in place.

        The elastic loader calls it before every step, so it is also where the decisions that
        end this worker's training reach the training thread (the reporter thread learns them
        but cannot act on the script's behalf).

        Raises:
            tidal.worker.api.UsageError: ``job.state()`` was not called, or the round has more
                processes than logical workers.
            tidal.worker.api.WorkerGoneError: the master declared this worker failed (it missed
                its heartbeats, or hung): its replacement may already train on its data, so
                this process must not train on. The reporter and the round are closed first.
            SystemExit: with status 0, when the master scales this worker in or the job has
                finished without it: the process has nothing left to do, and the master counts
                an exit 0 as a clean leave (the script's ``finally`` blocks still run).
        """
        self._check_gone()
        if self._in_round:
            return
        steps = self.steps
        state = steps.state
        if self.client is None:
            self._comm = RoundComm(0, 1, self.backend, self.device)
            self._in_round = True
            self.round += 1
            self.generation += 1
            steps.enter_round(self._comm, 0, 1)
            return
        while not self._in_round:
            assignment = self._rendezvous(state)
            try:
                self._enter_round(steps, assignment)
            except CollectiveError as exc:
                log.warning("worker %d: round %d failed to form: %s", self.worker_id, assignment.round, exc)
                self._failure = f"round {assignment.round} failed to form: {exc}"
                self._leave_round()

    def _rendezvous(self, state: State) -> RendezvousResponse:
        assert self.client is not None
        records = self._held_records()
        # why it left its round (a collective that failed, a group that did not form): the master
        # fails the job when rounds keep failing before a step (the crash loop of the runtime)
        failure, self._failure = self._failure[:1000], ""
        req = RendezvousRequest(worker_id=self.worker_id, after_round=self.round,
                                applied_step=state.applied_step, records=records, failure=failure)
        while True:
            self._check_gone()
            try:
                resp = self.client.post("/v1/rendezvous", req, RendezvousResponse)
            except StaleRoundError:
                # a restarted master lost a round it never journaled; start over from it
                req.after_round = -1
                continue
            if resp.status == "ready":
                return resp
            if resp.status in ("leave", "finished"):
                why = "scaled in" if resp.status == "leave" else "the job has finished"
                log.info("worker %d exits: %s", self.worker_id, why)
                print(f"tidal: worker {self.worker_id} exits: {why}", file=sys.stderr, flush=True)
                self.close()
                raise SystemExit(0)  # see ensure_round: a clean leave

    def _held_records(self) -> list[StepRecord]:
        """Every worker's records of the steps this worker applied and the master has not
        acknowledged as final (what a rendezvous or a finish carries)."""
        with self._lock:
            return [r for step in sorted(self._records) if step > self._acked for r in self._records[step]]

    def _enter_round(self, steps: StepRunner, a: RendezvousResponse) -> None:
        state = steps.state
        self._leave_round()
        # from here on this worker belongs to round ``a.round``: if forming it fails, the next
        # rendezvous names it, and the master re-forms instead of handing out the same round
        self.round = a.round
        with self._lock:
            # closing the round finalized every step up to the source's: nothing held is pending
            self._acked = max(self._acked, a.applied_step)
            self._unsent = []
            self._records.clear()
        assert self.client is not None
        self._comm = RoundComm.connect(
            url=self.client.url, token=self.client.token,
            prefix=f"tidal/{self.job_id}/round{a.round}/", rank=a.rank, world_size=a.world_size,
            backend=self.backend, device=self.device, timeout_s=self.collective_timeout_s,
        )
        self.rank, self.world_size = a.rank, a.world_size
        if a.sync_state:
            if a.rank == a.source_rank:
                state.restore()
            tree = self._comm.broadcast_state(state.to_tree() if a.rank == a.source_rank else None, a.source_rank)
            if a.rank != a.source_rank:
                state.load_tree(tree)  # type: ignore[arg-type]
        else:
            state.restore()
        self._reform_notice = False
        self._in_round = True
        self.generation += 1
        steps.enter_round(self._comm, a.rank, a.world_size)
        log.info("worker %d: round %d rank %d/%d from step %d", self.worker_id, a.round, a.rank,
                 a.world_size, state.applied_step)

    def _leave_round(self) -> None:
        self._in_round = False
        if self._steps is not None:
            self._steps.leave_round()
        if self._comm is not None:
            self._comm.close()
            self._comm = None

    # ------------------------------------------------------------------ reporting
    def start_reporter(self) -> None:
        self._reporter = threading.Thread(target=self._report_loop, name="tidal-reporter", daemon=True)
        self._reporter.start()

    def _report_loop(self) -> None:
        """Heartbeat and step records, batched: one request per REPORT_INTERVAL_S at most.

        Records are not urgent (a step is final once every member reported it; the last ones
        are flushed by ``finish``), so a worker with 50 steps/s still sends 4 requests/s.
        """
        last = 0.0
        while not self._stop.wait(0.05):
            now = time.monotonic()
            with self._lock:
                have = bool(self._unsent or self._pauses)
            if (have and now - last >= REPORT_INTERVAL_S) or now - last >= self.heartbeat_interval_s:
                self._send_report()
                last = now

    def _send_report(self) -> None:
        with self._send_lock:  # a flush waits for the reporter's request in flight
            self._send_report_locked()

    def _send_report_locked(self) -> None:
        assert self.client is not None
        with self._lock:
            unsent, self._unsent = self._unsent, []
            pauses, self._pauses = self._pauses, []
            applied = self.applied_step
        # records belong to the round they were made in, even after the worker left it
        req = ReportRequest(
            worker_id=self.worker_id, round=self.round, applied_step=applied,
            records=unsent, compute_s_per_sample=self._compute_per_sample,
            samples_per_s=self._samples_per_s, pauses=pauses, incarnation=self._incarnation,
        )
        try:
            resp = self.client.post("/v1/report", req, ReportResponse, patience_s=0.5)
        except StaleRoundError:
            return  # the round moved on; these records were settled at the rendezvous
        except WorkerGoneError as exc:
            self._gone = str(exc)
            return
        except TidalError as exc:
            log.debug("report failed: %s", exc)
            with self._lock:  # keep them for the next try (a restarted master needs them)
                self._unsent = unsent + self._unsent
                self._pauses = pauses + self._pauses
            return
        with self._lock:
            if self._incarnation and resp.incarnation != self._incarnation:
                # a restarted master lost the records it had not finalized: send ours again
                own = [r for step in sorted(self._records) if step > resp.finalized_step
                       for r in self._records[step] if r.worker == self.worker_id]
                self._unsent = own + [r for r in self._unsent if r not in own]
            self._incarnation = resp.incarnation
            if resp.round == self.round and resp.reform and self._in_round:
                self._reform_notice = True
                self._abort_stalled_collective()
            if resp.finalized_step > self._acked and resp.round == self.round:
                self._acked = resp.finalized_step
                for s in [s for s in self._records if s <= self._acked]:
                    del self._records[s]

    def _abort_stalled_collective(self) -> None:
        """The master re-forms the round while this worker's collective has waited for
        ``STALL_ABORT_S``: a peer is gone (a healthy step-boundary collective takes milliseconds).
        Abort it so the training thread goes to the rendezvous now rather than after the
        collective timeout (NCCL only: see ``RoundComm.abort``)."""
        comm = self._comm
        if comm is not None and comm.stalled_for() >= STALL_ABORT_S and comm.abort():
            log.warning("worker %d: aborted a collective stalled for %.1fs: the round re-forms",
                        self.worker_id, comm.stalled_for())

    def _flush_reports(self) -> None:
        if self.client is not None:
            self._send_report()

    def _check_gone(self) -> None:
        """Raise ``WorkerGoneError`` in the training thread once the reporter learned that the
        master declared this worker failed (see ``ensure_round``)."""
        gone = self._gone
        if gone:
            log.warning("worker %d: %s", self.worker_id, gone)
            self.close()
            raise WorkerGoneError(f"worker {self.worker_id} must stop training: {gone}")


def init(backend: str | None = None, *, logical_workers: int | None = None,
         checkpoint_dir: str | None = None, determinism: str | None = None) -> Job:
    """Join the job named by the ``TIDAL_*`` environment, or start a local single-worker job.

    Args:
        backend: force "gloo" or "nccl" (also ``TIDAL_COMM_BACKEND``); by default it follows the
            model's parameters: gloo on the CPU, nccl on a GPU of the worker's own, gloo over
            CUDA tensors where workers share a GPU (tidal.worker.placement).
        logical_workers: train this many logical workers whatever the number of processes
            (``tidal run --logical-workers N`` sets it too; the two must agree).
        checkpoint_dir: where ``job.checkpoint()`` and the final checkpoint go.
        determinism: "D0", "D1" or "D2" (tidal.worker.logical); D1 with logical workers.

    Raises:
        tidal.worker.api.MasterUnreachableError: the master did not answer in time.
        tidal.worker.api.UsageError: the arguments contradict the job's settings.
    """
    logical = _agree("logical workers", logical_workers, os.environ.get("TIDAL_LOGICAL_WORKERS"), int)
    checkpoints = _agree("checkpoint directory", checkpoint_dir, os.environ.get("TIDAL_CHECKPOINT_DIR"), str)
    level = _agree("determinism", determinism, os.environ.get("TIDAL_DETERMINISM"), str)
    if level is None and logical is not None:
        level = "D1"
    if logical is not None and logical < 1:
        raise UsageError(f"logical workers must be at least 1, got {logical}")
    if level is not None:
        _pin_determinism(level)
    url = os.environ.get("TIDAL_MASTER_URL")
    if not url:
        job = Job(None, 0, "local", backend, logical=logical)
    else:
        token = os.environ.get("TIDAL_TOKEN", "")
        worker_id = int(os.environ.get("TIDAL_WORKER_ID", "0"))
        patience = float(os.environ.get("TIDAL_MASTER_TIMEOUT", "120"))
        client = MasterClient(url, token, patience_s=patience)
        job = Job(client, worker_id, os.environ.get("TIDAL_JOB_ID", "job"), backend, logical=logical)
        info = client.post("/v1/workers/join", JoinRequest(worker_id=worker_id, pid=os.getpid()), JoinResponse)
        job.collective_timeout_s = info.collective_timeout_s
        job.heartbeat_interval_s = info.heartbeat_interval_s
        job.start_reporter()
    job.checkpoint_dir = checkpoints
    return job


def _agree(what: str, given: Any, env: str | None, kind: type) -> Any:
    from_env = kind(env) if env else None
    if given is not None and from_env is not None and given != from_env:
        raise UsageError(f"the script asks for {what} {given!r}, the job was started with {from_env!r}")
    return given if given is not None else from_env


def _pin_determinism(level: str) -> None:
    """D0: deterministic kernels; D1 and D2 also pin the intra-op thread count (tidal.worker.logical)."""
    if level not in ("D0", "D1", "D2"):
        raise UsageError(f"determinism must be D0, D1 or D2, got {level!r}")
    torch.use_deterministic_algorithms(True)
    # The flag also fills every torch.empty with NaN, which makes no kernel deterministic (it
    # exposes reads of uninitialized memory, a bug in the program) and cost 1-3% of the example's
    # throughput; PyTorch's docs say a valid program may turn it off and stay deterministic.
    # TIDAL_FILL_UNINITIALIZED=1 turns it back on, to hunt such a bug.
    torch.utils.deterministic.fill_uninitialized_memory = os.environ.get(  # type: ignore[attr-defined]
        "TIDAL_FILL_UNINITIALIZED", "0") == "1"
    if level in ("D1", "D2"):
        torch.set_num_threads(int(os.environ.get("TIDAL_THREADS", "1")))
