"""Worker state: pack/unpack (the only way state crosses a socket: the tidal.api.frames codec with
the tree skeleton as its meta) and commit/restore."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from tidal.api import FrameError, frames
from tidal.worker.state import State, pack_state, unpack_state

pytestmark = pytest.mark.speed_free


def assert_same(a: Any, b: Any, path: str = "tree") -> None:
    """Deep equality that also checks container types, key types, dtypes and shapes.

    A state_dict's OrderedDict comes back as a plain dict (same keys, same order): that is fine.
    """
    if isinstance(a, dict) and isinstance(b, dict):
        a, b = dict(a), dict(b)
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{path}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{path}: length"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def round_trip(tree: Any) -> Any:
    header, flat = pack_state(tree)
    assert isinstance(header, bytes) and flat.dtype == torch.uint8 and flat.dim() == 1
    return unpack_state(header, flat)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1),
    )


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 5, generator=g), torch.randn(16, 1, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


# ----------------------------------------------------------------------------- pack / unpack
def test_model_and_adam_state_round_trip() -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.01)
    train_step(model, opt, 1)
    tree = {"model": model.state_dict(), "optimizer": opt.state_dict(), "applied_step": 0, "epoch": 2}
    osd = tree["optimizer"]
    assert all(isinstance(k, int) for k in osd["state"])  # int keys
    assert isinstance(osd["param_groups"][0]["betas"], tuple)  # tuples
    assert osd["state"][0]["step"].dim() == 0  # 0-dim tensors
    assert tree["model"]["1.num_batches_tracked"].dtype == torch.int64
    back = round_trip(tree)
    assert_same(back, tree)


def test_odd_tensors_and_values_round_trip() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tree = {
        "bf16": torch.tensor([1.5, -2.25, 3.0e38], dtype=torch.bfloat16),
        "f16": torch.tensor([[0.5, 65504.0]], dtype=torch.float16),
        "f64": torch.tensor([math.pi, -0.0, 1e-300], dtype=torch.float64),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "scalar_f": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "empty_int": torch.zeros(2, 0, dtype=torch.int32),
        "bools": torch.tensor([True, False, True]),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "i16": torch.tensor([-3, 30000], dtype=torch.int16),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "transposed": base.t(),  # not contiguous
        "slice": base[:, 1],  # a view with an offset into a bigger storage
        "nested": [({"a": 1}, [None, "s"]), (), []],
        7: "an int key",
        -1: 0.125,
        "json": [True, False, None, 0, -(2**62), 1.5, "ünïcode"],
    }
    back = round_trip(tree)
    expected = {**tree, "transposed": base.t().contiguous(), "slice": base[:, 1].contiguous()}
    assert_same(back, expected)


def test_nothing_but_scalars_and_an_empty_tree() -> None:
    header, flat = pack_state({"a": 1})
    assert flat.numel() == 0
    assert unpack_state(header, flat) == {"a": 1}
    assert round_trip({}) == {}
    assert round_trip(None) is None


def test_unpacked_tensors_do_not_share_the_buffer() -> None:
    header, flat = pack_state({"w": torch.ones(4)})
    back = unpack_state(header, flat)
    flat.zero_()
    assert torch.equal(back["w"], torch.ones(4))


@pytest.mark.parametrize(
    "bad",
    [
        {"c": torch.zeros(2, dtype=torch.complex64)},
        {"x": object()},
        {"s": {1, 2}},
        {(1, 2): 3},  # tuple key
        {True: 1},  # bool keys would come back as ints
        {1.5: 1},
    ],
)
def test_pack_refuses_what_it_cannot_send(bad: Any) -> None:
    with pytest.raises(TypeError):
        pack_state(bad)


def test_pack_refuses_two_tensors_at_one_path() -> None:
    """Paths join keys with "/": {0: a, "0": b} would send one of them twice and lose the other."""
    for bad in ({0: torch.zeros(1), "0": torch.ones(1)}, {"a/b": torch.zeros(1), "a": {"b": torch.ones(1)}}):
        with pytest.raises(TypeError, match="path"):
            pack_state(bad)


def test_the_skeleton_travels_as_the_codec_meta() -> None:
    header, flat = pack_state({"w": torch.tensor([2.0, 3.0]), "n": 4})
    fields = json.loads(header)
    assert fields["keys"] == ["/w"] and fields["dtype"] == ["float32"] and fields["shape"] == [[2]]
    assert fields["meta"] == {"D": [["w", {"T": "float32", "shape": [2], "path": "/w"}], ["n", {"V": 4}]]}
    assert flat.numel() == 8


def _node(path: str = "/w", dtype: str = "float32", shape: list[int] | None = None) -> dict[str, Any]:
    return {"T": dtype, "shape": [2] if shape is None else shape, "path": path}


def _message(skeleton: Any, tensors: dict[str, torch.Tensor] | None = None) -> tuple[bytes, torch.Tensor]:
    """A hand-built state message: codec frames of ``tensors`` with ``skeleton`` as the meta."""
    tensors = {"/w": torch.tensor([2.0, 3.0])} if tensors is None else tensors
    return frames.encode_joined(tensors, meta=skeleton)


def _edit(header: bytes, **fields: Any) -> bytes:
    return json.dumps({**json.loads(header), **fields}).encode()


def test_a_hand_built_state_message_is_accepted() -> None:
    back = unpack_state(*_message({"D": [["w", _node()]]}))
    assert list(back) == ["w"] and torch.equal(back["w"], torch.tensor([2.0, 3.0]))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"dtype": ["complex64"]}, "not allowed"),
        ({"dtype": ["object"]}, "not allowed"),
        ({"shape": [[3]]}, "payload holds 8 bytes, the header describes 12"),
        ({"shape": [[-2]]}, "negative dimension"),
        ({"offsets": [0]}, "unknown header field"),
        ({"meta": None}, "no tree skeleton"),
    ],
)
def test_unpack_checks_the_message_with_the_codec(fields: dict[str, Any], match: str) -> None:
    header, flat = _message({"D": [["w", _node()]]})
    with pytest.raises(FrameError, match=match):
        unpack_state(_edit(header, **fields), flat)


def test_unpack_rejects_a_buffer_one_byte_off_and_a_state_over_its_limit() -> None:
    header, flat = _message({"D": [["w", _node()]]})
    with pytest.raises(FrameError, match="payload holds"):
        unpack_state(header, flat[:-1])
    with pytest.raises(FrameError, match="over the limit"):
        unpack_state(header, flat, max_bytes=len(header) + flat.numel() - 1)


@pytest.mark.parametrize(
    ("skeleton", "match"),
    [
        ({"D": [["w", _node(dtype="float64")]]}, "does not match the skeleton"),
        ({"D": [["w", _node(shape=[1, 2])]]}, "does not match the skeleton"),
        ({"D": [["w", _node(path="/v")]]}, "missing"),
        ({"D": [["w", _node()], ["v", _node()]]}, "twice"),
        ({"D": [["w", _node(dtype="complex64")]]}, "not allowed"),
        ({"D": [["w", _node(shape=[-2])]]}, "negative dimension"),
        ({"D": [["n", {"V": 1}]]}, "not in the skeleton"),  # a tensor the skeleton does not place
    ],
)
def test_unpack_rejects_a_skeleton_that_does_not_describe_its_tensors(skeleton: Any, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        unpack_state(*_message(skeleton))


@pytest.mark.parametrize(
    "skeleton",
    [{}, {"X": 1}, {"D": [["a", {}]]}, {"L": [5]}, {"D": [["a"]]}, {"U": [{"Q": 0}]}, {"D": 5}, {"L": 3},
     {"T": "float32"}, {"T": "float32", "shape": 3, "path": "/w"}, {"D": [[{"i": "x"}, {"V": 1}]]}],
)
def test_unpack_rejects_a_malformed_skeleton(skeleton: Any) -> None:
    with pytest.raises(FrameError):
        unpack_state(*_message(skeleton))


@pytest.mark.parametrize(
    "header", [b"", b"not json", b'{"D": [', b"[]", b"{}", b"1", b"null", b'"V"', b'{"X": 1}', b"\xff\xfe"],
)
def test_unpack_rejects_a_malformed_header(header: bytes) -> None:
    with pytest.raises(FrameError):
        unpack_state(header, torch.zeros(8, dtype=torch.uint8))


def test_unpack_rejects_an_oversized_header() -> None:
    header = b" " * (frames.MAX_HEADER_BYTES + 1)
    with pytest.raises(FrameError, match="too large"):
        unpack_state(header, torch.zeros(0, dtype=torch.uint8))


# ----------------------------------------------------------------------------- commit / restore
def test_state_tracks_the_persistent_buffers_only() -> None:
    """BatchNorm statistics are state; a non-persistent buffer (an index table) is not: it is in
    no checkpoint and no new worker receives it, so a step neither snapshots nor restores it."""
    model = make_model()
    model.register_buffer("index", torch.arange(4), persistent=False)
    state = State(model)
    tracked = {id(b) for b in state.buffers()}
    assert tracked == {id(b) for name, b in model.named_buffers() if name != "index"}
    assert len(tracked) == 3  # running_mean, running_var, num_batches_tracked


def test_restore_puts_back_buffers_and_extras_but_not_parameters() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = State(model, opt, seen=[1, 2], best=0.5, t=torch.zeros(3))
    state.applied_step, state.epoch = 4, 1
    state.commit()
    committed_buffers = {k: v.clone() for k, v in model.named_buffers()}

    # a step that fails after its forward pass: buffers and extras change, parameters change too
    train_step(model, opt, 2)  # forward in train mode moves the BatchNorm statistics
    state.extras["seen"].append(3)  # in place: the committed copy must not see it
    state.extras["best"] = 0.1
    state.extras["new"] = "x"
    state.extras["t"] += 1
    state.applied_step, state.epoch = 5, 2
    params_after = {k: v.detach().clone() for k, v in model.named_parameters()}
    assert not torch.equal(model[1].running_mean, committed_buffers["1.running_mean"])

    state.restore()
    for k, v in model.named_buffers():
        assert torch.equal(v, committed_buffers[k]), k
    for k, v in model.named_parameters():
        assert torch.equal(v, params_after[k]), f"restore touched parameter {k}"
    assert state.extras["seen"] == [1, 2] and state.extras["best"] == 0.5 and "new" not in state.extras
    assert torch.equal(state.extras["t"], torch.zeros(3))
    assert (state.applied_step, state.epoch) == (4, 1)

    # restore twice gives the same; a later mutation of the restored extras does not leak back
    state.extras["seen"].append(99)
    state.restore()
    assert state.extras["seen"] == [1, 2]


def test_restore_keeps_the_buffer_tensors_in_place() -> None:
    model = make_model()
    state = State(model)
    running_mean = model[1].running_mean
    model.train()
    model(torch.randn(4, 5))
    state.restore()
    assert model[1].running_mean is running_mean  # copied into, not replaced
    assert torch.equal(running_mean, torch.zeros(8))
    assert int(model[1].num_batches_tracked) == 0


def test_initial_state_is_committed() -> None:
    model = make_model()
    state = State(model, None, k=1)
    assert (state.applied_step, state.epoch) == (-1, 0)
    state.extras["k"] = 2
    state.applied_step = 3
    state.restore()
    assert state.extras == {"k": 1} and state.applied_step == -1


def test_load_tree_applies_a_packed_tree_to_a_fresh_model_and_optimizer() -> None:
    src_model = make_model(seed=1)
    src_opt = torch.optim.Adam(src_model.parameters(), lr=1e-2, betas=(0.7, 0.9))
    src = State(src_model, src_opt, seen=[3], lr_scale=torch.tensor(0.5, dtype=torch.bfloat16))
    for s in range(3):
        train_step(src_model, src_opt, s)
    src.applied_step, src.epoch = 2, 1
    src.commit()

    header, flat = pack_state(src.to_tree())
    dst_model = make_model(seed=2)
    dst_opt = torch.optim.Adam(dst_model.parameters(), lr=1.0)
    dst = State(dst_model, dst_opt)
    dst.load_tree(unpack_state(header, flat))

    assert_same(dst_model.state_dict(), src_model.state_dict())
    assert_same(dst_opt.state_dict(), src_opt.state_dict())
    assert dst.extras["seen"] == [3] and torch.equal(dst.extras["lr_scale"], src.extras["lr_scale"])
    assert (dst.applied_step, dst.epoch) == (2, 1)

    # the loaded optimizer state is live: the next step is the same on both sides
    train_step(src_model, src_opt, 10)
    train_step(dst_model, dst_opt, 10)
    assert_same(dst_model.state_dict(), src_model.state_dict())

    # load_tree commits: a restore goes back to the loaded values
    dst.applied_step = 9
    dst.extras["seen"].append(4)
    dst.restore()
    assert dst.applied_step == 2 and dst.extras["seen"] == [3]


def test_load_tree_without_optimizer_state() -> None:
    src = State(make_model(seed=3), None)
    dst = State(make_model(seed=4), torch.optim.SGD(make_model().parameters(), lr=0.1))
    dst.load_tree(round_trip(src.to_tree()))
    assert_same(dst.model.state_dict(), src.model.state_dict())
