"""A dynamic embedding table with its optimizer state, as one server holds it.

Rows are stored only once trained (``apply``): a pull of an id never trained reads its initial
value (``tidal.ps.api.initial_rows``) without storing it, so memory grows with the ids the job
has trained, as in production tables (DLRover-RM 2.2), and a step that is rolled back leaves no
row behind. Rows and state live in float32 tensors grown by doubling, a row at its slot.

The id -> slot index (``IdIndex``) is two sorted numpy arrays searched a whole batch at a time:
a server's request holds thousands of ids, and a dict looked up one Python int at a time took
most of the request's time (2-3 ms for 4,000 ids on 2 cores, against 0.4 ms).

The optimizers update only the rows of a step's gradient and are elementwise, so a row's value
depends on its own history alone: the same on any server and in any shard map. Adagrad follows
``torch.optim.Adagrad`` (no lr decay, initial accumulator 0); Adam is lazy (as
``torch.optim.SparseAdam``, with a step count per row).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from tidal.ps.api import PSError, TableSpec, initial_rows, virtual_shard

_STATE = {"sgd": (), "adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq")}


class DynamicTable:
    def __init__(self, spec: TableSpec, capacity: int = 1024) -> None:
        self.spec = spec
        self.rows = 0
        self._index = IdIndex()
        self._ids = np.empty(capacity, dtype=np.int64)
        self.weight = torch.empty(capacity, spec.dim)
        self.state = {name: torch.zeros(capacity, spec.dim) for name in _STATE[spec.optimizer]}
        self.steps = torch.zeros(capacity, dtype=torch.int64) if spec.optimizer == "adam" else None

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held (and their state), not of the capacity reserved."""
        per_row = self.spec.dim * 4 * (1 + len(self.state)) + 8 + (8 if self.steps is not None else 0)
        return self.rows * per_row

    def check_ids(self, ids: torch.Tensor) -> None:
        """Raises PSError: ids out of a fixed-size table's range."""
        if self.spec.num_ids is not None and ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.spec.num_ids:
                bad = lo if lo < 0 else hi
                raise PSError(f"table {self.spec.name}: id {bad} is out of range [0, {self.spec.num_ids})")

    def slots(self, ids: torch.Tensor) -> np.ndarray:
        """The slot of each id, -1 where the row is not stored."""
        return self._index.find(ids.numpy())

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (a new float32 ``[n, dim]`` tensor)."""
        slots = self.slots(ids)
        stored = slots >= 0
        if stored.all():
            return self.weight.index_select(0, torch.from_numpy(slots))
        if not stored.any():
            return initial_rows(self.spec, ids)
        # the initial values of the missing rows only: each is a function of its id alone
        missing = np.flatnonzero(~stored)
        out = torch.empty(ids.numel(), self.spec.dim)
        out.index_copy_(0, torch.from_numpy(missing), initial_rows(self.spec, torch.from_numpy(ids.numpy()[missing])))
        where = torch.from_numpy(np.flatnonzero(stored))
        out.index_copy_(0, where, self.weight.index_select(0, torch.from_numpy(slots[stored])))
        return out

    def apply(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """One optimizer step on the rows of ``ids`` (unique) with ``grad`` (the step's mean
        gradient of those rows); rows not stored yet are created at their initial value."""
        slots = self.slots(ids)
        missing = slots < 0
        if missing.any():
            slots[missing] = self._insert(torch.from_numpy(ids.numpy()[missing]))
        index = torch.from_numpy(slots)
        spec = self.spec
        # index_select/index_copy_, not ``t[index]``: advanced indexing took 2 ms for 500 rows
        # on 2 threads (a parallel path), index_select 7 us
        w = self.weight.index_select(0, index)
        if spec.optimizer == "sgd":
            w.sub_(grad, alpha=spec.lr)
        elif spec.optimizer == "adagrad":
            s = self.state["sum"].index_select(0, index).addcmul_(grad, grad)
            self.state["sum"].index_copy_(0, index, s)
            w.addcdiv_(grad, s.sqrt().add_(spec.eps), value=-spec.lr)
        else:
            assert self.steps is not None
            t = self.steps.index_select(0, index).add_(1)
            self.steps.index_copy_(0, index, t)
            m = self.state["exp_avg"].index_select(0, index).mul_(spec.beta1).add_(grad, alpha=1 - spec.beta1)
            v = self.state["exp_avg_sq"].index_select(0, index).mul_(spec.beta2).addcmul_(grad, grad,
                                                                                         value=1 - spec.beta2)
            self.state["exp_avg"].index_copy_(0, index, m)
            self.state["exp_avg_sq"].index_copy_(0, index, v)
            tf = t.to(torch.float64)
            bias1 = (1 - torch.pow(torch.tensor(spec.beta1, dtype=torch.float64), tf)).to(torch.float32)
            bias2 = (1 - torch.pow(torch.tensor(spec.beta2, dtype=torch.float64), tf)).to(torch.float32)
            denom = (v / bias2[:, None]).sqrt_().add_(spec.eps)
            w.addcdiv_(m / bias1[:, None], denom, value=-spec.lr)
        self.weight.index_copy_(0, index, w)

    def _insert(self, ids: torch.Tensor) -> np.ndarray:
        n = ids.numel()
        self._grow(self.rows + n)
        slots = np.arange(self.rows, self.rows + n, dtype=np.int64)
        self.weight[self.rows:self.rows + n] = initial_rows(self.spec, ids)
        self._ids[self.rows:self.rows + n] = ids.numpy()
        self._index.add(ids.numpy(), slots)
        self.rows += n
        return slots

    def _grow(self, need: int) -> None:
        cap = len(self._ids)
        if need <= cap:
            return
        new = max(need, 2 * cap)
        self._ids = np.resize(self._ids, new)
        self.weight = _grown(self.weight, new)
        self.state = {k: _grown(v, new) for k, v in self.state.items()}
        if self.steps is not None:
            self.steps = _grown(self.steps, new)

    # ------------------------------------------------------------------ export / load
    def export(self, start: int = 0, limit: int | None = None,
               shards: tuple[list[int], int] | None = None) -> dict[str, torch.Tensor]:
        """Rows ``start`` to ``start + limit`` in id order: ``ids``, ``weight`` and the
        optimizer state (the canonical order a checkpoint and the fingerprint use). ``shards``
        ``(virtual shards, num_shards)``: only the rows hashing to those shards (a move)."""
        return self.export_page(start, limit, shards)[0]

    def export_page(self, start: int = 0, limit: int | None = None,
                    shards: tuple[list[int], int] | None = None) -> tuple[dict[str, torch.Tensor], int]:
        """``export``'s rows, and how many rows (in ``shards``) there are in all."""
        order = self._positions(shards)
        stop = len(order) if limit is None else min(len(order), start + limit)
        pick_np = order[start:stop]
        pick = torch.from_numpy(pick_np.copy())
        out = {"ids": torch.from_numpy(self._ids[pick_np]), "weight": self.weight.index_select(0, pick)}
        for name, value in self.state.items():
            out[name] = value.index_select(0, pick)
        if self.steps is not None:
            out["steps"] = self.steps.index_select(0, pick)
        return out, len(order)

    def drop_shards(self, shards: list[int], num_shards: int) -> int:
        """Forget the rows hashing to ``shards`` (moved to another server); returns how many."""
        gone = self._in_shards(shards, num_shards)
        dropped = int(gone.sum())
        if dropped:
            keep = torch.from_numpy(np.flatnonzero(~gone))
            n = len(keep)
            self._ids[:n] = self._ids[:self.rows][keep.numpy()]
            self.weight[:n] = self.weight.index_select(0, keep)
            for value in self.state.values():
                value[:n] = value.index_select(0, keep)
                value[n:self.rows] = 0
            if self.steps is not None:
                self.steps[:n] = self.steps.index_select(0, keep)
                self.steps[n:self.rows] = 0
            self.rows = n
            self._index = IdIndex(self._ids[:n])
        return dropped

    def _in_shards(self, shards: list[int], num_shards: int) -> np.ndarray:
        """Whether each stored row hashes to one of ``shards``."""
        ids = torch.from_numpy(self._ids[:self.rows])
        return np.isin(virtual_shard(self.spec.name, ids, num_shards).numpy(), np.asarray(shards, dtype=np.int64))

    def _positions(self, shards: tuple[list[int], int] | None) -> np.ndarray:
        """The slots of the rows (in ``shards``), in id order."""
        ids = self._ids[:self.rows]
        if shards is None:
            return np.argsort(ids, kind="stable")
        where = np.flatnonzero(self._in_shards(*shards))
        return where[np.argsort(ids[where], kind="stable")]

    def load(self, part: dict[str, torch.Tensor]) -> None:
        """Add exported rows (a restore, or rows moved from another server).

        Raises:
            PSError: a field is missing or has the wrong shape, or a row is already stored.
        """
        ids = part.get("ids")
        if ids is None or ids.dtype != torch.int64 or ids.dim() != 1:
            raise PSError(f"table {self.spec.name}: rows to load need int64 ids")
        n = ids.numel()
        names = ["weight", *self.state, *(["steps"] if self.steps is not None else [])]
        for name in names:
            value = part.get(name)
            want = (n,) if name == "steps" else (n, self.spec.dim)
            if value is None or tuple(value.shape) != want:
                raise PSError(f"table {self.spec.name}: {name} of the rows to load must have shape {list(want)}")
        if (self.slots(ids) >= 0).any():
            raise PSError(f"table {self.spec.name}: rows to load are already stored")
        slots = torch.from_numpy(self._insert(ids))
        self.weight.index_copy_(0, slots, part["weight"].float())
        for name in self.state:
            self.state[name].index_copy_(0, slots, part[name].float())
        if self.steps is not None:
            self.steps.index_copy_(0, slots, part["steps"].long())

    def stats(self) -> dict[str, Any]:
        return {"rows": self.rows, "bytes": self.nbytes}


