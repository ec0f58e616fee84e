"""Applying a step (tidal.worker.step.StepRunner), in one process, without a master.

A world of one uses the real ``RoundComm`` (it has no process group then). Several workers are
simulated by ``tidal.worker.fake.FakeComm``: a hand-written communicator with ``RoundComm``'s
methods whose members, one thread each, meet at a barrier and sum what they sent in rank order,
as the real collectives do. Each simulated worker has its own model, optimizer, state and host.
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import pytest
import torch

from tidal.worker.api import CollectiveError, UsageError
from tidal.worker.comm import RoundComm
from tidal.worker.fake import BrokenComm, FakeComm, FakeGroup
from tidal.worker.state import State
from tidal.worker.step import AppliedStep, StepOutcome, StepRunner

CPU = torch.device("cpu")
LR = 0.1
M = TypeVar("M", bound=torch.nn.Module)


# ---------------------------------------------------------------------------- fakes
class FakeHost:
    """The membership side as the runner sees it; remembers what it was told, in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reform_notice = False
        self.state: State | None = None
        self.events: list[str] = []
        self.applied: list[AppliedStep] = []
        self.seen_at_apply: list[tuple[bool, int]] = []  # (lock held, state's step count)
        self.broken: list[CollectiveError] = []

    def step_applied(self, applied: AppliedStep) -> None:
        assert self.state is not None
        self.seen_at_apply.append((self.lock.locked(), self.state.applied_step))
        self.applied.append(applied)
        self.events.append(f"applied {applied.step}")

    def collective_broke(self, exc: CollectiveError) -> None:
        self.broken.append(exc)
        self.events.append("broken")

    def leave_for_rendezvous(self, why: str) -> None:
        self.events.append(f"leave: {why}")


class Worker(Generic[M]):
    """One simulated worker: its model, optimizer, state, host and step runner."""

    def __init__(self, model: M, comm: Any, *, worker_id: int = 0, rank: int = 0,
                 world_size: int = 1, logical: int | None = None, ledger: bool = True,
                 reduction: str = "ordered") -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        self.state = State(model, self.optimizer)
        self.host = FakeHost()
        self.host.state = self.state
        ticks = itertools.count()
        self.steps = StepRunner(self.state, self.host, worker_id=worker_id, lock=self.host.lock, logical=logical,
                                ledger=ledger, reduction=reduction, clock=lambda: float(next(ticks)))
        self.steps.enter_round(comm, rank, world_size)

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss_of(self.model, x, y).backward()

    def logical_ests(self, epoch: int, batches: list[tuple[int, int]], x: torch.Tensor, y: torch.Tensor) -> None:
        """What the loader and the script do for this process's ESTs of one step, but the reduction."""
        self.steps.begin_logical(epoch, batches)
        for r in self.steps.local_ests:
            s, e = batches[r]
            if e <= s:
                continue
            self.steps.enter_est(r)
            self.backward(x[s:e], y[s:e])
            assert self.steps.step() is True


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x).squeeze(1) - y) ** 2).mean()


def linear(dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 1).to(dtype)


def data(n: int, dtype: torch.dtype = torch.float64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=dtype), torch.randn(n, generator=g, dtype=dtype)


