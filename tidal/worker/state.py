"""The state a worker commits and restores: model, optimizer, user extras, data position.

``commit()`` runs after every applied step. Parameters and optimizer state change only inside
``optimizer.step()``, which runs only after a successful reduction, so a failed step leaves them
as committed; what a forward pass may have changed since (module buffers such as BatchNorm
statistics) and the user's extras are snapshotted and put back by ``restore()``. That keeps a
commit cheap (no copy of the parameters) while giving Horovod-style commit/restore semantics.

A new worker gets the whole state from the round's source over the process group, in the
data-plane codec of ``tidal.api.frames``: ``split_tree`` turns the tree into a JSON skeleton
(containers and scalars; tensors as ``{"T": dtype, "shape": shape, "path": path}``) and the
tensors by path; ``pack_state`` encodes the tensors with the skeleton as the message's ``meta``
into ``(header, flat buffer)`` (``encode_joined``); ``unpack_state`` decodes them
(``decode_joined``: every dtype checked against the whitelist, every length against the header)
and rebuilds the tree, checking each tensor against its skeleton node. A checkpoint stores the
same skeleton beside a safetensors file. No pickle crosses a socket.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from tidal.api import FrameError
from tidal.api.frames import DTYPES, decode_joined, encode_joined

_NAMES = {v: k for k, v in DTYPES.items()}
# A bound on the state a worker accepts from the round's source, checked before allocating: it
# is the user's model and optimizer, so only a corrupt size is ever over it.
MAX_STATE_BYTES = 1 << 40


class State:
    """Model, optimizer and user extras, committed after each step and restored on a re-form.

    ``extras`` are the user's own values (JSON types or tensors), read and written as
    ``state.extras["key"]``; they follow the commit/restore rules of the model.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 **extras: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self.extras: dict[str, Any] = dict(extras)
        self.applied_step = -1  # global optimizer steps applied (the first is step 0)
        self.epoch = 0  # the elastic loader's epoch
        self.epoch_step = 0  # steps done in this epoch (logical workers' data order)
        self._committed: dict[str, Any] = {}
        self._params: list[torch.nn.Parameter] | None = None
        # the buffers that are part of the model's state (in its state_dict): what a checkpoint
        # holds and a new worker receives. Non-persistent ones (index tables, masks, position
        # ids) are not state: they are neither restored nor sent. Looked up once: walking the
        # module tree every step is slow.
        persistent = set(model.state_dict(keep_vars=True))
        self._buffers = [(name, b) for name, b in model.named_buffers() if name in persistent]
        self._buffer_list = [b for _, b in self._buffers]
        self.commit()

    def buffers(self) -> list[torch.Tensor]:
        """The model's persistent buffers (BatchNorm statistics, ...), in a fixed order (the
        same list on every call: read it, do not change it)."""
        return self._buffer_list

    def trainable(self) -> list[torch.nn.Parameter]:
        """The parameters that get gradients, in a fixed order (cached: looked up every step)."""
        if self._params is None:
            self._params = [p for p in self.model.parameters() if p.requires_grad]
        return self._params

    def commit(self) -> None:
        self._committed = {
            "buffers": {k: b.detach().clone() for k, b in self._buffers},
            "extras": copy.deepcopy(self.extras) if self.extras else {},
            "applied_step": self.applied_step,
            "epoch": self.epoch,
            "epoch_step": self.epoch_step,
        }

    def restore(self) -> None:
        snap = self._committed
        with torch.no_grad():
            for name, buf in self._buffers:
                if name in snap["buffers"]:
                    buf.copy_(snap["buffers"][name])
        self.extras = copy.deepcopy(snap["extras"])
        self.applied_step = snap["applied_step"]
        self.epoch = snap["epoch"]
        self.epoch_step = snap["epoch_step"]

    def to_tree(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "extras": self.extras,
            "applied_step": self.applied_step,
            "epoch": self.epoch,
            "epoch_step": self.epoch_step,
        }

    def load_tree(self, tree: dict[str, Any]) -> None:
        self.model.load_state_dict(tree["model"])
        if self.optimizer is not None and tree["optimizer"] is not None:
            self.optimizer.load_state_dict(tree["optimizer"])
        self.extras = tree["extras"]
        self.applied_step = int(tree["applied_step"])
        self.epoch = int(tree["epoch"])
        self.epoch_step = int(tree.get("epoch_step", 0))
        self.commit()


