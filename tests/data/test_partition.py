"""preprocess="auto" (tidal.data.partition): torch.fx cuts the model's forward after its largest
parameter-free upstream part (GoldMiner Algorithm 1), and pre then post is the same forward, bit
for bit, gradients included."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from examples.ctr.data import ClickDataset
from examples.ctr.features import FeatureTransform, RawClickModel, RawClicks
from examples.ctr.model import DLRM
from tidal.data.partition import AUTO_KEY, AutoPartitionError, partition, resolve_preprocess


def click_model() -> RawClickModel:
    torch.manual_seed(0)
    transform = FeatureTransform(crosses=8)
    return RawClickModel(transform, DLRM(num_sparse=transform.fields, crosses=True))


def raw_batch(n: int = 64) -> dict[str, torch.Tensor]:
    return RawClicks(ClickDataset(1000)).get_range(0, n)


def test_the_cut_moves_the_transform_and_keeps_every_parameter_in_the_trainer() -> None:
    model = click_model()
    split = partition(model)
    assert not [n for n in split.pre.graph.nodes if n.op == "get_attr"]
    assert any(n.op == "call_module" and n.target == "transform" for n in split.pre.graph.nodes)
    assert not any(n.op == "call_module" and n.target == "transform" for n in split.post.graph.nodes)
    assert dict(split.pre.named_parameters()) == {}
    # the trainer's part holds the very tensors of the model (no copies)
    ours = {id(p) for p in model.parameters()}
    assert {id(p) for p in split.post.parameters()} == ours
    boundary = split.pre(raw_batch())
    assert set(boundary) == set(split.boundary) and all(isinstance(v, torch.Tensor) for v in boundary.values())


def test_pre_then_post_is_the_forward_bit_for_bit_gradients_included() -> None:
    whole, cut = click_model(), click_model()
    raw = raw_batch()
    split = partition(cut)
    split.install()
    batch = split.preprocess(raw)
    assert torch.equal(batch["label"], raw["label"]) and AUTO_KEY in batch  # the script still reads labels
    a, b = whole(raw), cut(batch)
    assert torch.equal(a, b)
    a.sum().backward()
    b.sum().backward()
    for (name, p), q in zip(whole.named_parameters(), cut.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad), name
    assert torch.equal(cut(raw), whole(raw))  # a raw batch (evaluation) still runs the whole forward


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["x"] * 2
        if x.sum() > 0:  # control flow on a tensor's value: fx cannot trace it
            x = x + 1
        return self.lin(x)  # type: ignore[no-any-return]


class LookupFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.emb(batch["ids"]).sum(-1)  # type: ignore[no-any-return]


class TwoInputs(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


@pytest.mark.parametrize(("model", "why"), [
    (Branchy(), "torch.fx cannot trace Branchy.forward"),
    (LookupFirst(), "nothing in LookupFirst.forward comes before its first parameter"),
    (TwoInputs(), "takes 2 arguments"),
])
def test_what_cannot_be_cut_falls_back_with_a_message(model: nn.Module, why: str) -> None:
    with pytest.raises(AutoPartitionError, match=why):
        partition(model)
    said: list[str] = []

    def fallback(raw: Any) -> Any:
        return raw

    assert resolve_preprocess("auto", fallback, lambda: model, said.append) is fallback
    assert resolve_preprocess("auto", None, lambda: model, said.append) is None
    assert why in said[0] and "fallback preprocess" in said[0] and "does all the work" in said[1]


def test_a_bad_preprocess_value_is_refused() -> None:
    with pytest.raises(ValueError, match="'auto'"):
        resolve_preprocess("automatic", None, click_model, print)
    with pytest.raises(ValueError, match=r"trainable parameters \(weight, bias\)"):
        resolve_preprocess(nn.Linear(2, 2), None, click_model, print)
    frozen = nn.Linear(2, 2).requires_grad_(False)  # a fixed projection is stateless
    assert resolve_preprocess(frozen, None, click_model, print) is frozen
