"""The data-plane codec: tensors as a JSON header plus one raw buffer each (DESIGN.md 3 and 5).

One format for every tensor that crosses a process boundary outside the control plane: the
state broadcast to a new worker (``tidal.worker.comm``), and the parameter servers' and data
workers' ZeroMQ multipart messages. No pickle and no ``torch.load``: a message is a header the
receiver parses as plain JSON and checks field by field, and raw little-endian bytes it copies
into tensors only after every length has been checked against the header.

A message is a list of frames::

    frames[0]  the header, UTF-8 JSON, exactly these six fields:
               {"v": 1, "step": 7, "keys": ["x", "y"], "dtype": ["float32", "int64"],
                "shape": [[2, 3], [2]], "meta": {"epoch": 1}}
    frames[1]  24 bytes: "x", row-major (C order), little-endian
    frames[2]  16 bytes: "y"

- ``v``: the format version, 1. A receiver rejects any other.
- ``step``: an int in ``[0, 2**63)`` or ``null`` (the step a batch or an update belongs to).
- ``keys``: the tensor names in frame order, distinct strings.
- ``dtype``: one name per tensor from ``DTYPES`` (no complex, no quantized, no object).
- ``shape``: one list of non-negative ints per tensor, at most ``MAX_RANK`` long (``[]`` is a
  0-d scalar). Frame ``i + 1`` must hold exactly ``prod(shape[i]) * itemsize`` bytes.
- ``meta``: a JSON object or ``null``: what is not a tensor (the state broadcast puts the tree
  skeleton of ``tidal.worker.state`` here). It is JSON as Python's ``json`` module reads it,
  ``NaN`` and ``Infinity`` included (a training state's extras often hold ``float("inf")``).

Every field is always present; an unknown field, a duplicated JSON object name anywhere in the
header, a wrong type, a count of keys that differs from the count of buffers, a repeated key, a
size that is off by one byte: each raises ``FrameError`` with a message naming the problem. The
header is at most ``MAX_HEADER_BYTES`` and the whole message at most ``max_bytes``
(``MAX_MESSAGE_BYTES`` unless the caller says otherwise). Bool tensors must hold only 0 and 1.

Transports that carry one blob (the ``torch.distributed`` broadcast) use ``encode_joined``, which
gives ``(header, payload)``, the payload being the tensor frames back to back in one uint8
tensor, and ``decode_joined``, which cuts the payload where the header says and decodes the
pieces as frames; the boundaries follow from the header, so there are no offsets to check.

Memory: ``encode`` returns views of contiguous CPU tensors without copying (the caller must not
change those tensors until the frames are sent, and torch refuses to resize them from then on); others
are copied (``contiguous()``, ``cpu()``). ``encode_joined`` copies once, into the payload.
``decode`` always copies each buffer into a tensor of its own (torch's memory), so decoded
tensors are writable and share nothing with the frames. Measured on the 2-core machine of
bench/RESULTS.md, quiet: one copy of a 100 MB buffer took ~32 ms through ``torch.tensor`` of a
numpy view (torch copies with both threads, and does not warn about a read-only buffer since it
copies) against ~58 ms for ``bytearray`` + ``torch.frombuffer`` or a numpy copy (one thread);
for 4,000 tensors of 64 bytes, 21 ms, as numpy into ``torch.empty``. Sharing the frames instead
(no copy) is not offered: received buffers are read-only or belong to the transport, the state
broadcast's frames sit at unaligned offsets of one flat buffer, and tensors made by
``torch.from_numpy``/``torch.frombuffer`` cannot be resized.

This module imports torch and numpy, so ``tidal.api``'s ``__init__`` does not import it:
``import tidal.api`` (pydantic wire types only) stays light for the master and the CLI. Import
it as ``from tidal.api import frames``.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import torch

from tidal.api.errors import FrameError

__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "MAX_HEADER_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_RANK",
    "FrameError",
    "Message",
    "decode",
    "decode_joined",
    "encode",
    "encode_joined",
]

FORMAT_VERSION = 1
MAX_HEADER_BYTES = 16 << 20  # as the control plane's body limit; Adam state of 1,000 parameters: ~0.5 MB
MAX_MESSAGE_BYTES = 1 << 30  # default bound of a whole message; the state broadcast passes its own
MAX_RANK = 32  # numpy's limit before 2.0; no tensor tidal sends comes near it
_MAX_STEP = 2**63 - 1

# The whitelist: name on the wire -> dtype. Nothing else is ever built from a received header.
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ITEMSIZE = {name: torch.empty(0, dtype=dtype).element_size() for name, dtype in DTYPES.items()}
_FIELDS = ("v", "step", "keys", "dtype", "shape", "meta")
# numpy's type for each wire dtype's bytes; bfloat16, unknown to numpy, goes through int16
_NUMPY: dict[str, type[np.generic]] = {
    "float16": np.float16, "bfloat16": np.int16, "float32": np.float32, "float64": np.float64,
    "int8": np.int8, "uint8": np.uint8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "bool": np.bool_,
}

# A frame is anything with the buffer protocol: bytes, bytearray, memoryview, zmq.Frame, a numpy
# array. Any, because Python 3.11 has no type for it, and zmq.Frame and numpy arrays do not claim
# typing_extensions.Buffer; decode checks at run time (memoryview) instead.
Buffer: TypeAlias = Any


@dataclass(frozen=True)
class Message:
    """A decoded message: tensors by key in frame order, the step and the meta object."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    step: int | None = None
    meta: dict[str, Any] | None = None


