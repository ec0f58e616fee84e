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

``Job`` owns membership: the rounds and the rendezvous. Applying a step (reduction,
``optimizer.step()``, commit; plain or logical workers) belongs to its
``tidal.worker.step.StepRunner``, which the elastic loader drives (``job.steps``); reporting to
the master (heartbeats, step records, pauses) to its ``tidal.worker.reporter.Reporter``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tidal.api import (
    MAX_RECORDS_PER_REQUEST,
    PS_WATERMARK,
    FinishRequest,
    JoinRequest,
    JoinResponse,
    RendezvousRequest,
    RendezvousResponse,
    RestoreFailure,
    StaleRoundError,
    parse_every,
)
from tidal.api.errors import PermanentError, RetryableError
from tidal.api.shm import worker_checkpoint_name
from tidal.worker.api import CollectiveError, FinishRefusedError, StepHook, UsageError, WorkerGoneError
from tidal.worker.checkpoint import CheckpointError, save_checkpoint
from tidal.worker.client import MasterClient
from tidal.worker.comm import RoundComm
from tidal.worker.flash import PeriodicCheckpoint, load_step
from tidal.worker.loader import ElasticDataLoader
from tidal.worker.placement import choose_backend, model_device
from tidal.worker.reporter import Reporter
from tidal.worker.state import State
from tidal.worker.step import AppliedStep, StepRunner

log = logging.getLogger(__name__)


