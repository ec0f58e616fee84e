"""In-process fakes of the worker's collectives: N simulated workers without a process group.

``FakeComm`` implements ``tidal.worker.step.StepComm``, the protocol the step runner drives
(the real one is ``tidal.worker.comm.RoundComm``, which a world of one can use as it is): every
reduction sums the members' contributions in rank order, as the real collectives do, headers
come back as one row per rank, and a broadcast copies the source rank's tensors. ``BrokenComm``
fails the reductions every step starts with (``CollectiveError``), as when a peer was killed.

N workers are simulated by N threads that share one ``FakeGroup``: each thread holds its own
``FakeComm(group, rank)`` (and its own model, optimizer and step runner) and calls the
collectives as a real worker would. Every ``exchange`` meets at a barrier, so a member blocks
until all ``world_size`` members have sent their value; a member that never comes makes the
others fail with ``threading.BrokenBarrierError`` after the barrier's timeout instead of hanging.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from tidal.worker.api import CollectiveError
from tidal.worker.logical import Grads, flatten, param_grads, set_grads, sum_and_scale, unflatten

if TYPE_CHECKING:
    from tidal.worker.step import StepComm


class FakeGroup:
    """The members of a simulated round: each ``exchange`` returns every member's value."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=20)
        self._slots: list[Any] = [None] * world_size

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()  # everyone has read before the next exchange writes
        return values


class FakeComm:
    """``RoundComm``'s step collectives over a ``FakeGroup``: sums in rank order."""

    def __init__(self, group: FakeGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self._reduced: torch.Tensor | None = None

    def reduce_with_header(self, params: list[torch.nn.Parameter], weight: float, row: list[int]) -> torch.Tensor:
        mine = flatten(param_grads(params)) * weight
        values = self.group.exchange(self.rank, (mine, row))
        acc = values[0][0].clone()
        for flat, _ in values[1:]:
            acc.add_(flat)
        self._reduced = acc
        return torch.tensor([r for _, r in values], dtype=torch.int64)

    def apply_reduced(self, params: list[torch.nn.Parameter], scale: float) -> None:
        assert self._reduced is not None
        set_grads(params, self._reduced * scale)
        self._reduced = None

    def reduce_in_logical_order(self, local: list[Grads], counts: list[int], after: float,
                                row: list[int]) -> tuple[Grads, list[list[int]]]:
        assert len(local) == counts[self.rank], (len(local), counts)
        values = self.group.exchange(self.rank, ([flatten(c) for c in local], row))
        flats = [f for sent, _ in values for f in sent]  # rank order is logical order
        acc = flats[0].clone()
        for f in flats[1:]:
            acc.add_(f)
        if after != 1.0:
            acc.mul_(after)
        return unflatten(acc, local[0]), [list(r) for _, r in values]

    def reduce_by_allreduce(self, local: list[Grads], after: float,
                            row: list[int]) -> tuple[Grads, list[list[int]]]:
        partial = flatten(sum_and_scale(local, after))
        values = self.group.exchange(self.rank, (partial, row))
        acc = values[0][0].clone()
        for flat, _ in values[1:]:
            acc.add_(flat)
        return unflatten(acc, local[0]), [list(r) for _, r in values]

    def broadcast_tensors(self, tensors: list[torch.Tensor], source: int) -> None:
        values = self.group.exchange(self.rank, [t.detach().clone() for t in tensors])
        with torch.no_grad():
            for t, v in zip(tensors, values[source], strict=True):
                t.copy_(v)


class BrokenComm(FakeComm):
    """Every collective fails, as when a peer was killed."""

    def __init__(self) -> None:
        super().__init__(FakeGroup(1), 0)

    def reduce_with_header(self, params: list[torch.nn.Parameter], weight: float, row: list[int]) -> torch.Tensor:
        raise CollectiveError("gradient all-reduce failed: peer gone")

    def reduce_in_logical_order(self, local: list[Grads], counts: list[int], after: float,
                                row: list[int]) -> tuple[Grads, list[list[int]]]:
        raise CollectiveError("logical-order reduction failed: peer gone")


if TYPE_CHECKING:
    def _implements_step_comm(comm: FakeComm) -> StepComm:
        return comm  # mypy checks here that the fake keeps up with the protocol
