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
  process, as in the paper). The process holding logical rank 0 adds each one into the first
  as it is made, which is the reduction's own sum in its own order (``GradientStash``);
* **module buffers follow EST 0**, as DDP's follow rank 0: every EST's forward starts from the
  buffers the step started with, and the step ends with the buffers EST 0 produced (the
  persistent ones, those in the model's ``state_dict``: BatchNorm statistics; index tables
  registered with ``persistent=False`` are not state and are left alone).

The script's loop is unchanged: it still calls ``optimizer.zero_grad()`` before every batch.
With ESTs that call finds every ``.grad`` already stashed away (or, before a step's first
batch, released: the step is applied inside the loader, where the script cannot see the
gradient, and tidal sets ``.grad`` to None right after ``optimizer.step()``), so tidal makes it
return at once (``skip_empty_zero_grad``) instead of paying torch's profiler annotation E times
a step. After the loop, ``.grad`` is None.

Gradients are reduced in logical order, never by an all-reduce whose summation order depends
on the world size: each process owns a slice of the flattened gradient, receives the N
contributions to its slice (all-to-all), adds them left to right in logical rank order, and
the slices are all-gathered. ``TIDAL_REDUCTION=allreduce`` switches to a plain all-reduce, to
show that it breaks reproducibility.

Levels (``TIDAL_DETERMINISM``):

* ``D0``: fixed seeds and ``torch.use_deterministic_algorithms(True)``: the same run on the same
  number of processes repeats bitwise. Cost: deterministic kernels may be slower (on GPU,
  convolutions lose vendor kernels and scatter-adds get sorted); on CPU the example's DLRM
  loses under 1% (its ``gram[:, rows, cols]`` backward takes a sort-based ``index_put_``). The
  flag's NaN fill of every ``torch.empty`` (``torch.utils.deterministic.fill_uninitialized_memory``)
  is turned off: it makes no kernel deterministic, only exposes reads of uninitialized memory,
  and cost 1-3% here; ``TIDAL_FILL_UNINITIALIZED=1`` turns it back on.
* ``D1`` (default with logical workers): D0 plus the logical-order reduction: identical across
  process counts, rescales and failures. Cost: an all-to-all and an all-gather instead of one
  all-reduce, and one stashed gradient per EST beyond the first in a process (but the one
  holding logical rank 0, which folds them into one).
* ``D2`` (CPU): D1 plus a pinned intra-op thread count (``TIDAL_THREADS``, default 1, whatever
  ``OMP_NUM_THREADS`` says) and ATen's CPU kernels pinned to one instruction set
  (``ATEN_CPU_CAPABILITY``, set by ``tidal run`` before the worker starts): identical across
  thread settings and across x86 machines with different vector units. It cannot promise
  identity across CPU architectures (x86 vs ARM) or across torch/MKL versions, whose kernels
  differ; D1 already pins the thread count, since it costs nothing on a CPU worker.
"""

from __future__ import annotations

import functools
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


def folds(rank: int) -> bool:
    """Whether process ``rank`` folds its ESTs' gradients into one as they are made: only the
    one whose block starts at logical rank 0, where the step's left-to-right sum starts."""
    return rank == 0


def contributions_sent(n_logical: int, world_size: int) -> list[int]:
    """How many gradients each process sends to the reduction: its block, or one if it folds."""
    return [1 if folds(p) else len(est_ranks(n_logical, world_size, p)) for p in range(world_size)]