class Job:
    """Membership in an elastic job (or a local single-worker run when ``client`` is None).

    The job owns the rounds (rendezvous, the process group, re-forms); applying a step belongs
    to its ``StepRunner`` (``job.steps``, tidal.worker.step), which tells the job of every
    applied step, broken collective and re-form through ``step_applied``, ``collective_broke``
    and ``leave_for_rendezvous``; with a master, reporting belongs to its ``Reporter``
    (tidal.worker.reporter), which the job tells of the rounds and the applied steps.
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
        self._reform_asked: str | None = None  # ask_reform's why, until this worker leaves the round
        # the step runner moves the step count and hands the step's records to the reporter
        # under this lock; the reporter reads both under it (tidal.worker.reporter)
        self._lock = threading.Lock()
        self._reporter = Reporter(client, worker_id, lock=self._lock, applied_step=lambda: self.applied_step) \
            if client is not None else None
        self.collective_timeout_s = 60.0
        self._failure = ""  # why this worker last left a round, for the master (see _rendezvous)
        self.logical = logical  # logical workers (EasyScale ESTs); None: one worker per process
        self.checkpoint_dir: str | None = None
        self.periodic_checkpoint: PeriodicCheckpoint | None = None  # --checkpoint-every
        self.lineage = 0  # the job's rollbacks so far, written into every checkpoint (tidal.master.checkpoints)
        # a stream job (tidal.worker.stream_loader): this round's partitions and the packed id each
        # is committed up to, the ranges committed beyond it, and the partitions its loader sees
        # (told to the master at rendezvous)
        self.stream_assignment: dict[int, int] = {}
        self.stream_skip: dict[int, list[list[int]]] = {}
        self.stream_partitions: list[int] = []
        # the loader's look at the stream's partitions now (a stream job), taken before every
        # rendezvous so that the master never assigns from a view a discovery period old
        self.stream_view: Callable[[], list[int]] | None = None
        self._restore_failed: RestoreFailure | None = None  # for the master, with the next rendezvous
        # the job's parameter servers (``tidal run --ps``): their addresses by server index and the
        # virtual shard map, as of this round (tidal.ps)
        self.ps_servers: list[str] = []
        self.ps_shard_map: list[int] = []
        # launched as a data worker (``TIDAL_ROLE=data``, tidal.data.worker): ``loader()`` serves
        # batches instead of training, and never returns
        self.is_data_worker = False

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

    def add_step_hook(self, hook: StepHook) -> None:
        """Update ``hook`` in step with the model (tidal.worker.api.StepHook).

        Raises:
            tidal.worker.api.UsageError: ``job.state()`` was not called yet, or a hook of that
                name is registered already.
        """
        steps = self.steps
        if any(h.name == hook.name for h in steps.hooks):
            raise UsageError(f"a step hook named {hook.name!r} is registered already")
        steps.hooks.append(hook)

    @property
    def steps(self) -> StepRunner:
        """The owner of applying steps (tidal.worker.step); the elastic loader drives it.

        Raises:
            tidal.worker.api.UsageError: ``job.state()`` was not called yet.
        """
        if self._steps is None:
            raise UsageError("call job.state(model, optimizer) before iterating the loader")
        return self._steps

    def loader(self, dataset: Any = None, batch_size: int | None = None, epochs: int = 1, *, stream: Any = None,
               decode: Any = None, **options: Any) -> Any:
        """An elastic data loader over ``dataset`` (tidal.worker.loader.ElasticDataLoader), or over
        a stream (tidal.worker.stream_loader.StreamLoader: ``stream`` a URL or a ``StreamSource``,
        default the job's ``--stream``; ``decode(records) -> (batch, malformed positions)``).

        Raises:
            tidal.worker.api.UsageError: both or neither of a dataset and a stream, or no batch size.
        """
        if batch_size is None:
            raise UsageError("job.loader() needs batch_size (samples per worker per step)")
        if stream is None and dataset is None and os.environ.get("TIDAL_STREAM_URL"):
            stream = os.environ["TIDAL_STREAM_URL"]
        if (stream is None) == (dataset is None):
            raise UsageError("job.loader() takes a dataset or a stream (one of the two)")
        if self.is_data_worker:
            if stream is not None or dataset is None:
                raise UsageError("data workers build batches of a dataset (job.loader(dataset, ...)), not of a stream")
            from tidal.data.partition import resolve_preprocess
            from tidal.data.worker import serve_loader

            try:
                preprocess = resolve_preprocess(options.get("preprocess"), options.get("fallback"),
                                                lambda: self.steps.state.model,
                                                lambda m: print(f"tidal: {m}", file=sys.stderr, flush=True))
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            serve_loader(dataset, preprocess, options.get("collate_fn"))
        if stream is not None:
            from tidal.worker.stream_loader import StreamLoader

            if decode is None:
                raise UsageError("job.loader(stream=...) needs decode=fn(records) -> (batch, malformed positions)")
            return StreamLoader(self, stream, batch_size=batch_size, decode=decode, **options)
        return ElasticDataLoader(self, dataset, batch_size=batch_size, epochs=epochs, **options)

    def data_worker_addresses(self) -> list[str]:
        """The job's data workers now (tidal.data.dispatch reads it before each batch)."""
        return self._reporter.data_workers if self._reporter is not None else []

    def threads_wanted(self) -> int:
        """The torch threads the master's data-worker tuner asks this trainer to use (0: as it is)."""
        return self._reporter.threads_wanted if self._reporter is not None else 0

    def note_data_feed(self, feed: Any) -> None:
        """The loader's dispatcher: its counters go into the reports (queue, rates, waits)."""
        if self._reporter is not None:
            self._reporter.data_feed = feed

    def note_stream(self, lag: dict[int, int], oldest_ms: dict[int, int], busy: float, malformed: int,
                    shuffle: tuple[int, int, int] = (-1, 0, 0), capacity: float = -1.0, *,
                    batch: int = 0, queue_upper: int = 0, appended: dict[int, int] | None = None,
                    intake_spread: float = -1.0) -> None:
        """A stream loader's records waiting per partition, the arrival of the oldest waiting in
        each (where one waits), its busy share, the records/s it trained while busy (``capacity``,
        -1: unknown) and its malformed records, for the master's next report; with global
        shuffling, the records in its local queue and those it forwarded and received; the
        records a step takes and the local queue's upper threshold (0: no shuffling); the records
        ever appended to each partition (``appended``: the master's arrival rate); with global
        shuffling, the spread of its steps' intake (``ShuffleUnit.intake_spread``; -1: unknown)."""
        if self._reporter is not None:
            r = self._reporter
            r.stream_lag, r.stream_backlog, r.stream_malformed = lag, sum(lag.values()), malformed
            r.stream_oldest_by_partition, r.stream_busy, r.stream_capacity = oldest_ms, busy, capacity
            r.stream_oldest_ms = min(oldest_ms.values(), default=0)
            r.stream_measured_ms = int(time.time() * 1000)
            r.stream_appended = dict(appended or {})
            r.stream_queued, r.stream_forwarded_out, r.stream_forwarded_in = shuffle
            r.stream_batch, r.stream_queue_upper = batch, queue_upper
            r.stream_intake_spread = intake_spread

    def round_store(self) -> Any:
        """A client of this round's store (``tidal.worker.store.MasterStore``) on a connection of
        its own, for a background thread; None outside a round or in a local run."""
        comm = self._comm
        return comm.store.clone() if comm is not None and comm.store is not None else None

    @property
    def token(self) -> str:
        """The job's secret: what the data planes between workers check (global shuffling)."""
        return self.client.token if self.client is not None else ""

    @property
    def stream_committed(self) -> dict[int, int]:
        """``--trim-after-commit``: the committed positions of this worker's partitions (packed ids)."""
        return dict(self._reporter.stream_committed) if self._reporter is not None else {}

    @property
    def stop_requested(self) -> bool:
        """The master ended this stream job (drained, or stopped): finish at this step boundary."""
        return self._reporter is not None and self._reporter.stream_stop

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
        if self._reporter is not None:
            self._reporter.flush()
            self._check_gone()  # a failed worker's state is not the job's: no checkpoint of it
        if self.periodic_checkpoint is not None:  # its persister first: it may be writing this very step
            self.periodic_checkpoint.close()
        if self.checkpoint_dir and self.rank == 0 and self._state is not None and self._state.applied_step >= 0:
            final = Path(self.checkpoint())
            if self.periodic_checkpoint is not None:
                self.periodic_checkpoint.prune_to(final)
        if self.client is not None and self._reporter is not None:
            held = self._reporter.held_records()[-MAX_RECORDS_PER_REQUEST:]
            req = FinishRequest(worker_id=self.worker_id, metrics={k: float(v) for k, v in metrics.items()},
                                applied_step=self.applied_step, records=held)
            try:
                self.client.post_raw("/v1/finish", req)
            except StaleRoundError as exc:  # 409: the master's ledger says the data is not exhausted
                raise FinishRefusedError(f"the master refused to finish the job: {exc}") from None
        self._leave_round()

    def close(self) -> None:
        if self._reporter is not None:
            self._reporter.stop()
        self._leave_round()
        if self.periodic_checkpoint is not None:
            self.periodic_checkpoint.close()

    def est_contexts(self) -> list[dict[str, Any]]:
        """Every logical worker's context: what it needs to resume anywhere (tidal.worker.logical)."""
        return self._steps.est_contexts() if self._steps is not None else []

    def checkpoint(self, directory: str | None = None) -> str:
        """Write the committed state and every EST's context (all processes hold the same state)."""
        target = directory or self.checkpoint_dir
        if not target:
            raise UsageError("no checkpoint directory: pass one or run with --checkpoint-dir")
        state = self.steps.state
        path = save_checkpoint(target, state.applied_step, self._checkpoint_tree(state), self.est_contexts())
        return str(path)

    def _checkpoint_tree(self, state: State) -> dict[str, Any]:
        """The committed state and, under ``hooks``, what each step hook holds beside it (the
        parameter servers' tables)."""
        tree = state.to_tree()
        if self.steps.hooks:
            tree["hooks"] = {h.name: h.checkpoint_tree() for h in self.steps.hooks}
        return tree

    # ------------------------------------------------------------------ what the step runner tells
    @property
    def reform_notice(self) -> bool:
        """This worker's round must re-form: the master asked (set by the reporter) or this worker
        did (``ask_reform``); cleared when it leaves the round. The step header carries it to every member."""
        return self._reform_asked is not None or (self._reporter is not None and self._reporter.reform_notice)

    def ask_reform(self, why: str) -> None:
        """Re-form after the next step, every member at once: the flag rides in this worker's
        step header (``reform_notice``) and the step runner leaves after applying the step in
        which any member raised it. A worker that left alone between steps (as the stream loader
        once did on a partition it saw disappear) left its peers waiting in that step's collective
        until the collective timeout (60 s), and the master replaced one of them as failed."""
        if self._reform_asked is None:
            log.info("worker %d asks round %d to re-form: %s", self.worker_id, self.round, why)
            self._reform_asked = why

    def step_applied(self, applied: AppliedStep) -> None:
        """Hand an applied step to the reporter (its records, this worker's throughput, the end
        of a pause); a local run keeps nothing.

        Called by the step runner under ``self._lock``, with ``state.applied_step`` already
        moved to ``applied.step``: the reporter never sees the step without its records."""
        if self._reporter is not None:
            self._reporter.record_step(applied)
        periodic = self.periodic_checkpoint
        if periodic is not None and self.rank == 0 and self._state is not None and periodic.due(applied.step):
            # rank 0 holds the state every member holds; the copy is the only time training waits
            # (with parameter servers, also their export of the tables)
            try:
                tree = self._checkpoint_tree(self._state)
            except RetryableError as exc:  # a server lost: the round re-forms, the last checkpoint stays
                periodic.problem = f"checkpoint of step {applied.step} not taken: {exc}"
                return
            meta = {"job_id": self.job_id, "step": applied.step, "round": self.round, "world_size": self.world_size,
                    "worker_id": self.worker_id, "lineage": self.lineage}
            if self._reporter is not None:
                # the master's resume candidate: --checkpoint-keep never deletes it nor a newer one
                # (the master learns of checkpoints a report late: the newest few may all be newer)
                meta["keep_from"] = self._reporter.resume_step
            periodic.save(applied.step, tree, self.est_contexts(), meta)
            if self._reporter is not None:
                self._reporter.checkpoint_step, self._reporter.checkpoint_problem = periodic.step, periodic.problem

    def collective_broke(self, exc: CollectiveError) -> None:
        """A collective failed (a peer died or left): re-form, telling the master why."""
        log.info("worker %d: collective broke in round %d: %s", self.worker_id, self.round, exc)
        self._failure = str(exc)
        self.leave_for_rendezvous(str(exc))

    def leave_for_rendezvous(self, why: str) -> None:
        """Leave the round now: the step in flight is dropped and the committed state restored;
        the next ``ensure_round`` (the loader's next iteration) rendezvous again."""
        log.debug("worker %d leaves round %d: %s", self.worker_id, self.round, why)
        self._leave_round(pause=True)
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
        assert self.client is not None and self._reporter is not None
        records = self._reporter.held_records()
        # why it left its round (a collective that failed, a group that did not form): the master
        # fails the job when rounds keep failing before a step (the crash loop of the runtime)
        failure, self._failure = self._failure[:1000], ""
        restore_failed, self._restore_failed = self._restore_failed, None
        if self.stream_view is not None:
            try:
                self.stream_partitions = self.stream_view()
            except Exception as exc:  # the stream unavailable (a Redis restart): the last view stands
                log.debug("worker %d: listing the stream's partitions failed: %s", self.worker_id, exc)
        req = RendezvousRequest(worker_id=self.worker_id, after_round=self.round,
                                applied_step=state.applied_step, records=records, failure=failure,
                                restore_failed=restore_failed, stream_partitions=self.stream_partitions,
                                ps_watermark=_watermark(state.extras.get(PS_WATERMARK), state.applied_step))
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

    def _enter_round(self, steps: StepRunner, a: RendezvousResponse) -> None:
        state = steps.state
        self._leave_round()
        # from here on this worker belongs to round ``a.round``: if forming it fails, the next
        # rendezvous names it, and the master re-forms instead of handing out the same round
        self.round = a.round
        assert self.client is not None and self._reporter is not None
        # closing the round finalized every step up to the source's: nothing held is pending
        self._reporter.new_round(a.round, a.applied_step, rollback=a.restore)
        self._comm = RoundComm.connect(
            url=self.client.url, token=self.client.token,
            prefix=f"tidal/{self.job_id}/round{a.round}/", rank=a.rank, world_size=a.world_size,
            backend=self.backend, device=self.device, timeout_s=self.collective_timeout_s,
        )
        self.rank, self.world_size = a.rank, a.world_size
        self.lineage = a.lineage
        self.ps_servers, self.ps_shard_map = list(a.ps), list(a.ps_shard_map)
        self.stream_assignment = dict(a.stream)
        self.stream_skip = {p: [list(r) for r in ranges] for p, ranges in a.stream_skip.items()}
        if a.sync_state:
            sent: dict[str, Any] | None = None
            if a.rank == a.source_rank:
                sent = self._resume_state(state, a) if a.restore else self._committed_tree(state)
            tree = self._comm.broadcast_state(sent, a.source_rank)
            if a.rank != a.source_rank:
                state.load_tree(tree)  # type: ignore[arg-type]
        else:
            state.restore()
        self._reporter.joined(self._comm)
        self._in_round = True
        self.generation += 1
        steps.enter_round(self._comm, a.rank, a.world_size)
        log.info("worker %d: round %d rank %d/%d from step %d", self.worker_id, a.round, a.rank,
                 a.world_size, state.applied_step)

    @staticmethod
    def _committed_tree(state: State) -> dict[str, Any]:
        state.restore()
        return state.to_tree()

    def _resume_state(self, state: State, a: RendezvousResponse) -> dict[str, Any] | None:
        """The source of a round that resumes from the job's checkpoint of step ``a.applied_step``
        (every worker holding the model was lost, or a parameter server) loads it into ``state``
        and puts the servers back at it (``_restore_hooks``); -1: none, the fresh
        model. None when it cannot: the master hears why with the next rendezvous, and tries the
        checkpoint before it, or fails the job when the checkpoint does not fit the model."""
        if a.applied_step < 0:
            # every worker was lost (a survivor is never told to start again from scratch):
            # this fresh model is the job's, and the servers' tables go back to empty
            state.restore()
            return self._restore_hooks(None, -1, state)
        step = a.applied_step
        try:
            if not self.checkpoint_dir:
                raise CheckpointError("this worker has no checkpoint directory")
            loaded = load_step(self.checkpoint_dir, step, job=self.job_id, lineage=a.restore_lineage)
        except (CheckpointError, OSError) as exc:
            self._restore_failed = RestoreFailure(step=step, lineage=a.restore_lineage, problem=str(exc)[:1000])
            log.warning("worker %d: cannot load the checkpoint of step %d: %s", self.worker_id, step, exc)
            return None
        try:
            state.load_tree(loaded.tree)
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            problem = f"it does not fit the script's model or optimizer: {' '.join(lines[:2])[:900]}"
            self._restore_failed = RestoreFailure(step=step, lineage=a.restore_lineage, problem=problem, fatal=True)
            print(f"tidal: worker {self.worker_id}: cannot resume from the checkpoint of step {step}: {problem}",
                  file=sys.stderr, flush=True)
            return None
        log.info("worker %d: resumed from the %s checkpoint of step %d (%s)", self.worker_id, loaded.source, step,
                 loaded.path)
        return self._restore_hooks(loaded.tree.get("hooks"), step, state, a.restore_lineage)

    def _restore_hooks(self, trees: dict[str, Any] | None, step: int, state: State,
                       lineage: int = 0) -> dict[str, Any] | None:
        """Put the step hooks (the parameter servers) back at the checkpoint of ``step``; the
        state to send, or None when the checkpoint cannot give them back (the master hears why).

        Raises:
            RetryableError: a server did not answer (this worker ends; the round forms again).
        """
        for hook in self.steps.hooks:
            tree = (trees or {}).get(hook.name)
            if tree is None and step >= 0:
                self._restore_failed = RestoreFailure(step=step, lineage=lineage,
                                                      problem=f"it holds nothing of {hook.name!r}")
                return None
            try:
                hook.restore_tree(tree, step)
            except PermanentError as exc:
                problem = f"its {hook.name!r} part does not fit the script's: {exc}"[:1000]
                self._restore_failed = RestoreFailure(step=max(step, 0), lineage=lineage, problem=problem,
                                                      fatal=True)
                return None
        return state.to_tree()

    def _leave_round(self, *, pause: bool = False) -> None:
        """Close the round's communicator; ``pause``: to re-form (the reporter counts the pause)."""
        self._in_round = False
        self._reform_asked = None  # asked of the round left (a local run re-enters without the master)
        if self._reporter is not None:
            self._reporter.left(pause=pause)
        if self._steps is not None:
            self._steps.leave_round()
        if self._comm is not None:
            self._comm.close()
            self._comm = None

    # ------------------------------------------------------------------ reporting
    def start_reporter(self, heartbeat_interval_s: float | None = None, incarnation: str = "") -> None:
        """Report to the master from a background thread (``heartbeat_interval_s``: the master's;
        ``incarnation``: the master process it joined)."""
        if self._reporter is not None:
            self._reporter.start(heartbeat_interval_s, incarnation)

    def _check_gone(self) -> None:
        """Raise ``WorkerGoneError`` in the training thread once the reporter learned that the
        master declared this worker failed (see ``ensure_round``)."""
        gone = self._reporter.gone if self._reporter is not None else None
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
    if os.environ.get("TIDAL_ROLE") == "data":  # a data worker: no rounds; its loader serves batches
        job = Job(None, int(os.environ.get("TIDAL_DATA_WORKER_ID", "0")), os.environ.get("TIDAL_JOB_ID", "job"),
                  backend, logical=logical)
        job.is_data_worker = True
        return job
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
        job.start_reporter(info.heartbeat_interval_s, info.incarnation)
    job.checkpoint_dir = checkpoints
    every = os.environ.get("TIDAL_CHECKPOINT_EVERY")
    if every:
        if not checkpoints:
            raise UsageError("TIDAL_CHECKPOINT_EVERY needs a checkpoint directory")
        job.periodic_checkpoint = PeriodicCheckpoint(checkpoints, worker_checkpoint_name(job.job_id, job.worker_id),
                                                     parse_every(every),
                                                     keep=int(os.environ.get("TIDAL_CHECKPOINT_KEEP", "0") or 0))
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


def _watermark(value: Any, applied_step: int) -> list[int] | None:
    """The parameter servers' watermark of the applied step, as the master reads it (None when
    the script has no servers, or the watermark is not the applied step's)."""
    if isinstance(value, list | tuple) and len(value) == 3 and all(isinstance(v, int) for v in value):
        return list(value) if value[1] == applied_step else None
    return None
