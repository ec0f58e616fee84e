"""A dynamic embedding table with its optimizer state, as one server holds it.

Rows are stored only once trained (``apply``): a pull of an id never trained reads its initial
value (``tidal.ps.api.initial_rows``) without storing it, so memory grows with the ids the job
has trained, as in production tables (DLRover-RM 2.2), and a step that is rolled back leaves no
row behind. Rows and state live in float32 tensors grown by doubling, a row at its slot.

The id -> slot index (``IdIndex``) is an open-addressing hash table in numpy arrays, looked up
and filled a whole batch at a time: a server's request holds thousands of ids, and a dict looked
up one Python int at a time took most of the request's time (2-3 ms for 4,000 ids on 2 cores,
against 0.4 ms).

The optimizers update only the rows of a step's gradient and are elementwise, so a row's value
depends on its own history alone: the same on any server and in any shard map. Adagrad follows
``torch.optim.Adagrad`` (no lr decay, initial accumulator 0); Adam is lazy (as
``torch.optim.SparseAdam``, with a step count per row).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tidal.ps.api import PSError, TableSpec, initial_rows, mix64, virtual_shard

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
            self._index = IdIndex(self._ids[:n], self._index.capacity)
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
    """id -> slot for int64 ids (any value): an open-addressing hash table in numpy arrays.

    Cell ``c`` maps ``keys[c]`` to ``slots[c]``; ``slots[c] == -1`` marks an empty cell (so no id
    value is reserved). The capacity is a power of two, at least twice the ids held (load <= 1/2;
    doubled and rehashed past it). An id's probe sequence starts at the cell of its splitmix64
    hash and steps 1, 2, 3... cells on (triangular numbers: it visits every cell); it ends at the
    id's cell or at the first empty one. Probes run for a whole batch at once, one numpy pass per
    step over the ids still probing (about 15 passes for thousands of ids at load 1/2, most of
    them over a few ids). Ids are only ever added: the table rebuilds the index to forget some.
    """

    def __init__(self, ids: np.ndarray | None = None, capacity: int = 64) -> None:
        """An index of ``ids`` (distinct) at slots ``0..len(ids)-1``, of ``capacity`` cells at least."""
        n = 0 if ids is None else len(ids)
        self._allocate(max(capacity, _cells_for(n)))
        if ids is not None:
            self.add(ids, np.arange(n, dtype=np.int64))

    @property
    def capacity(self) -> int:
        return len(self._keys)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id (a new int64 array), -1 where it is not held."""
        return self._slots.take(self._probe(ids))

    def add(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Map ``ids`` (none held yet) to ``slots``; an id repeated in ``ids`` gets one of its slots."""
        if _cells_for(self.size + len(ids)) > self.capacity:
            held = np.flatnonzero(self._slots >= 0)
            old_ids, old_slots = self._keys[held], self._slots[held]
            self._allocate(_cells_for(self.size + len(ids)))
            self._place(old_ids, old_slots)
        self._place(ids, slots)

    def _allocate(self, capacity: int) -> None:
        self._keys = np.zeros(capacity, dtype=np.int64)
        self._slots = np.full(capacity, -1, dtype=np.int64)
        self.size = 0

    def _probe(self, ids: np.ndarray) -> np.ndarray:
        """The cell where each id's probe sequence ends: its own, or the first empty one."""
        mask = self.capacity - 1
        cell = (mix64(ids.view(np.uint64)) & np.uint64(mask)).view(np.int64)
        end = cell.copy()
        pending = np.arange(len(ids))  # positions in ``ids`` still probing
        step = 0
        while pending.size:
            more = np.flatnonzero((self._slots.take(cell) >= 0) & (self._keys.take(cell) != ids))
            pending, ids, cell = pending.take(more), ids.take(more), cell.take(more)
            step += 1
            cell = (cell + step) & mask
            end[pending] = cell
        return end

    def _place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        claim = np.arange(len(ids))
        while ids.size:
            cell = self._probe(ids)
            # a probe ending at a held cell is an id repeated in ``ids``, placed by an earlier pass
            vacant = np.flatnonzero(self._slots.take(cell) < 0)
            ids, slots, cell, claim = ids.take(vacant), slots.take(vacant), cell.take(vacant), claim.take(vacant)
            # ids whose probes end at one empty cell each write their number there; the one read
            # back takes the cell, the others probe again (past it)
            self._slots[cell] = claim
            won = self._slots.take(cell) == claim
            self._keys[cell[won]] = ids[won]
            self._slots[cell[won]] = slots[won]
            self.size += int(won.sum())
            lost = ~won
            ids, slots, claim = ids[lost], slots[lost], claim[lost]


def _cells_for(ids: int) -> int:
    """The capacity (a power of two, 64 at least) for ``ids`` at load 1/2 at most."""
    return max(64, 1 << (2 * ids - 1).bit_length())


def _grown(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    out[:len(t)] = t
    return out
