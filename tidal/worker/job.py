"""A training process's side of an elastic job: join, rounds, steps, commits, re-forms.

The script's loop stays an ordinary loop::

    job = tidal.worker.init()
    state = job.state(model, optimizer)
    for batch in job.loader(dataset, batch_size=512, epochs=2):
        optimizer.zero_grad()
        loss_fn(model(batch)).backward()
        job.step()                      # reduce gradients, optimizer.step(), commit

Re-forms happen inside ``for`` and ``job.step()``: on a broken collective or the master's
notice, the process leaves the round, rendezvous again, restores (or receives) the committed
state in place and carries on; the loop never sees an exception. Without ``TIDAL_MASTER_URL`` in
the environment the same script runs as one local worker with no master (for debugging).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
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
from tidal.worker.comm import END, EPOCH, REFORM, START, WORKER, N, RoundComm
from tidal.worker.logical import (
    GradientStash,
    Weighting,
    contributions_sent,
    enter_context,
    est_ranks,
    est_seed,
    folds,
    skip_empty_zero_grad,
)
from tidal.worker.placement import choose_backend, model_device
from tidal.worker.state import State

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 0.25


@dataclass
class PendingStep:
    """The step whose batch the script is computing: headers of every worker, this worker's part."""

    step: int
    headers: list[list[int]]  # one row per worker (tidal.worker.comm.HEADER_FIELDS)
    total: int
    mine: int
    started: float
    collective_s: float
    records: list[StepRecord] | None = None  # logical workers: known from the data order
    span: tuple[int, int, int] | None = None  # (epoch, start, end) of this worker's batch


@dataclass
class LogicalStep:
    """One global step of logical workers in this process (see tidal.worker.logical)."""

    pending: PendingStep
    batches: list[tuple[int, int]]  # [start, end) of every logical rank
    weighting: Weighting
    current: int | None = None  # the EST whose batch the script is computing
    buffers_start: list[torch.Tensor] | None = None
    buffers_est0: list[torch.Tensor] | None = None


