"""Batches as the data plane carries them: built from an index range, flattened to named
tensors, checked against the batches before them.

A batch is what a script's loop receives: a tensor, or dicts, lists and tuples of tensors
(nested). ``flatten`` turns it into ``(skeleton, tensors by path)``: the skeleton is JSON (it
travels in a ``tidal.api.frames`` message's ``meta``), the tensors travel as the message's
buffers, one per tensor, all in one multipart message (GoldMiner's fused transfer, section 4).
``unflatten`` rebuilds the same tree, bit for bit.

``BatchShape`` remembers the first batch's structure and each tensor's dtype and trailing
dimensions, and names the step and the sample range of any later batch that differs: a
``preprocess`` whose output changes type from batch to batch is a bug the user must see, not a
model that silently trains on something else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["BatchError", "BatchShape", "build_batch", "fetch_range", "flatten", "unflatten"]

MAX_TENSORS = 4096  # per batch: a tree larger than this is not a batch


class BatchError(ValueError):
    """A batch that cannot be built, carried or trained on (the message names the step and the
    sample range)."""


def fetch_range(dataset: Any, start: int, end: int, collate_fn: Callable[[list[Any]], Any] | None = None) -> Any:
    """Samples ``[start, end)`` of ``dataset``: ``dataset.get_range(start, end)`` where it has
    one (the fast path), else ``collate_fn`` (default: torch's) over ``dataset[i]``."""
    if hasattr(dataset, "get_range"):
        return dataset.get_range(start, end)
    from torch.utils.data import default_collate

    collate = collate_fn or default_collate
    return collate([dataset[i] for i in range(start, end)])


def build_batch(dataset: Any, start: int, end: int, preprocess: Callable[[Any], Any] | None,
                collate_fn: Callable[[list[Any]], Any] | None = None) -> Any:
    """The batch of samples ``[start, end)``: fetched, then ``preprocess``-ed (the stateless part
    a data worker may run instead of the trainer).

    Raises:
        BatchError: ``preprocess`` raised; the message names the range (the loader adds the
            training step).
    """
    raw = fetch_range(dataset, start, end, collate_fn)
    if preprocess is None:
        return raw
    try:
        with torch.no_grad():
            return preprocess(raw)
    except Exception as exc:  # the user's function: any error it raises is reported as the batch's
        raise BatchError(f"preprocess failed on samples [{start}, {end}): {type(exc).__name__}: {exc}") from exc


def flatten(batch: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(skeleton, tensors by path)`` of a batch tree; the skeleton is plain JSON.

    Raises:
        BatchError: a leaf that is not a tensor, a dict key that is not a string, too many tensors.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            if len(tensors) >= MAX_TENSORS:
                raise BatchError(f"a batch holds at most {MAX_TENSORS} tensors")
            tensors[path] = node
            return {"t": path}
        if isinstance(node, Mapping):
            out = {}
            for k, v in node.items():
                if not isinstance(k, str):
                    raise BatchError(f"batch key {k!r} at {path or 'the top'} is not a string")
                out[k] = walk(v, f"{path}.{k}" if path else k)
            return {"d": out}
        if isinstance(node, (list, tuple)):
            kind = "l" if isinstance(node, list) else "u"
            return {kind: [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]}
        raise BatchError(f"the batch holds a {type(node).__name__} at {path or 'the top'}; "
                         "a batch is tensors in dicts, lists and tuples")

    return walk(batch, ""), tensors


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The batch tree of ``flatten``'s skeleton and tensors.

    Raises:
        BatchError: a skeleton that is malformed or names a tensor that is not there, or
            tensors that the skeleton does not name.
    """
    used: set[str] = set()

    def walk(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) != 1:
            raise BatchError("malformed batch skeleton")
        (kind, value), = node.items()
        if kind == "t":
            if not isinstance(value, str) or value not in tensors or value in used:
                raise BatchError(f"the batch skeleton names tensor {value!r}, which the message does not hold once")
            used.add(value)
            return tensors[value]
        if kind == "d" and isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if kind in ("l", "u") and isinstance(value, list):
            items = [walk(v) for v in value]
            return items if kind == "l" else tuple(items)
        raise BatchError("malformed batch skeleton")

    out = walk(skeleton)
    if len(used) != len(tensors):
        raise BatchError(f"the message holds tensors the batch skeleton does not name: {sorted(set(tensors) - used)}")
    return out


class BatchShape:
    """The first batch's structure, dtypes and trailing dimensions; ``check`` compares later ones."""

    def __init__(self) -> None:
        self._signature: tuple[Any, ...] | None = None

    @staticmethod
    def signature(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
        import json

        return (json.dumps(skeleton, sort_keys=True),
                tuple((k, str(t.dtype).removeprefix("torch."), tuple(t.shape[1:])) for k, t in tensors.items()))

    def check(self, skeleton: Any, tensors: Mapping[str, torch.Tensor], start: int, end: int) -> None:
        """Raises BatchError when this batch differs from the first one in structure, dtype or
        any dimension but the first (the samples)."""
        sig = self.signature(skeleton, tensors)
        if self._signature is None:
            self._signature = sig
            return
        if sig == self._signature:
            return
        first, now = self._signature, sig
        if first[0] != now[0]:
            what = f"its structure changed: {first[0]} then {now[0]}"
        else:
            diffs = [f"{a[0]}: {a[1]}{list(a[2])} then {b[1]}{list(b[2])}" for a, b in zip(first[1], now[1], strict=True)
                     if a != b]
            what = "tensors changed dtype or shape (beyond the sample dimension): " + "; ".join(diffs)
        raise BatchError(f"preprocess returned an inconsistent batch for samples [{start}, {end}): {what}")
