"""The in-process pieces of logical workers: gradient stash, summation order, writing .grad."""

from __future__ import annotations

import pytest
import torch

from tidal.worker.logical import (
    GradientStash,
    Weighting,
    contributions_sent,
    flatten,
    set_grads,
    skip_empty_zero_grad,
    sum_and_scale,
    sum_in_order,
    unflatten,
)

pytestmark = pytest.mark.speed_free


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]


def test_set_grads_copies_and_ignores_what_follows_the_parameters() -> None:
    """Communication buffers carry the step header after the gradient, and are reused."""
    params = _params()
    flat = torch.arange(10 + 6, dtype=torch.float32)
    set_grads(params, flat)
    assert torch.equal(params[0].grad, torch.arange(6, dtype=torch.float32).view(2, 3))  # type: ignore[arg-type]
    assert torch.equal(params[1].grad, torch.arange(6, 10, dtype=torch.float32))  # type: ignore[arg-type]
    flat.zero_()
    assert params[1].grad is not None and params[1].grad[0] == 6


def test_stash_keeps_the_gradients_and_empties_grad() -> None:
    params = _params()
    made = [torch.full_like(p, 2.0) for p in params]
    for p, g in zip(params, made, strict=True):
        p.grad = g
    stash = GradientStash()
    stash.begin(Weighting(None, 1.0), fold=False)
    stash.put(3, params)
    assert all(p.grad is None for p in params)
    stash.put(5, params)  # no gradient at all: exact zeros
    (three, five) = stash.take()
    assert all(a is b for a, b in zip(three, made, strict=True))  # no copy: autograd's own tensors
    assert all(torch.equal(g, torch.zeros_like(p)) for g, p in zip(five, params, strict=True))
    assert stash.take() == []  # nothing kept between steps
    with pytest.raises(RuntimeError, match="out of order"):
        stash.put(4, params)


def _contributions(n: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(n)
    return [[torch.randn(2, 3, generator=g) * 10.0 ** i, torch.randn(4, generator=g)] for i in range(n)]


@pytest.mark.parametrize("sizes", [[512, 512, 512], [512, 300, 0]])
def test_folding_as_stashed_gives_the_bits_of_the_sum_in_logical_order(sizes: list[int]) -> None:
    """The process holding logical rank 0 adds each contribution into the first as it comes."""
    weighting = Weighting.of(sizes)
    expect = sum_and_scale([[t * w for t in c] if weighting.per else c
                            for c, w in zip(_contributions(3), weighting.per or [1.0] * 3, strict=True)],
                           weighting.after)
    params = _params()
    for fold in (True, False):
        stash = GradientStash()
        stash.begin(weighting, fold=fold)
        for r, c in enumerate(_contributions(3)):
            for p, t in zip(params, c, strict=True):
                p.grad = t
            stash.put(r, params)
        local = stash.take()
        assert len(local) == (1 if fold else 3)  # folded: one gradient kept, not one per EST
        got = sum_and_scale(local, weighting.after)
        assert all(torch.equal(a, b) for a, b in zip(got, expect, strict=True))


def test_sum_in_order_is_left_to_right_and_elementwise_like_the_flat_sum() -> None:
    a, b, c = [torch.tensor([1e8, 3.0])], [torch.tensor([1.0, 1e-8])], [torch.tensor([-1e8, -3.0])]
    expect = (torch.tensor([1e8, 3.0]) + torch.tensor([1.0, 1e-8])) + torch.tensor([-1e8, -3.0])
    assert torch.equal(sum_in_order([a, b, c])[0], expect)
    assert sum_in_order([a])[0] is a[0]
    # the flat form the all-to-all path sums gives the same bits
    g = torch.Generator().manual_seed(0)
    parts = [[torch.randn(3, 4, generator=g), torch.randn(5, generator=g)] for _ in range(4)]
    flats = [flatten(p) for p in parts]
    acc = flats[0].clone()
    for f in flats[1:]:
        acc.add_(f)
    listed = sum_in_order([[t.clone() for t in p] for p in parts])
    assert torch.equal(flatten(listed), acc)
    assert [t.shape for t in unflatten(acc, listed)] == [torch.Size([3, 4]), torch.Size([5])]


def test_weighting_scales_once_when_batches_are_full_and_each_share_otherwise() -> None:
    assert Weighting.of([512, 512, 512, 512]) == Weighting(None, 0.25)
    assert Weighting.of([512]) == Weighting(None, 1.0)
    assert Weighting.of([512, 88, 0]) == Weighting((512 / 600, 88 / 600, 0.0), 1.0)
    full = sum_and_scale([[torch.tensor([1.0, 3.0])], [torch.tensor([2.0, 5.0])]], Weighting.of([4, 4]).after)
    assert torch.equal(full[0], torch.tensor([1.5, 4.0]))
    stash = GradientStash()
    stash.begin(Weighting.of([3, 1, 0]), fold=True)
    params = [torch.nn.Parameter(torch.zeros(1))]
    for r, value in enumerate([1.0, 7.0]):
        params[0].grad = torch.tensor([value])
        stash.put(r, params)
    stash.put_zeros(2, params)
    assert torch.equal(sum_and_scale(stash.take(), 1.0)[0], torch.tensor([1.0 * 0.75 + 7.0 * 0.25]))
    with pytest.raises(ValueError):
        Weighting.of([0, 0])


def test_zero_grad_returns_at_once_only_when_there_is_nothing_to_clear() -> None:
    params = _params()
    optimizer = torch.optim.SGD(params, lr=0.1)
    calls = []
    original = optimizer.zero_grad
    optimizer.zero_grad = lambda set_to_none=True: (calls.append(set_to_none), original(set_to_none))  # type: ignore[method-assign]
    skip_empty_zero_grad(optimizer)
    optimizer.zero_grad()
    assert calls == []  # no gradient anywhere: torch's zero_grad is not called
    g = torch.ones(4)
    params[1].grad = g
    optimizer.zero_grad(set_to_none=False)  # the optimizer's own, with the caller's arguments
    assert calls == [False] and params[1].grad is g and torch.equal(g, torch.zeros(4))
    optimizer.zero_grad()
    assert calls == [False, True] and params[1].grad is None


def test_only_the_process_holding_logical_rank_0_sends_its_block_folded() -> None:
    assert contributions_sent(4, 1) == [1]
    assert contributions_sent(4, 3) == [1, 1, 1]  # blocks [0, 1], [2], [3]
    assert contributions_sent(8, 3) == [1, 3, 2]  # blocks [0, 1, 2], [3, 4, 5], [6, 7]
