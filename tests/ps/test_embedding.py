"""ServerEmbeddings (tidal.ps.embedding) in a local run, in this process: without
``TIDAL_MASTER_URL`` the module serves its tables from a server thread of its own. The rows it
trains are those of an equivalent ``nn.Embedding`` model trained by torch's SGD from the same
initial rows, and its watermark and checkpoint tree are what the job commits."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tidal.worker
from tidal.ps.api import PSError, TableSpec, initial_rows
from tidal.ps.embedding import WATERMARK, ServerEmbeddings

A = TableSpec("a", 4, num_ids=50, optimizer="sgd", lr=0.1, init_scale=0.1)
B = TableSpec("b", 3, optimizer="sgd", lr=0.2, init_scale=0.1)  # a dynamic table, bags of 2 ids
B_IDS = 30
SAMPLES, BATCH = 48, 16
DENSE_LR = 0.05


class Clicks:
    """Per sample: one id of ``a``, a bag of two ids of ``b`` (sometimes the same twice), a target."""

    def __len__(self) -> int:
        return SAMPLES

    def get_range(self, start: int, end: int) -> dict[str, torch.Tensor]:
        i = torch.arange(start, end)
        return {"a": (i * 7) % 50, "b": torch.stack([i % B_IDS, (i * 3 + 1) % B_IDS], 1),
                "y": (i % 3).float()[:, None]}


@pytest.fixture
def local(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """A local run's environment (no master); what a test opened (embeddings, jobs) is closed after it."""
    for name in list(os.environ):
        if name.startswith("TIDAL_"):
            monkeypatch.delenv(name)
    opened: list[Any] = []
    yield opened
    for thing in reversed(opened):
        thing.close()


def start(opened: list[Any], mode: str = "sum") -> tuple[Any, ServerEmbeddings, nn.Linear, torch.optim.Optimizer, Any]:
    job = tidal.worker.init()
    opened.append(job)
    emb = ServerEmbeddings(job, [A, B], mode=mode, timeout_s=30)
    opened.append(emb)
    torch.manual_seed(0)
    lin = nn.Linear(A.dim + B.dim, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=DENSE_LR)
    state = job.state(lin, opt)
    emb.attach(state)
    return job, emb, lin, opt, state