class Job:
    """Membership in an elastic job (or a local single-worker run when ``client`` is None)."""

    def __init__(self, client: MasterClient | None, worker_id: int, job_id: str, backend: str | None = None) -> None:
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
        self._comm: RoundComm | None = None
        self._in_round = False
        self._pending: PendingStep | None = None
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
        # logical workers (EasyScale ESTs); None: one worker per process
        self.logical: int | None = None
        self.est_seed = 0
        self.checkpoint_dir: str | None = None
        self.local_ests: list[int] = []
        self._est_counts: list[int] = []
        self._stash = GradientStash()
        self._lstep: LogicalStep | None = None
        self._reduction = os.environ.get("TIDAL_REDUCTION", "ordered")

    # ------------------------------------------------------------------ public API
    @property
    def is_local(self) -> bool:
        return self.client is None

    def state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **extras: Any) -> State:
        """Register what is committed, restored and sent to new workers."""
        if self._state is not None:
            raise UsageError("job.state() was already called")
        if self.logical is not None and optimizer is not None:
            skip_empty_zero_grad(optimizer)  # called once per EST, after the stash emptied .grad
        self.device = model_device(list(model.parameters()))
        self.backend, warning = choose_backend(self.device, self._forced_backend,
                                               own_gpu=os.environ.get("TIDAL_OWN_GPU") == "1")
        if warning and self.worker_id == 0:
            print(warning, file=sys.stderr, flush=True)
        self._state = State(model, optimizer, **extras)
        return self._state

    def loader(self, dataset: Any, batch_size: int, epochs: int = 1, **options: Any) -> Any:
        from tidal.worker.loader import ElasticDataLoader

        return ElasticDataLoader(self, dataset, batch_size=batch_size, epochs=epochs, **options)

    @property
    def applied_step(self) -> int:
        return self._state.applied_step if self._state else -1

    def step(self) -> bool:
        """Reduce gradients over the round, ``optimizer.step()``, commit. False if the step was
        dropped by a re-form (its samples go back to the queue; the loop just continues).

        With logical workers the gradient is stashed for the current logical worker and the
        step is applied once every local logical worker has had its turn."""
        state = self._require_state()
        if self._lstep is not None:
            return self._stash_est(state, self._lstep)
        pending = self._pending
        if pending is None:
            raise UsageError("job.step() called without a batch from the elastic loader")
        self._pending = None
        return self._reduce_and_apply(state, pending) == "applied"

    def finish(self, **metrics: float) -> None:
        """Tell the master training is over; ``metrics`` (e.g. ``auc=0.79``) go into its summary.

        The order matters (DESIGN.md 4, "No false success"): the last steps' records first, then
        the final checkpoint (a failure to write it raises here, and the job fails), then the
        finish, which the master accepts only if it agrees that no sample is left.

        Raises:
            tidal.worker.api.FinishRefusedError: the master knows samples that were not trained.
            OSError: the final checkpoint could not be written.
        """
        if self.client is not None:
            self._flush_reports()
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

    # ------------------------------------------------------------------ step internals
    def _require_state(self) -> State:
        if self._state is None:
            raise UsageError("call job.state(model, optimizer) before iterating the loader")
        return self._state

    def _local_step(self, epoch: int, start: int, end: int) -> PendingStep:
        """The step this worker is about to compute (nothing is exchanged before the reduction)."""
        self._check_gone()
        state = self._require_state()
        return PendingStep(state.applied_step + 1, [], 0, end - start, time.monotonic(), 0.0,
                           span=(epoch, start, end))

    def _reduce_and_apply(self, state: State, pending: PendingStep) -> str:
        """One all-reduce carries the gradients and every worker's step header.

        Returns "applied", "epoch_end" (no worker had data: nothing to apply) or "broken".
        A re-form notice in any header is acted on after the step is applied, by everyone.
        """
        assert self._comm is not None and pending.span is not None
        epoch, start, end = pending.span
        params = state.trainable()
        row = [pending.mine, int(self._reform_notice), epoch, start, end, self.worker_id]
        t0 = time.monotonic()
        try:
            # each worker adds its samples' share; dividing by the step's total gives the mean
            headers = self._comm.reduce_with_header(params, float(pending.mine), row)
        except CollectiveError as exc:
            self._broken(exc)
            return "broken"
        rows = headers.tolist()
        total = sum(r[N] for r in rows)
        if total == 0:
            return "epoch_end"
        self._comm.apply_reduced(params, 1.0 / total)
        if state.optimizer is not None:
            state.optimizer.step()
        pending.headers, pending.total = rows, total
        self._applied(state, pending, time.monotonic() - t0)
        if any(r[REFORM] for r in rows):
            self._leave_for_rendezvous("re-form requested by the master")
        return "applied"

    def _empty_step(self, epoch: int) -> str:
        """Take part in a step with no samples of our own (others may still have data)."""
        state = self._require_state()
        if state.optimizer is not None:
            state.optimizer.zero_grad(set_to_none=True)
        return self._reduce_and_apply(state, self._local_step(epoch, 0, 0))

    def _applied(self, state: State, pending: PendingStep, collective_s: float) -> None:
        now = time.monotonic()
        wall = now - pending.started
        if pending.mine:
            rate = pending.mine / max(wall, 1e-9)
            compute = max(wall - collective_s, 0.0) / pending.mine
            a = 0.2 if self._samples_per_s else 1.0
            self._samples_per_s = (1 - a) * self._samples_per_s + a * rate
            self._compute_per_sample = (1 - a) * self._compute_per_sample + a * compute
        if self.client is None:  # a local job: no master keeps a ledger
            records = []
        elif pending.records is not None:
            records = pending.records
        else:
            records = [StepRecord(step=pending.step, worker=h[WORKER], epoch=h[EPOCH], start=h[START], end=h[END])
                       for h in pending.headers if h[N] > 0]
        with self._lock:  # the reporter must never see the step without its records
            state.applied_step = pending.step
            if records:
                self._records[pending.step] = records
            self._unsent.extend(r for r in records if r.worker == self.worker_id)
            if self._pause_from is not None:
                self._pauses.append(PauseReport(round=max(self.round, 0), seconds=now - self._pause_from))
                self._pause_from = None
        state.commit()
        self._last_step_end = now

    # ------------------------------------------------------------------ logical workers
    def _assign_ests(self) -> None:
        if self.logical is None:
            return
        if self.world_size > self.logical:
            raise UsageError(f"{self.world_size} processes for {self.logical} logical workers: "
                             "run with --workers MAX no larger than --logical-workers")
        self.local_ests = est_ranks(self.logical, self.world_size, self.rank)
        self._est_counts = contributions_sent(self.logical, self.world_size)

    def _begin_logical_step(self, epoch: int, batches: list[tuple[int, int]]) -> LogicalStep:
        """The step this process is about to run for its logical workers (nothing is exchanged:
        the step header rides in the reduction at the end of the step)."""
        state = self._require_state()
        self._check_gone()
        sizes = [e - s for s, e in batches]
        mine = sum(sizes[r] for r in self.local_ests)
        pending = PendingStep(state.applied_step + 1, [], sum(sizes), mine, time.monotonic(), 0.0,
                              span=(epoch, 0, 0))
        weighting = Weighting.of(sizes)
        self._stash.begin(weighting, fold=folds(self.rank))
        self._lstep = LogicalStep(pending, batches, weighting)
        return self._lstep

    def _enter_est(self, lstep: LogicalStep, logical_rank: int) -> None:
        """Context switch: the EST's random streams, and the buffers the step started with."""
        state = self._require_state()
        buffers = state.buffers() if len(self.local_ests) > 1 else []  # alone: nothing to undo
        if buffers:
            if lstep.buffers_start is None:
                lstep.buffers_start = [b.detach().clone() for b in buffers]
            else:
                with torch.no_grad():
                    for b, saved in zip(buffers, lstep.buffers_start, strict=True):
                        b.copy_(saved)
        enter_context(self.est_seed, logical_rank, lstep.pending.step)
        lstep.current = logical_rank

    def _stash_est(self, state: State, lstep: LogicalStep) -> bool:
        r = lstep.current
        if r is None:
            raise UsageError("job.step() called twice for one batch")
        self._stash.put(r, state.trainable())
        if r == 0 and len(self.local_ests) > 1 and state.buffers():  # the ESTs after it will change them
            lstep.buffers_est0 = [b.detach().clone() for b in state.buffers()]
        lstep.current = None
        return True

    def _finish_logical_step(self, lstep: LogicalStep) -> bool:
        """Reduce every EST's gradient in logical order, apply, commit."""
        state = self._require_state()
        self._lstep = None
        params = state.trainable()
        for r in self.local_ests:
            s, e = lstep.batches[r]
            if e <= s:  # no data for this EST at this step
                self._stash.put_zeros(r, params)
        assert self._comm is not None and self.logical is not None
        pending = lstep.pending
        assert pending.span is not None
        epoch = pending.span[0]
        row = [pending.mine, int(self._reform_notice), epoch, 0, 0, self.worker_id]
        t0 = time.monotonic()
        try:
            local = self._stash.take()
            after = lstep.weighting.after
            if self._reduction == "allreduce":
                grads, rows = self._comm.reduce_by_allreduce(local, after, row)
            else:
                grads, rows = self._comm.reduce_in_logical_order(local, self._est_counts, after, row)
            # buffers follow EST 0, like DDP's follow rank 0; integer ones (counters, indices)
            # evolve the same everywhere, floating ones (BatchNorm statistics) are sent
            floating = [b for b in state.buffers() if b.is_floating_point()]
            if lstep.buffers_est0 is not None:
                with torch.no_grad():
                    for b, v in zip(state.buffers(), lstep.buffers_est0, strict=True):
                        b.copy_(v)
            self._comm.broadcast_tensors(floating, source=0)
        except CollectiveError as exc:
            self._broken(exc)
            return False
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        if state.optimizer is not None:
            state.optimizer.step()
            # the gradient is spent (as DeepSpeed's engine.step() releases it): the script cannot
            # see it anyway, since this runs inside the loader before its next batch, and its
            # zero_grad() then finds nothing to clear (skip_empty_zero_grad)
            for p in params:
                p.grad = None
        state.epoch_step += 1
        pending.headers = rows
        if self.client is not None:  # for the master's exactly-once ledger (``_applied``)
            holders = {r: rows[p][WORKER] for p in range(self.world_size)
                       for r in est_ranks(self.logical, self.world_size, p)}
            # built from values this worker computed itself: no validation needed on the hot path
            pending.records = [StepRecord.model_construct(step=pending.step, worker=holders[r], epoch=epoch,
                                                          start=s, end=e)
                               for r, (s, e) in enumerate(lstep.batches) if e > s]
        self._applied(state, pending, time.monotonic() - t0)
        if any(r[REFORM] for r in rows):
            self._leave_for_rendezvous("re-form requested by the master")
        return True

    def est_contexts(self) -> list[dict[str, Any]]:
        """Every logical worker's context: what it needs to resume anywhere (tidal.worker.logical)."""
        step = self.applied_step + 1
        return [{"logical_rank": r, "seed": self.est_seed, "next_step": step,
                 "stream_seed": est_seed(self.est_seed, r, step)} for r in range(self.logical or 0)]

    def checkpoint(self, directory: str | None = None) -> str:
        """Write the committed state and every EST's context (all processes hold the same state)."""
        target = directory or self.checkpoint_dir
        if not target:
            raise UsageError("no checkpoint directory: pass one or run with --checkpoint-dir")
        state = self._require_state()
        path = save_checkpoint(target, state.applied_step, state.to_tree(), self.est_contexts())
        return str(path)

    # ------------------------------------------------------------------ rounds
    def ensure_round(self) -> None:
        """Block until this worker is a member of a round with its state in place."""
        if self._in_round:
            return
        state = self._require_state()
        if self.client is None:
            self._comm = RoundComm(0, 1, self.backend, self.device)
            self._in_round = True
            self.round += 1
            self.generation += 1
            self._assign_ests()
            return
        while not self._in_round:
            assignment = self._rendezvous(state)
            try:
                self._enter_round(state, assignment)
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
                raise SystemExit(0)

    def _held_records(self) -> list[StepRecord]:
        """Every worker's records of the steps this worker applied and the master has not
        acknowledged as final (what a rendezvous or a finish carries)."""
        with self._lock:
            return [r for step in sorted(self._records) if step > self._acked for r in self._records[step]]

    def _enter_round(self, state: State, a: RendezvousResponse) -> None:
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
        self._assign_ests()
        log.info("worker %d: round %d rank %d/%d from step %d", self.worker_id, a.round, a.rank,
                 a.world_size, state.applied_step)

    def _broken(self, exc: Exception) -> None:
        log.info("worker %d: collective broke in round %d: %s", self.worker_id, self.round, exc)
        self._failure = str(exc)
        self._leave_for_rendezvous(str(exc))

    def _leave_for_rendezvous(self, why: str) -> None:
        if self._pause_from is None:
            self._pause_from = self._last_step_end
        self._pending = None
        self._lstep = None
        self._leave_round()
        if self._state is not None:
            self._state.restore()

    def _leave_round(self) -> None:
        self._in_round = False
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
            if resp.finalized_step > self._acked and resp.round == self.round:
                self._acked = resp.finalized_step
                for s in [s for s in self._records if s <= self._acked]:
                    del self._records[s]

    def _flush_reports(self) -> None:
        if self.client is not None:
            self._send_report()

    def _check_gone(self) -> None:
        if self._gone:
            print(f"tidal: worker {self.worker_id}: {self._gone}", file=sys.stderr, flush=True)
            os._exit(3)


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
        job = Job(None, 0, "local", backend)
    else:
        token = os.environ.get("TIDAL_TOKEN", "")
        worker_id = int(os.environ.get("TIDAL_WORKER_ID", "0"))
        patience = float(os.environ.get("TIDAL_MASTER_TIMEOUT", "120"))
        client = MasterClient(url, token, patience_s=patience)
        job = Job(client, worker_id, os.environ.get("TIDAL_JOB_ID", "job"), backend)
        info = client.post("/v1/workers/join", JoinRequest(worker_id=worker_id, pid=os.getpid()), JoinResponse)
        job.collective_timeout_s = info.collective_timeout_s
        job.heartbeat_interval_s = info.heartbeat_interval_s
        job.start_reporter()
    job.logical = logical
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