def sgd_by_hand(model: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One SGD step on the mean squared error over ``x``: d/dw = 2/n sum r x, d/db = 2/n sum r."""
    w, b = model.weight.detach(), model.bias.detach()
    r = x @ w[0] + b[0] - y
    n = len(y)
    return w - LR * (2 / n) * (r @ x)[None, :], b - LR * (2 / n) * r.sum().reshape(1)


def together(*calls: Callable[[], Any]) -> list[Any]:
    """Run the simulated workers' collectives at the same time, one thread each."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            results[i] = call()
        except BaseException as exc:  # handed to the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a simulated worker hung"
    if errors:
        raise errors[0]
    return results


def spans(records: Any) -> list[tuple[int, int, int, int, int]]:
    return [(r.step, r.worker, r.epoch, r.start, r.end) for r in records]


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------------------- plain steps
def test_a_step_alone_applies_the_gradient_of_its_batch_and_commits() -> None:
    worker = Worker(linear(), RoundComm(0, 1, "gloo", CPU), worker_id=7)
    x, y = data(4)
    want_w, want_b = sgd_by_hand(worker.model, x, y)
    pending = worker.steps.begin(2, 10, 14)
    assert (pending.step, pending.mine) == (0, 4)
    worker.backward(x, y)
    assert worker.steps.step() is True
    assert worker.steps.pending is None
    assert torch.allclose(worker.model.weight, want_w, rtol=0, atol=1e-12)
    assert torch.allclose(worker.model.bias, want_b, rtol=0, atol=1e-12)
    [applied] = worker.host.applied
    assert (applied.step, applied.mine, applied.total) == (0, 4, 4)
    assert spans(applied.records) == [(0, 7, 2, 10, 14)]
    assert worker.host.seen_at_apply == [(True, 0)]  # counted together with its records
    worker.state.restore()
    assert worker.state.applied_step == 0  # committed
    assert worker.host.events == ["applied 0"]


def pair(id_a: int = 0, id_b: int = 1) -> tuple[Worker, Worker]:
    """Two workers of one simulated round (ranks 0 and 1), with the same initial model."""
    group = FakeGroup(2)
    return (Worker(linear(), FakeComm(group, 0), worker_id=id_a, rank=0, world_size=2),
            Worker(linear(), FakeComm(group, 1), worker_id=id_b, rank=1, world_size=2))


def test_two_workers_apply_the_mean_gradient_over_both_batches() -> None:
    a, b = pair(3, 5)
    x, y = data(4)
    want_w, want_b = sgd_by_hand(a.model, x, y)
    a.steps.begin(0, 0, 3)
    a.backward(x[:3], y[:3])
    b.steps.begin(0, 3, 4)
    b.backward(x[3:], y[3:])
    assert together(a.steps.apply, b.steps.apply) == [StepOutcome.APPLIED] * 2
    for w in (a, b):
        assert torch.allclose(w.model.weight, want_w, rtol=0, atol=1e-12)
        assert torch.allclose(w.model.bias, want_b, rtol=0, atol=1e-12)
        [applied] = w.host.applied
        assert applied.total == 4
        assert spans(applied.records) == [(0, 3, 0, 0, 3), (0, 5, 0, 3, 4)]
    assert (a.host.applied[0].mine, b.host.applied[0].mine) == (3, 1)
    assert torch.equal(a.model.weight, b.model.weight)


def test_a_stream_step_commits_every_partition_it_trained_on_every_worker() -> None:
    """A stream step of several partitions: the header carries each range (partition, read
    after, first, last, records), so every member makes the same records of everyone's ranges,
    the samples each range held, and the mean over all of them."""
    a, b = pair(3, 5)
    x, y = data(6)
    want_w, _ = sgd_by_hand(a.model, x, y)
    a.steps.begin_stream([(0, 10, 11, 14, 3), (4, 20, 21, 21, 1), (6, 7, 9, 9, 1)])
    a.backward(x[:5], y[:5])
    b.steps.begin_stream([(1, 0, 1, 1, 1)])
    b.backward(x[5:], y[5:])
    assert together(a.steps.apply, b.steps.apply) == [StepOutcome.APPLIED] * 2
    for w in (a, b):
        assert torch.allclose(w.model.weight, want_w, rtol=0, atol=1e-12)
        records = [(r.worker, r.epoch, r.start, r.first, r.end, r.samples) for r in w.host.applied[0].records]
        assert records == [(3, 0, 10, 11, 14, 3), (3, 4, 20, 21, 21, 1), (3, 6, 7, 9, 9, 1), (5, 1, 0, 1, 1, 1)]
    assert (a.host.applied[0].mine, a.host.applied[0].total) == (5, 6)
    with pytest.raises(UsageError, match="1 to 8 ranges"):
        a.steps.begin_stream([(p, 0, 1, 1, 1) for p in range(9)])


def test_a_worker_without_data_takes_part_and_the_epoch_ends_when_nobody_has_any() -> None:
    a, b = pair()
    x, y = data(2)
    want_w, _ = sgd_by_hand(a.model, x, y)
    a.steps.begin(0, 8, 10)
    a.backward(x, y)
    b.model.weight.grad = torch.full_like(b.model.weight, float("nan"))  # left over: an empty step clears it
    assert together(a.steps.apply, lambda: b.steps.empty(0)) == [StepOutcome.APPLIED] * 2
    assert torch.allclose(b.model.weight, want_w, rtol=0, atol=1e-12)
    assert spans(b.host.applied[0].records) == [(0, 0, 0, 8, 10)]  # only the worker with samples
    assert b.host.applied[0].mine == 0

    assert together(lambda: a.steps.empty(0), lambda: b.steps.empty(0)) == [StepOutcome.EPOCH_END] * 2
    for w in (a, b):
        assert len(w.host.applied) == 1 and w.state.applied_step == 0  # nothing applied
        w.steps.end_epoch()
        w.state.restore()
        assert (w.state.epoch, w.state.epoch_step, w.state.applied_step) == (1, 0, 0)


def test_a_broken_collective_applies_and_commits_nothing() -> None:
    worker = Worker(linear(), BrokenComm())
    before = params_of(worker.model)
    x, y = data(4)
    worker.steps.begin(0, 0, 4)
    worker.backward(x, y)
    assert worker.steps.step() is False
    assert [str(e) for e in worker.host.broken] == ["gradient all-reduce failed: peer gone"]
    assert worker.host.events == ["broken"] and worker.host.applied == []
    assert all(torch.equal(p, q) for p, q in zip(params_of(worker.model), before, strict=True))
    assert worker.optimizer.state_dict()["state"] == {}
    worker.state.restore()
    assert worker.state.applied_step == -1
    assert worker.steps.pending is None


def test_a_reform_asked_of_one_worker_makes_every_worker_leave_after_the_step() -> None:
    a, b = pair()
    b.host.reform_notice = True
    x, y = data(4)
    a.steps.begin(0, 0, 2)
    a.backward(x[:2], y[:2])
    b.steps.begin(0, 2, 4)
    b.backward(x[2:], y[2:])
    assert together(a.steps.apply, b.steps.apply) == [StepOutcome.APPLIED] * 2
    for w in (a, b):
        assert w.host.events == ["applied 0", "leave: re-form requested by the master"]
        assert w.state.applied_step == 0


def test_without_a_master_no_records_are_made() -> None:
    worker = Worker(linear(), RoundComm(0, 1, "gloo", CPU), ledger=False)
    x, y = data(4)
    worker.steps.begin(0, 0, 4)
    worker.backward(x, y)
    worker.steps.step()
    assert worker.host.applied[0].records == []


def test_the_script_is_told_when_it_breaks_the_order() -> None:
    worker = Worker(linear(), RoundComm(0, 1, "gloo", CPU))
    with pytest.raises(UsageError, match="without a batch"):
        worker.steps.step()
    worker.steps.begin(0, 0, 4)
    with pytest.raises(UsageError, match="once for every batch"):
        worker.steps.begin(0, 4, 8)
    worker.steps.leave_round()  # a re-form drops the step in flight
    assert worker.steps.pending is None
    with pytest.raises(UsageError, match="reduction"):
        StepRunner(worker.state, worker.host, worker_id=0, lock=worker.host.lock, reduction="fast")


# ---------------------------------------------------------------------------- logical workers
FULL = [(0, 4), (4, 8), (8, 12), (12, 16)]
SHORT = [(0, 4), (4, 8), (8, 12), (12, 14)]  # the epoch's last batch is short: weighted shares
LAST_EMPTY = [(0, 4), (4, 8), (8, 11), (0, 0)]  # the last EST has no data at this step


def logical_run(k: int, batches: list[tuple[int, int]], model: torch.nn.Module,
                x: torch.Tensor, y: torch.Tensor, reduction: str = "ordered") -> list[Worker[torch.nn.Module]]:
    """One step of 4 logical workers over ``k`` (simulated) processes."""
    group = FakeGroup(k)
    workers = [Worker(copy.deepcopy(model), RoundComm(0, 1, "gloo", CPU) if k == 1 else FakeComm(group, p),
                      worker_id=10 + p, rank=p, world_size=k, logical=4, reduction=reduction)
               for p in range(k)]
    for w in workers:
        w.logical_ests(1, batches, x, y)
    outcomes = together(*[w.steps.finish_logical for w in workers])
    assert outcomes == [StepOutcome.APPLIED] * k
    return workers


@pytest.mark.parametrize("batches", [FULL, SHORT, LAST_EMPTY], ids=["full", "short", "last-empty"])
def test_four_logical_workers_in_one_process_train_the_mean_over_their_batches(
        batches: list[tuple[int, int]]) -> None:
    x, y = data(16, torch.float32)
    model = linear(torch.float32)
    [worker] = logical_run(1, batches, model, x, y)
    plain = Worker(copy.deepcopy(model), RoundComm(0, 1, "gloo", CPU))
    rows = torch.cat([torch.arange(s, e) for s, e in batches])
    plain.steps.begin(0, 0, len(rows))
    plain.backward(x[rows], y[rows])
    plain.steps.step()
    for p, q in zip(worker.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)
        assert p.grad is None  # released after the optimizer step
    assert worker.state.epoch_step == 1
    [applied] = worker.host.applied
    assert (applied.step, applied.mine, applied.total) == (0, len(rows), len(rows))
    assert spans(applied.records) == [(0, 10, 1, s, e) for s, e in batches if e > s]


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("batches", [FULL, SHORT, LAST_EMPTY], ids=["full", "short", "last-empty"])
@pytest.mark.parametrize("reduction", ["ordered", "allreduce"])
def test_logical_workers_give_the_same_bits_over_any_number_of_processes(
        k: int, batches: list[tuple[int, int]], reduction: str) -> None:
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    [alone] = logical_run(1, batches, model, x, y)
    workers = logical_run(k, batches, model, x, y, reduction)
    same = [all(torch.equal(p, q) for p, q in zip(alone.model.parameters(), w.model.parameters(), strict=True))
            for w in workers]
    if reduction == "ordered":
        assert same == [True] * k
    else:  # the world-size-dependent sum: the processes agree with one another, not with one process
        assert all(torch.equal(p, q) for w in workers[1:]
                   for p, q in zip(workers[0].model.parameters(), w.model.parameters(), strict=True))
    holders = {0: 10, 1: 10, 2: 11, 3: 11} if k == 2 else {0: 10, 1: 10, 2: 11, 3: 12} if k == 3 else \
        {r: 10 + r for r in range(4)}
    for p, w in enumerate(workers):
        [applied] = w.host.applied
        assert spans(applied.records) == [(0, holders[r], 1, s, e) for r, (s, e) in enumerate(batches) if e > s]
        assert applied.mine == sum(e - s for r, (s, e) in enumerate(batches) if holders[r] == 10 + p)


def test_the_allreduce_reduction_does_not_give_the_bits_of_one_process() -> None:
    """The test above can tell sums apart: summed by partial sums, the bits differ."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    [alone] = logical_run(1, FULL, model, x, y)
    workers = logical_run(2, FULL, model, x, y, "allreduce")
    assert not all(torch.equal(p, q) for p, q in zip(alone.model.parameters(), workers[1].model.parameters(),
                                                     strict=True))


class Drift(torch.nn.Module):
    """Reads a buffer in its forward and moves it, as a running statistic does."""

    gain: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gain", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * float(self.gain)
        with torch.no_grad():
            self.gain.add_(x.abs().mean())
        return out


def test_every_logical_worker_starts_from_the_steps_buffers_and_the_step_ends_with_worker_0s() -> None:
    x, y = data(8, torch.float32)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), Drift(), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    batches = [(0, 4), (4, 8)]
    est0 = copy.deepcopy(model)
    est0(x[:4])  # EST 0's forward from the buffers the step started with
    runs = []
    for k in (1, 2):  # both ESTs in one process; one in each of two
        group = FakeGroup(k)
        workers = [Worker(copy.deepcopy(model), RoundComm(0, 1, "gloo", CPU) if k == 1 else FakeComm(group, p),
                          rank=p, world_size=k, logical=2) for p in range(k)]
        for w in workers:
            w.logical_ests(0, batches, x, y)
        together(*[w.steps.finish_logical for w in workers])
        runs.extend(workers)
    for w in runs:
        assert all(torch.equal(p, q) for p, q in zip(runs[0].model.parameters(), w.model.parameters(), strict=True))
        for (name, b), want in zip(w.model.named_buffers(), est0.buffers(), strict=True):
            assert torch.equal(b, want), name


def test_a_broken_logical_reduction_applies_nothing() -> None:
    x, y = data(16)
    worker = Worker(linear(), BrokenComm(), logical=4)
    before = params_of(worker.model)
    worker.logical_ests(0, FULL, x, y)
    assert worker.steps.finish_logical() is StepOutcome.BROKEN
    assert worker.host.events == ["broken"]
    assert all(torch.equal(p, q) for p, q in zip(params_of(worker.model), before, strict=True))
    assert (worker.state.applied_step, worker.state.epoch_step) == (-1, 0)
    assert worker.steps.logical_step is None


def test_logical_workers_refuse_more_processes_than_workers_and_misuse() -> None:
    worker = Worker(linear(), RoundComm(0, 1, "gloo", CPU), logical=2)
    with pytest.raises(UsageError, match="3 processes for 2 logical workers"):
        worker.steps.enter_round(RoundComm(0, 1, "gloo", CPU), 0, 3)
    worker.steps.enter_round(RoundComm(0, 1, "gloo", CPU), 0, 1)
    worker.steps.begin_logical(0, [(0, 4), (4, 8)])
    worker.steps.enter_est(0)
    worker.backward(*data(4))
    worker.steps.step()
    with pytest.raises(UsageError, match="twice"):
        worker.steps.step()
    plain = Worker(linear(), RoundComm(0, 1, "gloo", CPU))
    with pytest.raises(UsageError, match="without logical workers"):
        plain.steps.begin_logical(0, [(0, 4)])