class IdIndex:
    """id -> slot for int64 ids (any value): sorted numpy arrays, looked up with ``searchsorted``.

    Two levels, as a log-structured index: a large sorted ``main`` and a small sorted ``recent``
    that new ids go into; ``recent`` is merged into ``main`` once it holds more than
    ``max(2048, 16 * sqrt(len(main)))`` ids, so adding costs O(len(recent)) a batch plus an
    amortised O(sqrt(n)) copies an id, and a lookup is two binary searches of a whole batch
    (two numpy calls, not one pass per probe step: an open-addressing hash table probed a batch
    at a time took 7 passes at load 1/2, 2-3x longer). Ids are only ever added: the table
    rebuilds the index to forget some.
    """

    def __init__(self, ids: np.ndarray | None = None) -> None:
        """An index of ``ids`` (distinct) at slots ``0..len(ids)-1``."""
        empty = np.empty(0, dtype=np.int64)
        self._main = (empty, empty)
        self._recent = (empty, empty)
        if ids is not None and len(ids):
            self._main = _sorted(np.asarray(ids, dtype=np.int64), np.arange(len(ids), dtype=np.int64))

    @property
    def size(self) -> int:
        return len(self._main[0]) + len(self._recent[0])

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id (a new int64 array), -1 where it is not held."""
        out = np.full(len(ids), -1, dtype=np.int64)
        for keys, slots in (self._main, self._recent):
            at = sorted_positions(keys, ids)
            hit = np.flatnonzero(at >= 0)
            out[hit] = slots.take(at.take(hit))
        return out

    def add(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Map ``ids`` (none held yet) to ``slots``; an id repeated in ``ids`` gets one of its slots."""
        keys, values = _sorted(np.concatenate([self._recent[0], ids]), np.concatenate([self._recent[1], slots]))
        if len(keys) > max(2048, 16 * math.isqrt(len(self._main[0]))):
            keys, values = _sorted(np.concatenate([self._main[0], keys]), np.concatenate([self._main[1], values]))
            self._main, keys, values = (keys, values), keys[:0], values[:0]
        self._recent = (keys, values)


def sorted_positions(keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The position of each of ``ids`` in ``keys`` (sorted, distinct), -1 where it is not there."""
    if not len(keys):
        return np.full(len(ids), -1, dtype=np.int64)
    at = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
    return np.where(keys.take(at) == ids, at, -1)


def _sorted(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``keys`` sorted (one of each: the first of a repeated key) and their ``values``."""
    keys, first = np.unique(keys, return_index=True)
    return keys, values.take(first)


def _grown(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    out[:len(t)] = t
    return out