@dataclass(frozen=True)
class _Header:
    step: int | None
    keys: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    meta: dict[str, Any] | None

    def nbytes(self, i: int) -> int:
        return math.prod(self.shapes[i]) * _ITEMSIZE[self.dtypes[i]]


# --------------------------------------------------------------------------- sending
def encode(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
           step: int | None = None, meta: dict[str, Any] | None = None) -> list[bytes | memoryview]:
    """Frames of a message: the header, then one buffer per tensor in the given order.

    Contiguous CPU tensors are not copied: their frames are views of their memory, correct while
    nobody writes to the tensors. Sharing goes through numpy, so torch marks such a tensor's
    storage as not resizable (``resize_`` would free memory a frame still points to): send a
    clone, or use ``encode_joined``, where that matters.

    Raises:
        TypeError: a value is not a strided tensor, its dtype is outside ``DTYPES``, or ``meta``
            is not a JSON object.
        FrameError: the message would be refused by ``decode``: a repeated or non-string key,
            a step out of range, more than ``MAX_RANK`` dimensions, a header over
            ``MAX_HEADER_BYTES``.
    """
    header, sendable = _prepare(tensors, step, meta)
    return [header, *(_bytes_of(t) if t.numel() else b"" for t in sendable)]


def encode_joined(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                  step: int | None = None, meta: dict[str, Any] | None = None) -> tuple[bytes, torch.Tensor]:
    """``(header, payload)`` for a transport that carries one buffer (the ``torch.distributed``
    broadcast): the header of ``encode``, and its tensor frames back to back in one new uint8
    tensor (one copy; the tensors are left as they were). ``decode_joined`` is the inverse.

    Raises:
        TypeError, FrameError: as ``encode``.
    """
    header, sendable = _prepare(tensors, step, meta)
    if not sendable:
        return header, torch.empty(0, dtype=torch.uint8)
    return header, torch.cat([t.reshape(-1).view(torch.uint8) for t in sendable])


