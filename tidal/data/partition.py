"""Automatic partitioning (GoldMiner 3.2, Algorithm 1, done for PyTorch with ``torch.fx``):
``job.loader(dataset, ..., preprocess="auto")``.

GoldMiner cuts a TensorFlow graph where the data pre-processing ends: the largest upstream
subgraph that reads no model variable goes to the data workers, the rest stays with the
training worker, joined by a queue. Here the graph is the model's ``forward``, traced by
``torch.fx``:

1. Trace ``model.forward(batch)`` (one argument: what the loader yields without
   pre-processing, a dict of tensors). A submodule without parameters and buffers is kept as
   one opaque node (a leaf), so pre-processing written in Python inside it (string hashing,
   ``tolist()``) is not traced into, only called.
2. Mark every node that depends on a parameter or buffer: ``get_attr`` nodes, calls of modules
   that hold any, and everything downstream of them (Algorithm 1's backward search from the
   variables). The rest, upstream of every variable, is the data workers' part.
3. The *boundary* is the data part's nodes that the training part (or the output) reads. The
   data part becomes ``pre``: the raw batch in, the boundary values out; the training part
   becomes ``post``: the boundary values in, the model's output out. ``pre`` then ``post`` is
   the traced ``forward``, op for op, so the result is bit for bit the same.

The loader's batches are then the raw batch's entries (so the script still reads its labels)
plus the boundary tensors under ``"__fx__"``; the model's ``forward`` is wrapped so that such a
batch runs ``post`` alone, and any other input (an evaluation batch of raw samples) runs the
whole ``forward`` as before. Parameters are shared, not copied: the optimizer and tidal's state
see the same tensors.

What cannot be cut, and what then happens (``AutoPartitionError``, caught by the loader, which
prints the reason and falls back to the loader's ``fallback`` preprocess, or to none: the
trainer then does all the work, as without data workers):

- ``forward`` takes more than one argument, or the batch is not a dict of tensors;
- ``torch.fx`` cannot trace ``forward``: control flow on tensor values (``if x.sum() > 0``),
  Python on tensor values outside a parameter-free submodule (``x.tolist()``, ``len(x)``),
  calls into libraries fx does not know (wrap those in a parameter-free ``nn.Module``);
- nothing upstream of the first parameter does any work (an embedding lookup straight on the
  raw ids): there is nothing to move.
"""

from __future__ import annotations

import inspect
import operator
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

__all__ = ["AUTO_KEY", "AutoPartition", "AutoPartitionError", "partition", "resolve_preprocess"]

AUTO_KEY = "__fx__"  # where a batch of an auto-partitioned loader holds the boundary tensors


class AutoPartitionError(ValueError):
    """The model cannot be partitioned automatically (the message says why)."""


class _LeafTracer(torch.fx.Tracer):
    """fx's tracer, with every submodule that holds no parameter and no buffer kept as one node."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if super().is_leaf_module(m, module_qualified_name):
            return True
        return next(m.parameters(), None) is None and next(m.buffers(), None) is None


@dataclass
class AutoPartition:
    """The two parts of a model's ``forward``: ``pre`` (data workers) and ``post`` (trainer)."""

    model: torch.nn.Module
    pre: torch.fx.GraphModule
    post: torch.fx.GraphModule
    boundary: list[str]
    data_nodes: int  # nodes of the data part that compute (not inputs, not item lookups)

    def preprocess(self, raw: Any) -> dict[str, Any]:
        """What a data worker (or the trainer, without them) builds from a raw batch."""
        if not isinstance(raw, Mapping):
            raise AutoPartitionError(f"preprocess='auto' needs batches that are dicts of tensors, got {type(raw).__name__}")
        return {**raw, AUTO_KEY: self.pre(raw)}

    def install(self) -> None:
        """Wrap the model's ``forward``: a batch of ``preprocess`` runs ``post`` alone."""
        model, post = self.model, self.post
        whole = model.forward

        def forward(self: torch.nn.Module, batch: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(batch, Mapping) and AUTO_KEY in batch and not args and not kwargs:
                return post(**batch[AUTO_KEY])
            return whole(batch, *args, **kwargs)

        model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]

    def describe(self) -> str:
        return (f"{type(self.model).__name__}.forward cut after {self.data_nodes} parameter-free operations; "
                f"the data workers send {len(self.boundary)} tensors ({', '.join(self.boundary[:6])}"
                f"{', ...' if len(self.boundary) > 6 else ''})")


