"""Parameter servers' interface: tables, the shard map, the wire protocol and errors.

Embedding rows are hash-partitioned (DLRover 5.3, DLRover-RM 5.2): a row's id and its table
hash to one of ``num_shards`` *virtual shards* (``virtual_shard``), and the shard map says which
server holds each virtual shard. Moving a virtual shard between servers changes the map, never
the hash, so a row's place follows from (table, id, map) alone.

The wire protocol is the data-plane codec of ``tidal.api.frames`` over ZeroMQ (a DEALER per
server in the client, a ROUTER in the server); every request's ``meta`` holds ``op`` and the
job's ``token``, and every reply's ``meta`` holds ``ok`` and, when not ok, ``error``:

* ``hello``: ``tables`` (``TableSpec.to_json`` each). The first one configures the server;
  later ones must name the same tables.
* ``pull``: tensors ``{table}.ids`` (int64, unique); meta ``round``, ``step``, ``key``,
  ``commit``. Reply: ``{table}.rows`` (float32 ``[len(ids), dim]``), rows never trained read as
  their deterministic initial value (``initial_rows``) and are not stored.
* ``push``: tensors ``{table}.ids`` and ``{table}.grad``; meta ``round``, ``step``, ``key``,
  ``commit``. The gradient is the contribution's ``samples x`` the gradient of its mean loss;
  the ids must have been pulled for the same (round, step, key).
* ``commit`` (no reply): meta ``commit`` only.
* ``export``: meta ``table``, ``start``, ``limit``: the table's rows in id order from the
  ``start``-th, with their optimizer state. ``stats``: rows, bytes, the applied step.

``commit`` is the watermark ``[round, step, total]`` of the last step the sender applied: the
server applies the contributions pushed for ``(round, step)`` in key order (logical rank, or
rank), scaled by ``1 / total``, before it serves the request (the sync mode's exactly-once rule:
tidal.ps.server).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from tidal.api.errors import PermanentError, RetryableError

OPTIMIZERS = ("sgd", "adagrad", "adam")
DEFAULT_SHARDS = 64  # virtual shards: enough to spread over dozens of servers, few enough to list
MAX_TABLES = 64
MAX_DIM = 4096


class PSError(PermanentError):
    """A parameter server refused a request (bad input, a protocol violation): the message says
    why; retrying the same request fails again."""


class PSUnavailableError(RetryableError):
    """A parameter server did not answer in time."""


class PSAbortedError(PSUnavailableError):
    """A request was given up before its answer because the job is re-forming (a server was
    lost, or the master asked): the step is dropped and trained again in the next round."""


@dataclass(frozen=True)
class TableSpec:
    """One embedding table held by the servers.

    Args:
        name: the table's name (letters, digits, ``_``; unique in the job).
        dim: the row width.
        num_ids: ids must lie in ``[0, num_ids)`` (a fixed-size hashed table); None: any int64
            id (a collision-free dynamic table; rows exist only for the ids trained).
        optimizer: ``sgd``, ``adagrad`` or ``adam`` (lazy: a row's moments and step count move
            only when the row has a gradient), applied on the servers.
        lr, eps, beta1, beta2: the optimizer's settings (as torch's Adagrad and Adam).
        init_scale: rows start uniform in ``[-init_scale, init_scale]``; None: DLRM's
            ``1/sqrt(num_ids)`` (0.01 for a dynamic table).
        seed: the seed of the initial rows (a row's initial value depends on (seed, name, id)
            only, never on the server that creates it).
    """

    name: str
    dim: int
    num_ids: int | None = None
    optimizer: str = "adagrad"
    lr: float = 0.01
    eps: float = 1e-10
    beta1: float = 0.9
    beta2: float = 0.999
    init_scale: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c == "_" for c in self.name):
            raise PSError(f"table name {self.name!r}: use letters, digits and _")
        if not 1 <= self.dim <= MAX_DIM:
            raise PSError(f"table {self.name}: dim must be in [1, {MAX_DIM}], got {self.dim}")
        if self.num_ids is not None and self.num_ids < 1:
            raise PSError(f"table {self.name}: num_ids must be at least 1, got {self.num_ids}")
        if self.optimizer not in OPTIMIZERS:
            raise PSError(f"table {self.name}: optimizer must be one of {', '.join(OPTIMIZERS)}, "
                          f"got {self.optimizer!r}")
        for what in ("lr", "eps", "beta1", "beta2"):
            value = getattr(self, what)
            if not math.isfinite(value) or value < 0:
                raise PSError(f"table {self.name}: {what} must be a finite number >= 0, got {value}")

    @property
    def scale(self) -> float:
        if self.init_scale is not None:
            return self.init_scale
        return self.num_ids ** -0.5 if self.num_ids else 0.01

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> TableSpec:
        if not isinstance(value, dict):
            raise PSError(f"a table spec must be an object, got {type(value).__name__}")
        try:
            return cls(**value)
        except TypeError as exc:
            raise PSError(f"bad table spec: {exc}") from None


# ---------------------------------------------------------------------------- hashing
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S40 = (np.uint64(k) for k in (30, 27, 31, 40))
_INV24 = np.float32(1.0 / (1 << 24))


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (a new array)."""
    z = z ^ (z >> _S30)
    z = z * _M1
    z = z ^ (z >> _S27)
    z = z * _M2
    return z ^ (z >> _S31)


@functools.lru_cache(maxsize=1024)
def _name_key(name: str, seed: int) -> np.uint64:
    key = np.uint64(seed & ((1 << 64) - 1))
    for ch in name.encode():
        key = mix64(np.array([key ^ np.uint64(ch)], dtype=np.uint64))[0]
    return np.uint64(key)


def virtual_shard(table: str, ids: torch.Tensor, num_shards: int) -> torch.Tensor:
    """The virtual shard of each id of ``table`` (int64 ``[n]`` -> int64 ``[n]`` in
    ``[0, num_shards)``): a hash, so that consecutive ids spread over every shard."""
    with np.errstate(over="ignore"):
        z = mix64(ids.numpy().view(np.uint64) ^ _name_key(table, 0x5EED))
    return torch.from_numpy((z % np.uint64(num_shards)).astype(np.int64))


def initial_rows(spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
    """The initial value of the rows of ``ids`` (float32 ``[n, dim]``): uniform in
    ``[-scale, scale]`` from a hash of (seed, table, id, column), so a row starts the same
    whichever server creates it, and a row never trained need not be stored."""
    n = ids.numel()
    if n == 0:
        return torch.empty(0, spec.dim, dtype=torch.float32)
    with np.errstate(over="ignore"):
        base = ids.numpy().view(np.uint64)[:, None] * _GAMMA
        cols = (np.arange(1, spec.dim + 1, dtype=np.uint64) * _M2)[None, :]
        z = mix64(base ^ cols ^ _name_key(spec.name, spec.seed))
    unit = (z >> _S40).astype(np.float32) * _INV24  # [0, 1), 24 bits: exact in float32
    out = torch.from_numpy(unit)
    return out.mul_(2.0 * spec.scale).sub_(spec.scale)


def default_shard_map(num_shards: int, servers: int) -> list[int]:
    """Virtual shard ``v`` on server ``v % servers``."""
    if servers < 1:
        raise PSError("a shard map needs at least one server")
    return [v % servers for v in range(num_shards)]