# ---------------------------------------------------------------------------- packing
def _encode(tree: Any, on_tensor: Callable[[torch.Tensor, str], dict[str, Any]], copy: bool = True) -> Any:
    """JSON skeleton of a tree of containers and scalars; tensors become ``on_tensor(t, path)``,
    ``t`` made CPU and contiguous (a copy where it was not), or only detached with ``copy=False``."""

    def enc(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous() if copy else obj.detach()
            if t.dtype not in _NAMES:
                raise TypeError(f"cannot send tensors of dtype {t.dtype}")
            return {"T": _NAMES[t.dtype], "shape": list(t.shape), **on_tensor(t, path)}
        if isinstance(obj, dict):
            return {"D": [[_key(k), enc(v, f"{path}/{k}")] for k, v in obj.items()]}
        if isinstance(obj, tuple):
            return {"U": [enc(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return {"L": [enc(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        if obj is None or isinstance(obj, bool | int | float | str):
            return {"V": obj}
        raise TypeError(f"cannot send a {type(obj).__name__} in the training state (use tensors or JSON types)")

    return enc(tree, "")


def _decode(skeleton: Any, on_tensor: Callable[[dict[str, Any], torch.dtype, list[int]], torch.Tensor]) -> Any:
    def dec(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) == 0:
            raise ValueError("malformed state skeleton")
        if "T" in node:
            dtype = DTYPES.get(node["T"])
            if dtype is None:
                raise ValueError(f"dtype {node['T']!r} not allowed")
            shape = [int(s) for s in node["shape"]]
            if any(s < 0 for s in shape):
                raise ValueError("negative dimension")
            return on_tensor(node, dtype, shape)
        if "D" in node:
            return {_unkey(k): dec(v) for k, v in node["D"]}
        if "U" in node:
            return tuple(dec(v) for v in node["U"])
        if "L" in node:
            return [dec(v) for v in node["L"]]
        if "V" in node:
            return node["V"]
        raise ValueError("malformed state skeleton")

    try:
        return dec(skeleton)
    except (KeyError, TypeError, IndexError, AttributeError, RecursionError) as exc:
        raise ValueError(f"malformed state skeleton: {exc!r}") from exc


def pack_state(tree: Any) -> tuple[bytes, torch.Tensor]:
    """Nested dicts/lists/tuples of tensors and JSON scalars -> (header, flat uint8 buffer).

    The header is a ``tidal.api.frames`` header whose ``meta`` is the tree's skeleton; the buffer
    is the tensors' frames back to back (``frames.encode_joined``: one copy).

    Raises:
        TypeError: the tree holds something that cannot be sent (see ``split_tree``).
        FrameError: the header would be over ``frames.MAX_HEADER_BYTES``.
    """
    skeleton, tensors = split_tree(tree)
    return encode_joined(tensors, meta=skeleton)


def unpack_state(header: bytes, flat: torch.Tensor, *, max_bytes: int = MAX_STATE_BYTES) -> Any:
    """Inverse of ``pack_state``; the tensors come back in memory of their own.

    Raises:
        FrameError: the message breaks a rule of ``tidal.api.frames``, or its skeleton does not
            describe exactly its tensors.
    """
    message = decode_joined(header, flat, max_bytes=max_bytes)
    if message.meta is None:
        raise FrameError("state message has no tree skeleton in its meta")
    try:
        return join_tree(message.meta, message.tensors)
    except ValueError as exc:
        raise FrameError(str(exc)) from None


def split_tree(tree: Any, copy: bool = True) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON skeleton, tensors by path, in tree order) of a state tree: the form a checkpoint
    stores. ``copy=False`` leaves each tensor where and as it is (detached only): for a caller
    that copies them itself, such as the flash checkpoint into shared memory."""
    tensors: dict[str, torch.Tensor] = {}

    def name(t: torch.Tensor, path: str) -> dict[str, Any]:
        path = path or "/"
        if path in tensors:  # {0: a, "0": b} or {"a/b": a, "a": {"b": b}}: one would overwrite the other
            raise TypeError(f"two tensors of the state tree have the path {path!r}; rename a key")
        tensors[path] = t
        return {"path": path}

    return _encode(tree, name, copy), tensors


def join_tree(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of ``split_tree``; every tensor must match its recorded dtype and shape, and the
    skeleton must name each tensor exactly once."""
    used: set[str] = set()

    def take(node: dict[str, Any], dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        path = str(node["path"])
        t = tensors.get(path)
        if t is None or t.dtype != dtype or list(t.shape) != shape:
            raise ValueError(f"tensor {path!r} is missing or does not match the skeleton")
        if path in used:
            raise ValueError(f"the skeleton names tensor {path!r} twice")
        used.add(path)
        return t

    tree = _decode(skeleton, take)
    unused = [path for path in tensors if path not in used]
    if unused:
        raise ValueError(f"tensors not in the skeleton: {', '.join(map(repr, unused[:5]))}")
    return tree


def _key(k: Any) -> Any:
    if isinstance(k, bool) or not isinstance(k, int | str):
        raise TypeError(f"state dict keys must be str or int, not {type(k).__name__}")
    return k if isinstance(k, str) else {"i": k}


def _unkey(k: Any) -> Any:
    return int(k["i"]) if isinstance(k, dict) else str(k)