def partition(model: torch.nn.Module) -> AutoPartition:
    """Cut ``model.forward`` after its largest parameter-free upstream part (see the module).

    Raises:
        AutoPartitionError: it cannot be cut (the message says why).
    """
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) != 1:
        raise AutoPartitionError(f"{type(model).__name__}.forward takes {len(params)} arguments; preprocess='auto' "
                                 "needs one (the batch)")
    try:
        graph = _LeafTracer().trace(model)
    except Exception as exc:  # fx raises many kinds (TraceError, TypeError, RuntimeError ...)
        raise AutoPartitionError(f"torch.fx cannot trace {type(model).__name__}.forward: "
                                 f"{type(exc).__name__}: {exc}") from None
    gm = torch.fx.GraphModule(model, graph)
    modules = dict(gm.named_modules())
    trainer: set[torch.fx.Node] = set()
    for node in graph.nodes:
        holds = node.op == "get_attr" or (
            node.op == "call_module" and (next(modules[node.target].parameters(), None) is not None
                                          or next(modules[node.target].buffers(), None) is not None))
        if holds or any(a in trainer for a in node.all_input_nodes):
            trainer.add(node)
    data = [n for n in graph.nodes if n not in trainer and n.op != "output"]
    computing = [n for n in data if n.op != "placeholder"
                 and not (n.op == "call_function" and n.target is operator.getitem
                          and all(a.op == "placeholder" for a in n.all_input_nodes))]
    if not computing:
        raise AutoPartitionError(f"nothing in {type(model).__name__}.forward comes before its first parameter; "
                                 "there is no pre-processing to move")
    boundary = [n for n in data if any(u in trainer or u.op == "output" for u in n.users)]

    pre = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in data:
        env[node] = pre.node_copy(node, lambda x: env[x])
    pre.output({n.name: env[n] for n in boundary})

    post = torch.fx.Graph()
    env = {n: post.placeholder(n.name) for n in boundary}
    for node in graph.nodes:
        if node in trainer or node.op == "output":
            env[node] = post.node_copy(node, lambda x: env[x])
    return AutoPartition(model, torch.fx.GraphModule(gm, pre), torch.fx.GraphModule(gm, post),
                         [n.name for n in boundary], len(computing))


class _AutoPreprocess:
    """The partition's ``preprocess`` under a name that tells data workers which loader it is."""

    def __init__(self, split: AutoPartition) -> None:
        self.split = split
        self.__qualname__ = f"auto.{type(split.model).__qualname__}"

    def __call__(self, raw: Any) -> dict[str, Any]:
        return self.split.preprocess(raw)


def resolve_preprocess(preprocess: Callable[[Any], Any] | str | None, fallback: Callable[[Any], Any] | None,
                       model: Callable[[], torch.nn.Module], say: Callable[[str], None]) -> Callable[[Any], Any] | None:
    """A loader's ``preprocess``: a function as it is; ``"auto"``: the partition of ``model()``'s
    forward (which is wrapped), or, when it cannot be cut, ``fallback`` (None: the trainer does all
    the work), each time with a message through ``say``.

    Raises:
        ValueError: a string other than "auto", something that is not callable, or a module with
            trainable parameters.
    """
    if isinstance(preprocess, torch.nn.Module):
        trained = [n for n, p in preprocess.named_parameters() if p.requires_grad]
        if trained:
            raise ValueError(f"preprocess {type(preprocess).__name__} has trainable parameters ({', '.join(trained[:3])}): "
                             "a data worker's copy would never be trained; keep them in the model")
    if preprocess is None or (callable(preprocess) and not isinstance(preprocess, str)):
        return preprocess
    if preprocess != "auto":
        raise ValueError(f"preprocess must be a function, a module or 'auto', got {preprocess!r}")
    try:
        split = partition(model())
    except AutoPartitionError as exc:
        say(f"preprocess='auto': {exc}; " + ("using the loader's fallback preprocess" if fallback is not None else
                                             "the trainer does all the work (pass fallback=fn to move some)"))
        return fallback
    split.install()
    say(f"preprocess='auto': {split.describe()}")
    return _AutoPreprocess(split)