def _prepare(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
             step: int | None, meta: dict[str, Any] | None) -> tuple[bytes, list[torch.Tensor]]:
    """The header, and the tensors as contiguous CPU tensors whose memory holds their values."""
    if sys.byteorder != "little":  # the wire is little-endian and no byte is swapped
        raise FrameError("the data-plane codec runs on little-endian machines only")
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    _check_step(step)
    if meta is not None and not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict or None, not {type(meta).__name__}")
    keys: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    sendable: list[torch.Tensor] = []
    seen: set[str] = set()
    for key, tensor in items:
        if not isinstance(key, str):
            raise FrameError(f"tensor keys must be strings, not {type(key).__name__}")
        if key in seen:
            raise FrameError(f"tensor key {key!r} appears twice")
        seen.add(key)
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(f"{key!r}: can only send dense tensors, not {_describe(tensor)}")
        name = _NAMES.get(tensor.dtype)
        if name is None:
            raise TypeError(f"{key!r}: dtype {tensor.dtype} is not one of {', '.join(DTYPES)}")
        if tensor.dim() > MAX_RANK:
            raise FrameError(f"{key!r} has {tensor.dim()} dimensions, more than {MAX_RANK}")
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.is_neg():  # a negative view (x._neg_view()) holds -values: its memory is not them
            t = t.resolve_neg()
        keys.append(key)
        dtypes.append(name)
        shapes.append(list(t.shape))
        sendable.append(t)
    header = json.dumps(
        {"v": FORMAT_VERSION, "step": step, "keys": keys, "dtype": dtypes, "shape": shapes, "meta": meta},
        separators=(",", ":"), ensure_ascii=False,
    ).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise FrameError(f"header of {len(header)} bytes is too large (limit {MAX_HEADER_BYTES})")
    return header, sendable


# --------------------------------------------------------------------------- receiving
def decode(frames: Sequence[Buffer], *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Check a message against every rule of the format, then copy its buffers into tensors.

    Raises:
        FrameError: any rule broken (see the module docstring); nothing is allocated before the
            header and every buffer length have been checked.
    """
    if len(frames) == 0:
        raise FrameError("a message has at least a header frame")
    views = [_view(f, i) for i, f in enumerate(frames)]
    _check_total(sum(v.nbytes for v in views), max_bytes)
    return _decode(_parse_header(views[0]), views[1:])


def decode_joined(header: Buffer, payload: torch.Tensor | Buffer, *,
                  max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """The inverse of ``encode_joined``: the payload is cut where the header says, then decoded.

    Raises:
        FrameError: as ``decode``, or the payload's length is not the sum of the lengths the
            header describes.
    """
    head = _view(header, 0)
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise FrameError(f"a payload is a 1-d uint8 tensor, not {payload.dtype} of shape {tuple(payload.shape)}")
        body = payload.detach().cpu().contiguous().numpy().data
    else:
        body = _view(payload, 1)
    _check_total(head.nbytes + body.nbytes, max_bytes)
    parsed = _parse_header(head)
    sizes = [parsed.nbytes(i) for i in range(len(parsed.keys))]
    if sum(sizes) != body.nbytes:
        raise FrameError(f"payload holds {body.nbytes} bytes, the header describes {sum(sizes)}")
    starts = itertools.accumulate(sizes, initial=0)
    return _decode(parsed, [body[start:start + n] for start, n in zip(starts, sizes, strict=False)])


def _decode(header: _Header, buffers: list[memoryview]) -> Message:
    if sys.byteorder != "little":
        raise FrameError("the data-plane codec runs on little-endian machines only")
    if len(buffers) != len(header.keys):
        raise FrameError(f"the header names {len(header.keys)} tensors, the message has {len(buffers)} buffers")
    for i, buf in enumerate(buffers):
        expected = header.nbytes(i)
        if buf.nbytes != expected:
            raise FrameError(
                f"tensor {header.keys[i]!r} ({header.dtypes[i]}, shape {header.shapes[i]}) needs "
                f"{expected} bytes, its buffer holds {buf.nbytes}"
            )
        if header.dtypes[i] == "bool" and buf.nbytes and np.frombuffer(buf, dtype=np.uint8).max() > 1:
            raise FrameError(f"bool tensor {header.keys[i]!r} holds bytes other than 0 and 1")
    tensors = {key: _tensor_of(buf, header.dtypes[i], header.shapes[i])
               for i, (key, buf) in enumerate(zip(header.keys, buffers, strict=True))}
    return Message(tensors=tensors, step=header.step, meta=header.meta)


# --------------------------------------------------------------------------- copies
def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (numpy's array shares its memory)."""
    array = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return array.reshape(-1).view(np.uint8).data


def _tensor_of(buf: memoryview, dtype: str, shape: list[int]) -> torch.Tensor:
    """A new tensor in torch's own memory (writable, resizable) holding a copy of ``buf``.

    ``torch.tensor`` of a numpy array copies with torch's intra-op threads, does not warn about a
    read-only buffer (it copies), and costs one torch call per tensor.
    """
    copy = torch.tensor(np.frombuffer(buf, dtype=_NUMPY[dtype]).reshape(shape))
    return copy.view(torch.bfloat16) if dtype == "bfloat16" else copy


# --------------------------------------------------------------------------- checks
def _parse_header(view: memoryview) -> _Header:
    if view.nbytes > MAX_HEADER_BYTES:
        raise FrameError(f"header of {view.nbytes} bytes is too large (limit {MAX_HEADER_BYTES})")
    try:
        obj = json.loads(bytes(view).decode("utf-8"), object_pairs_hook=_unique_names)
    except FrameError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise FrameError(f"header is not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError(f"header is a JSON {type(obj).__name__}, not an object")
    unknown = sorted(k for k in obj if k not in _FIELDS)
    if unknown:
        raise FrameError(f"unknown header field(s): {', '.join(map(repr, unknown))}")
    missing = [k for k in _FIELDS if k not in obj]
    if missing:
        raise FrameError(f"missing header field(s): {', '.join(map(repr, missing))}")
    if type(obj["v"]) is not int or obj["v"] != FORMAT_VERSION:
        raise FrameError(f"header version {obj['v']!r} is not {FORMAT_VERSION}")
    _check_step(obj["step"])
    keys, dtypes, shapes, meta = obj["keys"], obj["dtype"], obj["shape"], obj["meta"]
    for name, value in (("keys", keys), ("dtype", dtypes), ("shape", shapes)):
        if not isinstance(value, list):
            raise FrameError(f"header field {name!r} is a {type(value).__name__}, not a list")
    if not len(keys) == len(dtypes) == len(shapes):
        raise FrameError(f"header lists {len(keys)} keys, {len(dtypes)} dtypes and {len(shapes)} shapes")
    if meta is not None and not isinstance(meta, dict):
        raise FrameError(f"header field 'meta' is a {type(meta).__name__}, not an object or null")
    seen: set[str] = set()
    for key, dtype, shape in zip(keys, dtypes, shapes, strict=True):
        if not isinstance(key, str):
            raise FrameError(f"tensor key {key!r} is not a string")
        if key in seen:
            raise FrameError(f"tensor key {key!r} appears twice")
        seen.add(key)
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise FrameError(f"tensor {key!r}: dtype {dtype!r} is not allowed (allowed: {', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(type(d) is int for d in shape):
            raise FrameError(f"tensor {key!r}: shape {shape!r} is not a list of ints")
        if len(shape) > MAX_RANK:
            raise FrameError(f"tensor {key!r}: {len(shape)} dimensions, more than {MAX_RANK}")
        if any(d < 0 for d in shape):
            raise FrameError(f"tensor {key!r}: negative dimension in shape {shape}")
    return _Header(step=obj["step"], keys=keys, dtypes=dtypes, shapes=shapes, meta=meta)


def _unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose names repeat is ambiguous (parsers keep the first or the last)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        names = [k for k, _ in pairs]
        raise FrameError(f"header repeats the JSON name {next(k for k in names if names.count(k) > 1)!r}")
    return obj


def _check_step(step: Any) -> None:
    if step is not None and (type(step) is not int or not 0 <= step <= _MAX_STEP):
        raise FrameError(f"step {step!r} is not null or an int in [0, 2**63)")


def _check_total(total: int, max_bytes: int) -> None:
    if total > max_bytes:
        raise FrameError(f"message of {total} bytes is over the limit of {max_bytes}")


def _view(frame: Any, index: int) -> memoryview:
    """A flat byte view of one frame, without copying."""
    try:
        view = memoryview(frame)
    except TypeError:
        raise FrameError(f"frame {index} is a {type(frame).__name__}, not a buffer") from None
    if not view.c_contiguous:
        raise FrameError(f"frame {index} is not contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.layout} tensor"
    return f"a {type(value).__name__}"
