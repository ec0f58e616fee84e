"""The data-plane codec (tidal.api.frames): round trips, and one rejection per rule of the format."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
import zmq

from tidal.api import FrameError, PermanentError
from tidal.api import frames as F

# One tensor per whitelisted dtype, with values at the edges of its range.
SAMPLES: dict[str, torch.Tensor] = {
    "float16": torch.tensor([0.5, -65504.0, 6.1e-5, math.inf], dtype=torch.float16),
    "bfloat16": torch.tensor([1.5, -2.25, 3.0e38, -math.inf], dtype=torch.bfloat16),
    "float32": torch.tensor([[math.pi, -0.0], [1e-45, math.nan]], dtype=torch.float32),
    "float64": torch.tensor([math.e, 1e-300, -1e300], dtype=torch.float64),
    "int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
    "uint8": torch.tensor([0, 1, 255], dtype=torch.uint8),
    "int16": torch.tensor([-32768, 32767], dtype=torch.int16),
    "int32": torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
    "int64": torch.tensor([-(2**63), 2**63 - 1, 0], dtype=torch.int64),
    "bool": torch.tensor([[True, False], [False, True]]),
}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality with dtype and shape (NaN equals NaN, -0.0 differs from 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous(), b.contiguous()
    return a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist()


def as_bytes(frames: list[Any]) -> list[bytes]:
    """What a receiver gets from a socket: read-only bytes that share nothing with the sender."""
    return [bytes(f) for f in frames]


# ----------------------------------------------------------------------------- round trips
def test_every_whitelisted_dtype_round_trips_bitwise() -> None:
    assert set(SAMPLES) == set(F.DTYPES)
    message = F.decode(as_bytes(F.encode(SAMPLES)))
    assert list(message.tensors) == list(SAMPLES)
    for name, tensor in SAMPLES.items():
        assert same(message.tensors[name], tensor), name


@pytest.mark.parametrize("name", sorted(F.DTYPES))
def test_empty_and_scalar_tensors_round_trip(name: str) -> None:
    dtype = F.DTYPES[name]
    tensors = {
        "empty": torch.empty(0, dtype=dtype),
        "empty_2d": torch.empty(2, 0, 3, dtype=dtype),
        "scalar": SAMPLES[name].reshape(-1)[-1].clone(),  # 0-d
    }
    assert tensors["scalar"].dim() == 0
    frames = F.encode(tensors)
    assert [len(f) for f in frames[1:]] == [0, 0, tensors["scalar"].element_size()]
    back = F.decode(as_bytes(frames)).tensors
    for key, tensor in tensors.items():
        assert same(back[key], tensor), key


def test_non_contiguous_and_odd_tensors_round_trip() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    weight = torch.nn.Parameter(torch.randn(3, 2))
    tensors = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),  # stride 0
        "row": base[2],  # contiguous, but at an offset into a bigger storage
        "parameter": weight,  # requires grad
        "negated": torch.tensor([1.0, -2.0])._neg_view(),
    }
    assert not tensors["transposed"].is_contiguous() and tensors["row"].storage_offset() == 12
    back = F.decode(as_bytes(F.encode(tensors))).tensors
    for key, tensor in tensors.items():
        assert same(back[key], tensor.detach().resolve_neg()), key
        assert back[key].is_contiguous() and not back[key].requires_grad
    assert back["row"].tolist() == [12.0, 13.0, 14.0, 15.0, 16.0, 17.0]


def test_large_tensors_round_trip_and_decode_into_torch_memory() -> None:
    """From writable and read-only frames alike, without a warning; decoded tensors are in
    torch's own memory (resizable, as a tensor torch.load made), not the frames'."""
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "big": torch.randn(1 << 18, generator=gen),  # exactly 1 MiB
        "big_bf16": torch.randn(3, 1 << 18, generator=gen).to(torch.bfloat16),
        "big_bool": torch.rand(1 << 21, generator=gen) > 0.5,
        "below": torch.randn((1 << 18) - 1, generator=gen),
        "small": torch.arange(3, dtype=torch.int16),
    }
    frames = F.encode(tensors, step=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        header, payload = F.encode_joined(tensors, step=4)
        for message in (F.decode(frames), F.decode(as_bytes(frames)),
                        F.decode([frames[0], *(bytearray(f) for f in frames[1:])]),
                        F.decode_joined(header, payload), F.decode_joined(header, bytes(payload.numpy()))):
            for key, tensor in tensors.items():
                assert same(message.tensors[key], tensor), key
            message.tensors["big"].resize_(1 << 19)
            message.tensors["small"].resize_(8)


def test_step_and_meta_round_trip_and_order_is_kept() -> None:
    meta = {"epoch": 3, "nested": {"a": [1, None, True, "ünï"]}, "best": math.inf}
    pairs = [("z", torch.ones(1)), ("a", torch.zeros(2)), ("m", torch.tensor(5))]
    message = F.decode(as_bytes(F.encode(pairs, step=2**63 - 1, meta=meta)))
    assert message.step == 2**63 - 1 and message.meta == meta
    assert list(message.tensors) == ["z", "a", "m"]

    empty = F.decode(as_bytes(F.encode({})))
    assert empty == F.Message(tensors={}, step=None, meta=None)
    assert F.decode(as_bytes(F.encode({}, step=0))).step == 0


def test_the_header_is_the_documented_json() -> None:
    frames = F.encode({"x": torch.zeros(2, 3), "y": torch.zeros(2, dtype=torch.int64)}, step=7, meta={"k": 1})
    assert json.loads(bytes(frames[0])) == {
        "v": 1, "step": 7, "keys": ["x", "y"], "dtype": ["float32", "int64"], "shape": [[2, 3], [2]],
        "meta": {"k": 1},
    }
    assert [len(f) for f in frames[1:]] == [24, 16]


def test_encode_shares_contiguous_cpu_tensors_and_decode_copies() -> None:
    source = torch.zeros(4)
    frames = F.encode({"w": source})
    source[1] = 7.0  # the frame is a view of the tensor's memory: no copy on send
    assert torch.frombuffer(bytearray(frames[1]), dtype=torch.float32)[1] == 7.0

    wire = bytearray(frames[1])
    back = F.decode([frames[0], wire]).tensors["w"]
    wire[:] = bytes(len(wire))  # the decoded tensor owns its memory
    back += 1  # and it is writable
    assert back.tolist() == [1.0, 8.0, 1.0, 1.0]


def test_decoding_read_only_buffers_does_not_warn() -> None:
    frames = as_bytes(F.encode(SAMPLES))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.decode(frames)
        F.decode_joined(*F.encode_joined(SAMPLES))


def test_a_message_crosses_a_real_zeromq_socket() -> None:
    """zmq.Frame objects (copy=False on both sides) are frames as they come."""
    context = zmq.Context()
    try:
        sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        receiver.bind("inproc://frames")
        sender.connect("inproc://frames")
        sender.send_multipart(F.encode(SAMPLES, step=5, meta={"from": "ps-0"}), copy=False)
        received = receiver.recv_multipart(copy=False)
        message = F.decode(received)
        sender.close()
        receiver.close()
    finally:
        context.term()
    assert message.step == 5 and message.meta == {"from": "ps-0"}
    for name, tensor in SAMPLES.items():
        assert same(message.tensors[name], tensor), name


def test_the_joined_form_is_the_frames_back_to_back() -> None:
    frames = F.encode(SAMPLES, step=1, meta={"m": 0})
    header, payload = F.encode_joined(SAMPLES, step=1, meta={"m": 0})
    assert header == frames[0]
    assert payload.dtype == torch.uint8 and bytes(payload.numpy()) == b"".join(frames[1:])
    for carried in (payload, bytes(payload.numpy())):
        message = F.decode_joined(header, carried)
        assert message.step == 1 and message.meta == {"m": 0}
        for name, tensor in SAMPLES.items():
            assert same(message.tensors[name], tensor), name
    assert F.decode_joined(*F.encode_joined({}, step=2)) == F.Message(tensors={}, step=2, meta=None)


def test_encode_joined_copies_and_leaves_the_tensors_resizable() -> None:
    source = torch.zeros(4)
    header, payload = F.encode_joined({"w": source})
    source[0] = 1.0
    assert F.decode_joined(header, payload).tensors["w"].tolist() == [0.0] * 4
    source.resize_(64)  # encode's zero-copy frames would forbid this (numpy shares the memory)


# ----------------------------------------------------------------------------- rejection
def parts(**header: Any) -> tuple[dict[str, Any], list[bytes]]:
    """A valid two-tensor message as (header dict, buffers), with header fields overridden."""
    fields: dict[str, Any] = {
        "v": 1, "step": 3, "keys": ["w", "n"], "dtype": ["float32", "int64"], "shape": [[2], []], "meta": None,
    }
    fields.update(header)
    return fields, [bytes(8), bytes(8)]


def message(header: dict[str, Any], buffers: list[bytes]) -> list[bytes]:
    return [json.dumps(header).encode(), *buffers]


def rejected(frames: list[Any], match: str, **kwargs: Any) -> None:
    with pytest.raises(FrameError, match=match):
        F.decode(frames, **kwargs)


def test_the_hand_built_message_the_rejection_tests_start_from_is_valid() -> None:
    back = F.decode(message(*parts()))
    assert back.step == 3 and back.tensors["w"].tolist() == [0.0, 0.0] and back.tensors["n"].dim() == 0


def test_frame_error_is_permanent_bad_input() -> None:
    assert issubclass(FrameError, PermanentError) and issubclass(FrameError, ValueError)


@pytest.mark.parametrize("dtype", ["object", "complex64", "complex128", "float8_e4m3fn", "qint8", "uint16",
                                   "torch.float32", "Float32", "", 4, None])
def test_a_dtype_outside_the_whitelist_is_rejected(dtype: Any) -> None:
    header, buffers = parts(dtype=[dtype, "int64"])
    rejected(message(header, buffers), "not allowed")


@pytest.mark.parametrize("delta", [-1, 1])
def test_a_buffer_one_byte_off_its_shape_is_rejected(delta: int) -> None:
    header, buffers = parts()
    buffers[0] = bytes(8 + delta)
    rejected(message(header, buffers), r"'w' \(float32, shape \[2\]\) needs 8 bytes, its buffer holds")


def test_a_shape_far_larger_than_its_buffer_is_rejected() -> None:
    header, buffers = parts(shape=[[1 << 40, 1 << 40], []])
    rejected(message(header, buffers), "needs")


@pytest.mark.parametrize("shape", [[-1], [2, -1], [-2, -4]])
def test_a_negative_dimension_is_rejected(shape: list[int]) -> None:
    header, buffers = parts(shape=[shape, []])
    buffers[0] = bytes(4 * abs(math.prod(shape)))
    rejected(message(header, buffers), "negative dimension")


@pytest.mark.parametrize("shape", [[2.0], ["2"], [True, 2], 2, None, [[2]]])
def test_a_shape_that_is_not_a_list_of_ints_is_rejected(shape: Any) -> None:
    header, buffers = parts(shape=[shape, []])
    rejected(message(header, buffers), "not a list of ints")


def test_more_dimensions_than_max_rank_are_rejected() -> None:
    header, buffers = parts(shape=[[1] * F.MAX_RANK + [2], []])
    rejected(message(header, buffers), f"more than {F.MAX_RANK}")
    at_limit = F.decode(message(*parts(shape=[[1] * (F.MAX_RANK - 1) + [2], []])))
    assert at_limit.tensors["w"].dim() == F.MAX_RANK


def test_a_header_over_the_limit_is_rejected_and_one_at_it_accepted() -> None:
    header, buffers = parts()
    text = json.dumps(header).encode()
    at_limit = text + b" " * (F.MAX_HEADER_BYTES - len(text))  # JSON allows trailing blanks
    assert F.decode([at_limit, *buffers]).step == 3
    rejected([at_limit + b" ", *buffers], "too large")


@pytest.mark.parametrize("extra", [{"version": 1}, {"Step": 3}, {"offsets": [0, 8]}])
def test_an_unknown_header_field_is_rejected(extra: dict[str, Any]) -> None:
    header, buffers = parts()
    rejected(message({**header, **extra}, buffers), "unknown header field")


@pytest.mark.parametrize("field", ["v", "step", "keys", "dtype", "shape", "meta"])
def test_a_missing_header_field_is_rejected(field: str) -> None:
    header, buffers = parts()
    del header[field]
    rejected(message(header, buffers), f"missing header field.*'{field}'")


@pytest.mark.parametrize("buffers", [[bytes(8)], [bytes(8), bytes(8), b""], []])
def test_a_key_count_that_differs_from_the_buffer_count_is_rejected(buffers: list[bytes]) -> None:
    header, _ = parts()
    rejected(message(header, buffers), r"names 2 tensors, the message has \d buffers")


@pytest.mark.parametrize(
    "override",
    [{"keys": ["w"]}, {"dtype": ["float32"]}, {"shape": [[2], [], []]}],
)
def test_lists_of_different_lengths_are_rejected(override: dict[str, Any]) -> None:
    header, buffers = parts(**override)
    rejected(message(header, buffers), "keys, .* dtypes and .* shapes")


def test_a_duplicate_key_is_rejected() -> None:
    header, buffers = parts(keys=["w", "w"], dtype=["float32", "float32"], shape=[[2], [2]])
    rejected(message(header, buffers), "'w' appears twice")


def test_a_repeated_json_name_is_rejected() -> None:
    header, buffers = parts()
    text = json.dumps(header)
    rejected([('{"step": 3, ' + text[1:]).encode(), *buffers], "repeats the JSON name 'step'")
    meta = text.replace('"meta": null', '"meta": {"a": 1, "a": 2}')
    rejected([meta.encode(), *buffers], "repeats the JSON name 'a'")


def test_a_message_over_max_bytes_is_rejected_and_one_at_it_accepted() -> None:
    frames = message(*parts())
    size = sum(len(f) for f in frames)
    assert F.decode(frames, max_bytes=size).step == 3
    rejected(frames, "over the limit", max_bytes=size - 1)
    header, payload = F.encode_joined(F.decode(frames).tensors, step=3)
    joined = len(header) + payload.numel()
    assert F.decode_joined(header, payload, max_bytes=joined).step == 3
    with pytest.raises(FrameError, match="over the limit"):
        F.decode_joined(header, payload, max_bytes=joined - 1)


@pytest.mark.parametrize(
    "raw",
    [b"", b"not json", b'{"v": 1', b"[]", b"1", b"null", b'"v"', b"\xff\xfe{}", b"[" * 100_000],
)
def test_a_header_that_is_not_a_json_object_is_rejected(raw: bytes) -> None:
    rejected([raw, bytes(8), bytes(8)], "header is")


@pytest.mark.parametrize("step", [-1, 2**63, 1.0, True, "3", [3]])
def test_a_step_that_is_not_null_or_an_int_in_range_is_rejected(step: Any) -> None:
    header, buffers = parts(step=step)
    rejected(message(header, buffers), "step")


@pytest.mark.parametrize("version", [0, 2, True, "1", None, 1.0])
def test_another_version_is_rejected(version: Any) -> None:
    header, buffers = parts(v=version)
    rejected(message(header, buffers), "version")


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"keys": "wn"}, "'keys' is a str"),
        ({"dtype": {"w": "float32"}}, "'dtype' is a dict"),
        ({"shape": None}, "'shape' is a NoneType"),
        ({"keys": ["w", 5]}, "key 5 is not a string"),
        ({"meta": [1, 2]}, "'meta' is a list"),
        ({"meta": "x"}, "'meta' is a str"),
    ],
)
def test_fields_of_the_wrong_type_are_rejected(override: dict[str, Any], match: str) -> None:
    header, buffers = parts(**override)
    rejected(message(header, buffers), match)


def test_a_bool_tensor_holding_other_bytes_is_rejected() -> None:
    header, _ = parts(keys=["b"], dtype=["bool"], shape=[[3]])
    assert F.decode(message(header, [b"\x00\x01\x01"])).tensors["b"].tolist() == [False, True, True]
    rejected(message(header, [b"\x00\x02\x01"]), "other than 0 and 1")


@pytest.mark.parametrize("frames", [[], [5], ["{}"], [b"{}", 3]])
def test_frames_that_are_not_buffers_are_rejected(frames: list[Any]) -> None:
    rejected(frames, "header frame|not a buffer")


def test_decode_joined_rejects_a_payload_one_byte_off() -> None:
    header, payload = F.encode_joined({"w": torch.zeros(2), "n": torch.tensor(0)}, step=3)
    for bad in (payload[:-1], torch.cat([payload, torch.zeros(1, dtype=torch.uint8)])):
        with pytest.raises(FrameError, match="payload holds"):
            F.decode_joined(header, bad)
    with pytest.raises(FrameError, match="1-d uint8"):
        F.decode_joined(header, payload.view(torch.int16))


# ----------------------------------------------------------------------------- encode refuses
@pytest.mark.parametrize(
    "value",
    [torch.zeros(2, dtype=torch.complex64), torch.zeros(2, dtype=torch.uint16), torch.eye(2).to_sparse(),
     [1.0, 2.0], b"raw"],
)
def test_encode_refuses_what_the_format_cannot_carry(value: Any) -> None:
    with pytest.raises(TypeError):
        F.encode({"x": value})


@pytest.mark.parametrize(
    ("tensors", "kwargs", "match"),
    [
        ([("a", torch.zeros(1)), ("a", torch.ones(1))], {}, "appears twice"),
        ([(3, torch.zeros(1))], {}, "must be strings"),
        ({"a": torch.zeros([1] * (F.MAX_RANK + 1))}, {}, "dimensions"),
        ({}, {"step": -1}, "step"),
        ({}, {"step": True}, "step"),
        ({}, {"meta": {"pad": "x" * F.MAX_HEADER_BYTES}}, "too large"),
    ],
)
def test_encode_refuses_a_message_decode_would_reject(tensors: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(FrameError, match=match):
        F.encode(tensors, **kwargs)


def test_encode_refuses_meta_that_is_not_an_object() -> None:
    with pytest.raises(TypeError, match="meta"):
        F.encode({}, meta=[1, 2])  # type: ignore[arg-type]


def test_importing_tidal_api_does_not_import_torch() -> None:
    """The codec needs torch; the wire types the master and the CLI import must not."""
    code = "import sys, tidal.api; assert 'torch' not in sys.modules and 'tidal.api.frames' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_rpc_callers_default_bound_is_the_codecs() -> None:
    """tidal.api.rpc keeps its own copy of the bound so that importing it needs no torch."""
    from tidal.api import rpc

    assert rpc.MAX_MESSAGE_BYTES == F.MAX_MESSAGE_BYTES


def test_the_master_does_not_import_torch() -> None:
    """`tidal run` checks its options and the master starts without torch (2 s and 100 MB)."""
    code = "import sys, tidal.master.job, tidal.master.server, tidal.cli.job; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr
