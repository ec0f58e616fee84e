"""Logical workers (EasyScale's EasyScaleThreads, section 3.2): N of them over any k <= N processes.

A job started with ``--logical-workers N`` trains exactly what N data-parallel workers would,
bitwise, whatever the number of processes and through rescales and failures (level D1 of
EasyScale section 3.3). What each logical worker (EST) owns:

* **its data**: at step ``s`` of an epoch, EST ``r`` trains batch ``s * N + r`` of the epoch's
  batch order (a permutation of the dataset's batch-sized chunks seeded by the epoch), so the
  global batch is N batches whatever k is;
* **its random streams**: before its turn, the torch, numpy and Python generators are seeded
  from ``(seed, r, global step)``. A context is therefore three integers: moving an EST to
  another process, or bringing it back after its process died, moves nothing else. (EasyScale
  saves the evolving RNG states in the EST context; deriving them per step gives the same
  guarantee with a context that cannot be lost.)
* **its gradient**: after its backward pass the gradient autograd made is kept aside until the
  step's reduction (no copy; parameters and optimizer state are shared by the ESTs of a
  process, as in the paper);
* **module buffers follow EST 0**, as DDP's follow rank 0: every EST's forward starts from the
  buffers the step started with, and the step ends with the buffers EST 0 produced.

Gradients are reduced in logical order, never by an all-reduce whose summation order depends
on the world size: each process owns a slice of the flattened gradient, receives the N
contributions to its slice (all-to-all), adds them left to right in logical rank order, and
the slices are all-gathered. ``TIDAL_REDUCTION=allreduce`` switches to a plain all-reduce, to
show that it breaks reproducibility.

Levels (``TIDAL_DETERMINISM``):

* ``D0``: fixed seeds and ``torch.use_deterministic_algorithms(True)``: the same run on the same
  number of processes repeats bitwise. Cost: deterministic kernels may be slower; on CPU the
  example's DLRM loses ~3.5% (its ``gram[:, rows, cols]`` backward takes a sort-based
  ``index_put_``; bench/RESULTS.md), on GPU convolutions lose vendor kernels.
* ``D1`` (default with logical workers): D0 plus the logical-order reduction: identical across
  process counts, rescales and failures. Cost: an all-to-all and an all-gather instead of one
  all-reduce, and one stashed gradient per EST beyond the first in a process.
* ``D2`` (CPU): D1 plus a pinned intra-op thread count (``TIDAL_THREADS``, default 1, whatever
  ``OMP_NUM_THREADS`` says) and ATen's CPU kernels pinned to one instruction set
  (``ATEN_CPU_CAPABILITY``, set by ``tidal run`` before the worker starts): identical across
  thread settings and across x86 machines with different vector units. It cannot promise
  identity across CPU architectures (x86 vs ARM) or across torch/MKL versions, whose kernels
  differ; D1 already pins the thread count, since it costs nothing on a CPU worker.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tidal.api.sharding import shard_starts

MASK64 = (1 << 64) - 1


def est_ranks(n_logical: int, world_size: int, rank: int) -> list[int]:
    """The logical ranks process ``rank`` runs: contiguous blocks, the first ones one larger.

    3 processes for 4 ESTs hold [0, 1], [2] and [3].
    """
    if not 1 <= world_size <= n_logical:
        raise ValueError(f"{world_size} processes cannot run {n_logical} logical workers")
    base, extra = divmod(n_logical, world_size)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (1 if rank < extra else 0)))


def _mix(x: int) -> int:
    """splitmix64: a well-spread 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def est_seed(seed: int, logical_rank: int, step: int) -> int:
    return _mix(_mix(_mix(seed & MASK64) ^ logical_rank) ^ step) >> 1  # 63 bits: torch wants < 2**63


def enter_context(seed: int, logical_rank: int, step: int) -> None:
    """Seed every generator the script may use for EST ``logical_rank`` at global step ``step``."""
    s = est_seed(seed, logical_rank, step)
    # the CPU generator directly: torch.manual_seed also walks every accelerator backend
    # (~100 us a call here, for every logical worker of every step)
    torch.default_generator.manual_seed(s)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(s)
    np.random.seed(s % (1 << 32))
    random.seed(s)