def _mix(x: int) -> int:
    """splitmix64: a well-spread 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def est_seed(seed: int, logical_rank: int, step: int) -> int:
    return _mix(_est_stream(seed, logical_rank) ^ step) >> 1  # 63 bits: torch wants < 2**63


@functools.lru_cache(maxsize=4096)
def _est_stream(seed: int, logical_rank: int) -> int:
    """The part of ``est_seed`` that does not change from step to step (hashed once)."""
    return _mix(_mix(seed & MASK64) ^ logical_rank)


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
    EST); otherwise each is scaled by its share as it is stashed (``per``). Every process and
    both reductions apply the same rule elementwise, and it depends only on the step's
    batches, so the bits do not depend on the processes.
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
    """This process's contributions to a step's gradient, kept until the reduction (EasyScale 3.2).

    An EST's contribution is the gradient autograd made for its batch (no copy), scaled by its
    share when the step's batches are uneven (``Weighting.per``). ``put`` takes the parameters'
    ``.grad`` tensors and leaves ``.grad`` empty for the next EST.

    With ``fold`` (``folds(rank)``: the process whose block starts at logical rank 0) each
    contribution is added into the first one as soon as it is made: the step's sum is a left
    fold from logical rank 0 (``sum_in_order``), so ``(c0 + c1) + c2`` made here is the very sum,
    in the very order, that the reduction would make, only while the gradient is still in cache,
    and the process keeps one gradient instead of one per EST. The other processes' blocks sit
    in the middle of the fold, so they keep one per EST (``contributions_sent``). Contributions
    must come in logical order.
    """

    def __init__(self) -> None:
        self.grads: list[Grads] = []
        self.weighting = Weighting(None, 1.0)
        self.fold = False
        self._last = -1

    def begin(self, weighting: Weighting, fold: bool) -> None:
        """A new step: whatever an interrupted step left is dropped."""
        self.grads, self.weighting, self.fold, self._last = [], weighting, fold, -1

    def put(self, logical_rank: int, params: list[torch.nn.Parameter]) -> None:
        grads = param_grads(params)
        for p in params:
            p.grad = None
        self._add(logical_rank, grads)

    def put_zeros(self, logical_rank: int, params: list[torch.nn.Parameter]) -> None:
        """An EST without data this step: it adds exact zeros."""
        self._add(logical_rank, [torch.zeros_like(p) for p in params])

    def _add(self, logical_rank: int, grads: Grads) -> None:
        if logical_rank <= self._last:
            raise RuntimeError(f"logical worker {logical_rank} stashed after {self._last}: out of order")
        self._last = logical_rank
        per = self.weighting.per
        if per is not None and per[logical_rank] != 1.0:
            torch._foreach_mul_(grads, per[logical_rank])
        if self.fold and self.grads:
            torch._foreach_add_(self.grads[0], grads)
        else:
            self.grads.append(grads)

    def take(self) -> list[Grads]:
        """The contributions in logical order (folded: one); the stash forgets them."""
        grads, self.grads = self.grads, []
        return grads


def skip_empty_zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """Make the script's ``optimizer.zero_grad()`` return at once when there is nothing to clear.

    The script calls it before every batch, so E times a step with E ESTs in a process, and
    every ``.grad`` is None by then (stashed after the previous EST's backward, or released
    after the step was applied): the call changes nothing but still pays torch's profiler
    annotation (``record_function``, two Python-level op dispatches), ~75 us in a training loop
    on this VM, ~3% of an EST's batch of the example. When any parameter has a gradient the
    optimizer's own ``zero_grad`` runs, with the caller's arguments, so nothing the script sees
    changes. (An instance attribute: the class and other optimizers are untouched.)
    """
    original = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    original(set_to_none)
                    return

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]


def sum_in_order(contributions: list[Grads]) -> Grads:
    """Left-to-right sum: ``((c0 + c1) + c2) + ...``, the one summation order used everywhere.

    Adds into the first contribution's tensors (the caller hands them over) and returns them;
    elementwise, so the same as the flat sums of ``RoundComm.reduce_in_logical_order``.
    """
    acc = contributions[0]
    for c in contributions[1:]:
        torch._foreach_add_(acc, c)
    return acc


def sum_and_scale(contributions: list[Grads], after: float) -> Grads:
    """The step's gradient from its stashed contributions (in logical order), in their own tensors."""
    acc = sum_in_order(contributions)
    if after != 1.0:  # x * 1.0 == x bitwise: skip the pass
        torch._foreach_mul_(acc, after)
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
