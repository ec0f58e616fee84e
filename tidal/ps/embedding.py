"""The module a training script uses for embedding tables held by the parameter servers.

    job = tidal.worker.init()
    tables = [TableSpec(f"field{i}", dim=32, num_ids=2**24) for i in range(4)]
    emb = ServerEmbeddings(job, tables)           # before job.state(): no parameters of its own
    state = job.state(model, optimizer)
    emb.attach(state)                              # its step hook: push before the reduction
    for batch in job.loader(...):
        vectors = emb({"field0": batch["ids0"], ...})   # pulls the batch's rows
        loss(model(vectors, ...)).backward()
        job.step()                                 # pushes the rows' gradients, reduces, commits

A forward pulls the rows of the batch's unique ids (one request per server for all tables) into
a leaf tensor per table that autograd fills with the rows' gradient; ``job.step()`` pushes that
gradient (times the contribution's samples) before the dense reduction, and the servers apply
the step once it is committed (tidal.ps.server). Dense parameters stay in the workers and are
reduced among them as usual: a hybrid of parameter servers for the sparse part and all-reduce
for the dense part.

**Sync and async, and what each promises under failures.**

* Sync (the default). A step's sparse gradients are applied exactly once, when the step is
  committed, in key order (logical-rank order with logical workers): the model is the same
  whatever the number of servers and workers, and ``tidal fingerprint`` shows it. A worker lost
  mid-step: its pushes are never named by a watermark and are dropped; the step is trained
  again. A server lost: it is replaced and every server goes back to the newest flash
  checkpoint with the workers (tidal.master.servers); the steps after it are rolled back and
  trained again, so the model's lineage sees every sample exactly once.
* Async (``synchronous=False``; Kale 3.3, Eq. 8). Each contribution's own mean gradient is
  applied by the servers on arrival, whatever the other workers do, and the worker does not
  wait for the answer before its dense all-reduce (only before committing the step). The
  dense part stays exactly once. The sparse part is *at least once*: a step dropped by a
  re-form after its pushes arrived (a worker lost, a scale) has them applied and is trained
  again. Rows read in a step may hold some of the same step's updates by other workers, in
  arrival order, so two runs give different models (no fingerprint equality). A server lost is
  handled as in sync mode, except that the checkpoint may hold some updates of the step after
  it (pushes that arrived while rank 0 exported the tables).

``ids`` of a table are an int64 tensor ``[n]`` (one id per sample: an embedding lookup) or
``[n, k]`` (a bag of ``k`` ids per sample, pooled by ``mode``, ``sum`` or ``mean``).

Without a master (``python train.py``), the module serves its tables from a server thread of
its own, so the same script runs alone for debugging.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidal.api import PS_WATERMARK
from tidal.ps.api import (
    DEFAULT_SHARDS,
    PSAbortedError,
    PSError,
    PSUnavailableError,
    TableSpec,
    default_shard_map,
)
from tidal.ps.client import PSClient

WATERMARK = PS_WATERMARK  # the key of the servers' watermark in ``state.extras``


class ServerEmbeddings(nn.Module):
    """Embedding tables on the job's parameter servers (see the module's docstring).

    Args:
        job: the script's ``tidal.worker.Job``.
        tables: the tables (names unique).
        mode: how a bag of ids (``[n, k]``) is pooled: ``sum`` or ``mean``.
        synchronous: sync mode (the default): a step's sparse gradients are applied once the
            step is committed, summed in key order, so the model is the same whatever the
            number of servers and workers. False: async mode (below).
        timeout_s: how long a pull or push waits for a server.

    Raises:
        PSError: no tables, a name given twice, or an unknown ``mode``.
    """

    name = "ps"

    def __init__(self, job: Any, tables: list[TableSpec], *, mode: str = "sum", synchronous: bool = True,
                 timeout_s: float = 60.0) -> None:
        super().__init__()
        if not tables:
            raise PSError("ServerEmbeddings needs at least one table")
        if len({t.name for t in tables}) != len(tables):
            raise PSError("two tables with the same name")
        if mode not in ("sum", "mean"):
            raise PSError(f"mode must be sum or mean, got {mode!r}")
        self.job = job
        self.tables = {t.name: t for t in tables}
        self.mode = mode
        self.synchronous = synchronous
        self.timeout_s = timeout_s
        self._state: Any = None
        self._client: PSClient | None = None
        self._servers: tuple[list[str], list[int]] | None = None
        # this step's pulled rows: (round, step, key) and, per table, the ids and the leaf
        self._pulled: tuple[tuple[int, int, int], dict[str, tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._local: tuple[threading.Event, threading.Thread] | None = None
        self._void: str | None = None  # why this step's pull was given up (it is dropped)

    def attach(self, state: Any) -> None:
        """Register the step hook with the job (after ``job.state()``)."""
        self._state = state
        self.job.add_step_hook(self)

    # ------------------------------------------------------------------ forward
    def forward(self, ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The pooled rows of each table's ``ids`` (``[n, dim]`` per table)."""
        if self._state is None:
            raise PSError("call emb.attach(state) after job.state() before the first forward")
        if not ids:
            raise PSError("a forward of no tables: pass {table name: ids}")
        unknown = sorted(set(ids) - set(self.tables))
        if unknown:
            raise PSError(f"unknown tables {unknown} (declared: {sorted(self.tables)})")
        client = self._connect()
        uniques, inverses = {}, {}
        for name, t_ids in ids.items():
            if t_ids.dtype != torch.int64 or t_ids.dim() not in (1, 2):
                raise PSError(f"table {name}: ids must be int64 [n] or [n, k], got {t_ids.dtype} {list(t_ids.shape)}")
            uniques[name], inverses[name] = torch.unique(t_ids.cpu(), sorted=True, return_inverse=True)
        track = torch.is_grad_enabled() and self.training
        key = self._key() if track else None
        try:
            rows = client.pull(uniques, round_=self.job.round, step=self.job.applied_step + 1, key=key)
        except PSAbortedError as exc:
            # the job re-forms (a server was lost): this step is dropped at job.step(), so the
            # script gets zero rows to finish it with, never rows of another step
            self._void = str(exc)
            rows = {name: torch.zeros(u.numel(), self.tables[name].dim) for name, u in uniques.items()}
        out, leaves = {}, {}
        device = next(iter(ids.values())).device
        for name, t_ids in ids.items():
            leaf = rows[name].to(device)
            if track:
                leaf.requires_grad_(True)
                leaves[name] = (uniques[name], leaf)
            inverse = inverses[name].to(device)
            if t_ids.dim() == 1:
                out[name] = F.embedding(inverse, leaf)
            else:
                out[name] = F.embedding_bag(inverse, leaf, mode=self.mode)
        if track:
            assert key is not None
            step_key = (self.job.round, self.job.applied_step + 1, key)
            if self._pulled is not None and self._pulled[0] == step_key:
                raise PSError("two forwards of ServerEmbeddings in one step: pull every table in one call")
            self._pulled = (step_key, leaves)
        return out

    def _key(self) -> int:
        """The contribution's key: the logical rank of the logical worker running, else the rank."""
        lstep = self.job.steps.logical_step
        if lstep is not None and lstep.current is not None:
            return int(lstep.current)
        return int(self.job.rank)

    def _connect(self) -> PSClient:
        """The client for this round's servers (a new one when they changed)."""
        servers, shard_map = list(self.job.ps_servers), list(self.job.ps_shard_map)
        if not servers:
            if not self.job.is_local:
                raise PSError("the job has no parameter servers: run it with `tidal run --ps N`")
            servers, shard_map = [self._serve_locally()], default_shard_map(DEFAULT_SHARDS, 1)
        if self._client is None or self._servers != (servers, shard_map):
            if self._client is not None:
                self._client.close()
            self._client = PSClient(servers, shard_map, self.job.token, list(self.tables.values()),
                                    timeout_s=self.timeout_s, abort=self._reforming)
            self._servers = (servers, shard_map)
        self._client.watermark = self._state.extras.get(WATERMARK)
        return self._client

    def _reforming(self) -> bool:
        return bool(self.job.reform_notice)

    def _serve_locally(self) -> str:
        """A server thread for a run without a master; returns its address."""
        from tidal.ps.server import ParameterServer, serve

        if self._local is None:
            bound: list[str] = []
            ready, stop = threading.Event(), threading.Event()

            def on_ready(address: str) -> None:
                bound.append(address)
                ready.set()

            thread = threading.Thread(target=serve, args=(ParameterServer(self.job.token),),
                                      kwargs={"ready": on_ready, "stop": stop}, daemon=True, name="tidal-ps-local")
            thread.start()
            ready.wait(30)
            self._local = (stop, thread)
            self._local_address = bound[0]
        return self._local_address

    # ------------------------------------------------------------------ the step hook
    def before_reduce(self, step: int, key: int, samples: int) -> None:
        if self._void is not None:
            why, self._void, self._pulled = self._void, None, None
            raise PSAbortedError(why)  # the step runner drops the step and re-forms
        pulled = self._pulled
        if pulled is None or samples == 0:
            return
        (round_, pulled_step, pulled_key), leaves = pulled
        if (round_, pulled_step, pulled_key) != (self.job.round, step, key):
            return  # rows of a step a re-form dropped
        self._pulled = None
        grads = {}
        # sync: the contribution's share of the step's mean (times its samples, divided by the
        # step's total on the servers); async: its own mean gradient, applied on arrival
        weight = float(samples) if self.synchronous else 1.0
        for name, (ids, leaf) in leaves.items():
            if leaf.grad is None:
                continue  # the table was not used in the loss
            grads[name] = (ids, (leaf.grad.detach() * weight).cpu().contiguous())
        if grads:
            assert self._client is not None
            self._client.push(grads, round_=round_, step=step, key=key, asynchronous=not self.synchronous)

    def after_apply(self, step: int, total: int) -> None:
        watermark = [int(self.job.round), int(step), int(total)]
        self._state.extras[WATERMARK] = watermark
        if self._client is not None:
            if not self.synchronous:
                # a committed step's pushes are applied: wait for their answers (a lost server's
                # never come: the re-form that follows restores every server)
                try:
                    self._client.flush()
                except PSUnavailableError:
                    pass
            self._client.commit(*watermark)

    def checkpoint_tree(self) -> dict[str, Any]:
        """Every table's rows and optimizer state in id order, whatever the shard map."""
        client = self._connect()
        return {name: dict(part) for name, part in client.export().items()}

    def restore_tree(self, tree: dict[str, Any] | None, step: int) -> None:
        """Put the servers back at the checkpoint of ``step`` whose ``checkpoint_tree`` is
        ``tree`` (None: the fresh tables of step -1), whatever shard map each was taken with.
        The source of a round that resumes from a checkpoint calls it before sending the
        model, so no member trains on the servers before they are restored.

        Raises:
            PSError: the checkpoint's tables do not fit the script's, or a server refuses them.
            PSUnavailableError: a server did not answer.
        """
        self._pulled, self._void = None, None
        client = self._connect()
        tables = {name: {k: v for k, v in part.items() if isinstance(v, torch.Tensor)}
                  for name, part in (tree or {}).items()}
        client.restore(tables, step)
        client.watermark = self._state.extras.get(WATERMARK)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._local is not None:
            self._local[0].set()
            self._local[1].join(5)
            self._local = None