@dataclass(frozen=True)
class BatchSchedule:
    """The deterministic data order of N logical workers (an EST's place by logical rank)."""

    size: int
    batch_size: int
    n_logical: int
    shuffle: bool
    seed: int

    @property
    def chunks(self) -> int:
        return -(-self.size // self.batch_size)

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.chunks // self.n_logical)

    def order(self, epoch: int) -> list[int]:
        """The epoch's chunk order: the shard-order convention with one chunk per shard."""
        return shard_starts(self.chunks, 1, self.shuffle, self.seed, epoch)

    def batch(self, order: list[int], epoch_step: int, logical_rank: int) -> tuple[int, int]:
        """``[start, end)`` of EST ``logical_rank`` at this step of the epoch ((0, 0): none)."""
        k = epoch_step * self.n_logical + logical_rank
        if k >= len(order):
            return (0, 0)
        start = order[k] * self.batch_size
        return (start, min(start + self.batch_size, self.size))


Grads = list[torch.Tensor]
"""One tensor per trainable parameter, in the parameters' order and shapes: a gradient."""


@dataclass(frozen=True)
class Weighting:
    """How the N contributions of a step make the gradient of the mean loss over its samples.

    EST ``r`` trained ``n_r`` samples; the step's gradient is ``sum_r (n_r / total) * g_r``.
    When every EST had a full batch (all ``n_r`` equal, the usual case) the contributions are
    summed as they are and the sum is scaled once (``after = n / total``, exactly 1.0 for one
    EST); otherwise each is scaled by its share first (``per``). Both reductions (the local sum
    and the slices of ``RoundComm.reduce_in_logical_order``) apply the same rule elementwise,
    and it depends only on the step's batches, so the bits do not depend on the processes.
    """

    per: tuple[float, ...] | None
    after: float

    @classmethod
    def of(cls, sizes: Sequence[int]) -> Weighting:
        total = sum(sizes)
        if total <= 0:
            raise ValueError("a step without samples has no gradient")
        if all(n == sizes[0] for n in sizes):
            return cls(None, sizes[0] / total)
        return cls(tuple(n / total for n in sizes), 1.0)


class GradientStash:
    """One gradient per EST of this process, kept until the step's reduction (EasyScale 3.2).

    ``put`` keeps the parameters' ``.grad`` tensors themselves (autograd made them for this EST
    alone and nothing else holds them) and leaves ``.grad`` empty for the next EST: no copy.
    ``take`` hands them over to the reduction, which may scale and add into them and make them
    the parameters' ``.grad``; the stash keeps nothing between steps, so memory is one
    gradient per EST of this process, during a step.
    """

    def __init__(self) -> None:
        self.grads: dict[int, Grads] = {}

    def put(self, logical_rank: int, params: list[torch.nn.Parameter]) -> None:
        self.grads[logical_rank] = param_grads(params)
        for p in params:
            p.grad = None

    def put_zeros(self, logical_rank: int, params: list[torch.nn.Parameter]) -> None:
        """An EST without data this step: it adds exact zeros."""
        self.grads[logical_rank] = [torch.zeros_like(p) for p in params]

    def take(self, ranks: list[int]) -> list[Grads]:
        """The gradients of ``ranks``, in that order; the stash forgets them."""
        return [self.grads.pop(r) for r in ranks]


def sum_in_order(contributions: list[Grads]) -> Grads:
    """Left-to-right sum: ``((c0 + c1) + c2) + ...``, the one summation order used everywhere.

    Adds into the first contribution's tensors (the caller hands them over) and returns them;
    elementwise, so the same as the flat sums of ``RoundComm.reduce_in_logical_order``.
    """
    acc = contributions[0]
    for c in contributions[1:]:
        torch._foreach_add_(acc, c)
    return acc


def weighted_sum(contributions: list[Grads], weighting: Weighting) -> Grads:
    """The step's gradient from all N contributions (in logical order), in their own tensors."""
    if weighting.per is not None:
        for c, w in zip(contributions, weighting.per, strict=True):
            if w != 1.0:
                torch._foreach_mul_(c, w)
    acc = sum_in_order(contributions)
    if weighting.after != 1.0:  # x * 1.0 == x bitwise: skip the pass
        torch._foreach_mul_(acc, weighting.after)
    return acc


def param_grads(params: list[torch.nn.Parameter]) -> Grads:
    """Each parameter's gradient, zeros where it has none."""
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def flatten(grads: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors one after the other in one 1-D tensor (``unflatten``/``set_grads`` undo it)."""
    return torch.cat([g.reshape(-1) for g in grads], out=out)


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> Grads:
    """Views of consecutive pieces of ``flat`` shaped as ``like``."""
    sizes = [g.numel() for g in like]
    return [piece.view(g.shape) for piece, g in zip(flat[:sum(sizes)].split(sizes), like, strict=True)]


def set_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Copy consecutive pieces of ``flat`` (a reused communication buffer) into ``.grad``."""
    for p, piece in zip(params, unflatten(flat, params), strict=True):
        if p.grad is None:
            p.grad = piece.clone()
        else:
            p.grad.copy_(piece)
