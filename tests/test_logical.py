"""The in-process pieces of logical workers: gradient stash, summation order, writing .grad."""

from __future__ import annotations

import torch

from tidal.worker.logical import (
    GradientStash,
    Weighting,
    flatten,
    set_grads,
    sum_in_order,
    unflatten,
    weighted_sum,
)


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
    stash.put(3, params)
    assert all(p.grad is None for p in params)
    stash.put(5, params)  # no gradient at all: exact zeros
    (three, five) = stash.take([3, 5])
    assert all(a is b for a, b in zip(three, made, strict=True))  # no copy: autograd's own tensors
    assert all(torch.equal(g, torch.zeros_like(p)) for g, p in zip(five, params, strict=True))
    assert stash.grads == {}  # nothing kept between steps


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
    full = weighted_sum([[torch.tensor([1.0, 3.0])], [torch.tensor([2.0, 5.0])]], Weighting.of([4, 4]))
    assert torch.equal(full[0], torch.tensor([1.5, 4.0]))
    uneven = weighted_sum([[torch.tensor([1.0])], [torch.tensor([7.0])], [torch.tensor([9.0])]],
                          Weighting.of([3, 1, 0]))
    assert torch.equal(uneven[0], torch.tensor([1.0 * 0.75 + 7.0 * 0.25]))
