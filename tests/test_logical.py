"""The in-process pieces of logical workers: gradient stash, summation order, writing .grad."""

from __future__ import annotations

import torch

from tidal.worker.logical import GradientStash, set_grads, sum_in_order


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]


def test_set_grads_ignores_what_follows_the_parameters() -> None:
    """Communication buffers carry the step header after the gradient."""
    params = _params()
    flat = torch.arange(10 + 6, dtype=torch.float32)
    set_grads(params, flat)
    assert torch.equal(params[0].grad, torch.arange(6, dtype=torch.float32).view(2, 3))  # type: ignore[arg-type]
    assert torch.equal(params[1].grad, torch.arange(6, 10, dtype=torch.float32))  # type: ignore[arg-type]
    flat.zero_()  # copies, not views, unless owned
    assert params[1].grad is not None and params[1].grad[0] == 6


def test_owned_flat_becomes_views_and_the_stash_never_rewrites_it() -> None:
    params = _params()
    stash = GradientStash()
    for p in params:
        p.grad = torch.ones_like(p)
    stash.put(0, params, 1.0)
    assert all(p.grad is None for p in params)
    (first,) = stash.ordered([0])
    reduced = sum_in_order([first])
    set_grads(params, reduced, owned=True)
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    stash.put(0, params, 0.5)  # the next step: a new flat, the old one untouched
    assert torch.equal(first, torch.ones(10)) and torch.equal(stash.ordered([0])[0], torch.ones(10))
    assert stash.ordered([0])[0].data_ptr() != first.data_ptr()


def test_sum_in_order_is_left_to_right() -> None:
    a, b, c = torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])
    assert sum_in_order([a, b, c]).item() == ((a + b) + c).item()
    assert sum_in_order([a]) is a