def loss_of(lin: nn.Module, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (lin(torch.cat([a, b], 1)) - y).pow(2).mean()


def test_training_matches_nn_embedding_with_torchs_sgd(local: list[Any]) -> None:
    job, emb, lin, opt, state = start(local)
    # the reference: the same rows in nn.Embedding / nn.EmbeddingBag, torch's SGD, the same batches
    ref_a = nn.Embedding(A.num_ids or 0, A.dim)
    ref_b = nn.EmbeddingBag(B_IDS, B.dim, mode="sum")
    with torch.no_grad():
        ref_a.weight.copy_(initial_rows(A, torch.arange(A.num_ids or 0)))
        ref_b.weight.copy_(initial_rows(B, torch.arange(B_IDS)))
    ref_lin = copy.deepcopy(lin)
    ref_opts = [torch.optim.SGD(ref_a.parameters(), lr=A.lr), torch.optim.SGD(ref_b.parameters(), lr=B.lr),
                torch.optim.SGD(ref_lin.parameters(), lr=DENSE_LR)]
    seen: dict[str, set[int]] = {"a": set(), "b": set()}
    for batch in job.loader(Clicks(), batch_size=BATCH, epochs=1):
        v = emb({"a": batch["a"], "b": batch["b"]})
        assert v["a"].shape == (BATCH, A.dim) and v["b"].shape == (BATCH, B.dim)
        opt.zero_grad()
        loss_of(lin, v["a"], v["b"], batch["y"]).backward()
        assert job.step() is True

        for o in ref_opts:
            o.zero_grad()
        loss_of(ref_lin, ref_a(batch["a"]), ref_b(batch["b"]), batch["y"]).backward()
        for o in ref_opts:
            o.step()
        seen["a"].update(batch["a"].tolist())
        seen["b"].update(batch["b"].flatten().tolist())

    assert job.applied_step == SAMPLES // BATCH - 1
    assert state.extras[WATERMARK] == [job.round, job.applied_step, BATCH]
    tree = emb.checkpoint_tree()
    assert sorted(tree) == ["a", "b"]
    for name, ref in (("a", ref_a), ("b", ref_b)):
        ids = tree[name]["ids"]
        assert set(tree[name]) == {"ids", "weight"}  # sgd keeps no state
        assert ids.tolist() == sorted(seen[name])  # sorted; only the ids trained are stored
        torch.testing.assert_close(tree[name]["weight"], ref.weight.detach()[ids], atol=1e-6, rtol=0)
        moved = (tree[name]["weight"] - initial_rows(A if name == "a" else B, ids)).abs().amax(1)
        assert bool((moved > 0).all())  # every stored row was trained
    torch.testing.assert_close(lin.weight, ref_lin.weight, atol=1e-6, rtol=0)

    # a forward outside training (no grad) reads the trained rows and tracks nothing
    with torch.no_grad():
        probe = emb({"a": torch.tensor([7, 0]), "b": torch.tensor([[1, 1]])})
    torch.testing.assert_close(probe["a"], ref_a.weight.detach()[[7, 0]], atol=1e-6, rtol=0)
    torch.testing.assert_close(probe["b"], 2 * ref_b.weight.detach()[[1]], atol=1e-6, rtol=0)


def test_mean_bags_and_the_gradient_of_a_step(local: list[Any]) -> None:
    """One step of bags pooled by mean: each row moves by lr times autograd's mean-loss gradient."""
    job, emb, lin, _opt, state = start(local, mode="mean")
    ref_b = nn.EmbeddingBag(B_IDS, B.dim, mode="mean")
    with torch.no_grad():
        ref_b.weight.copy_(initial_rows(B, torch.arange(B_IDS)))
    ref_lin = copy.deepcopy(lin)
    batches = iter(job.loader(Clicks(), batch_size=BATCH, epochs=1))
    batch = next(batches)
    v = emb({"a": batch["a"], "b": batch["b"]})
    loss_of(lin, v["a"], v["b"], batch["y"]).backward()
    job.step()
    ref_a = initial_rows(A, torch.arange(50)).requires_grad_(True)
    loss_of(ref_lin, ref_a[batch["a"]], ref_b(batch["b"]), batch["y"]).backward()
    assert ref_a.grad is not None and ref_b.weight.grad is not None
    tree = emb.checkpoint_tree()
    ids_a, ids_b = tree["a"]["ids"], tree["b"]["ids"]
    torch.testing.assert_close(tree["a"]["weight"], (ref_a - A.lr * ref_a.grad).detach()[ids_a], atol=1e-6, rtol=0)
    want_b = (ref_b.weight - B.lr * ref_b.weight.grad).detach()[ids_b]
    torch.testing.assert_close(tree["b"]["weight"], want_b, atol=1e-6, rtol=0)
    assert state.extras[WATERMARK] == [job.round, 0, BATCH]
    batches.close()


def test_a_forward_before_attach_is_refused(local: list[Any]) -> None:
    job = tidal.worker.init()
    local.append(job)
    emb = ServerEmbeddings(job, [A])
    local.append(emb)
    with pytest.raises(PSError, match="attach"):
        emb({"a": torch.tensor([1, 2])})


def test_bad_ids_and_tables_are_refused(local: list[Any]) -> None:
    job, emb, lin, _opt, state = start(local)
    with pytest.raises(PSError, match=r"unknown tables \['zz'\]"):
        emb({"a": torch.tensor([1]), "zz": torch.tensor([1])})
    with pytest.raises(PSError, match=r"table a: ids must be int64 \[n\] or \[n, k\], got torch.int32"):
        emb({"a": torch.tensor([1, 2], dtype=torch.int32)})
    with pytest.raises(PSError, match="ids must be int64"):
        emb({"a": torch.zeros(2, 2, 2, dtype=torch.int64)})
    with pytest.raises(PSError, match="id 50 is out of range"):
        emb({"a": torch.tensor([3, 50])})
    # none of that broke the module: a step trains
    batches = iter(job.loader(Clicks(), batch_size=BATCH, epochs=1))
    batch = next(batches)
    v = emb({"a": batch["a"], "b": batch["b"]})
    with pytest.raises(PSError, match="two forwards"):
        emb({"a": batch["a"]})
    loss_of(lin, v["a"], v["b"], batch["y"]).backward()
    assert job.step() is True
    assert state.extras[WATERMARK] == [job.round, 0, BATCH]
    batches.close()


def test_bad_construction_is_refused(local: list[Any]) -> None:
    job = tidal.worker.init()
    local.append(job)
    for mode in ("max", "SUM", ""):
        with pytest.raises(PSError, match="mode must be sum or mean"):
            ServerEmbeddings(job, [A], mode=mode)
    with pytest.raises(PSError, match="at least one table"):
        ServerEmbeddings(job, [])
    with pytest.raises(PSError, match="same name"):
        ServerEmbeddings(job, [A, TableSpec("a", 2)])


def test_a_forward_of_no_tables_is_an_error(local: list[Any]) -> None:
    _job, emb, _lin, _opt, _state = start(local)
    with pytest.raises(PSError, match="no tables"):
        emb({})
