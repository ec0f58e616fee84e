"""Data workers and a trainer's dispatcher over real ZeroMQ sockets on 127.0.0.1 (tidal.data).

The data workers here serve from threads of the test process (the job tests of
tests/test_data_workers_job.py run them as processes and SIGKILL them); what is checked is the
protocol: the same batches as built locally, each range consumed once and in order, re-dispatch
when a data worker goes away or stays silent, and rogue answers (ids never given, other ranges,
broken frames) reported and rebuilt, never trained.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import zmq

from tidal.api import frames
from tidal.data.batches import BatchError, BatchShape, build_batch, flatten, unflatten
from tidal.data.dispatch import Dispatcher
from tidal.data.worker import DataWorker, loader_key, serve

TOKEN = "secret"


class Squares:
    """Sample i is (i, i*i) as int64; ``get_range`` is the fast path."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def get_range(self, start: int, end: int) -> dict[str, torch.Tensor]:
        x = torch.arange(start, end)
        return {"x": x, "y": x * x}


def features(raw: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A stateless transform with nesting: a dict holding a tuple and a list."""
    x = raw["x"].double()
    return {"dense": (x.sqrt(), raw["y"].float()), "ids": [raw["x"] % 7], "label": (raw["x"] % 2).bool()}


def equal(a: Any, b: Any) -> bool:
    sa, ta = flatten(a)
    sb, tb = flatten(b)
    return sa == sb and ta.keys() == tb.keys() and all(
        ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta)


@contextmanager
def data_workers(n: int, dataset: Any = None, preprocess: Callable[[Any], Any] | None = features,
                 token: str = TOKEN) -> Iterator[tuple[list[str], list[threading.Event], list[DataWorker]]]:
    """``n`` data workers serving from threads: their addresses, stop events and builders."""
    dataset = dataset or Squares(10_000)
    addresses, stops, workers, threads = [], [], [], []
    for i in range(n):
        ready = threading.Event()
        box: list[str] = []
        stop = threading.Event()
        worker = DataWorker(dataset, preprocess, token, data_worker_id=i)

        def bound(address: str, box: list[str] = box, ready: threading.Event = ready) -> None:
            box.append(address)
            ready.set()

        t = threading.Thread(target=serve, args=(worker,), kwargs={"ready": bound, "stop": stop}, daemon=True)
        t.start()
        assert ready.wait(10)
        addresses.append(box[0])
        stops.append(stop)
        workers.append(worker)
        threads.append(t)
    try:
        yield addresses, stops, workers
    finally:
        for stop in stops:
            stop.set()
        for t in threads:
            t.join(5)


def make_dispatcher(addresses: list[str], dataset: Any = None, preprocess: Callable[[Any], Any] | None = features,
                    **options: Any) -> Dispatcher:
    dataset = dataset or Squares(10_000)

    def local(step: int, start: int, end: int) -> Any:
        return build_batch(dataset, start, end, preprocess)

    return Dispatcher(TOKEN, loader_key(len(dataset), preprocess), local, lambda: addresses, **options)


def ranges(n: int, size: int = 100) -> list[tuple[Any, int, int]]:
    return [((0, 0, i * size, (i + 1) * size), i * size, (i + 1) * size) for i in range(n)]


def built_here(plan: list[tuple[Any, int, int]]) -> list[Any]:
    """The batches of ``plan`` as the trainer builds them itself (the reference)."""
    return [build_batch(Squares(10_000), a, b, features) for _, a, b in plan]


def same(got: list[Any], want: list[Any]) -> bool:
    return len(got) == len(want) and all(equal(g, w) for g, w in zip(got, want, strict=True))


def consume(d: Dispatcher, plan: list[tuple[Any, int, int]], after: Callable[[int], None] | None = None) -> list[Any]:
    out = []
    for i, (key, a, b) in enumerate(plan):
        out.append(d.take(key, a, b, iter(plan[i + 1:])))
        if after is not None:
            after(i)
    return out


# ---------------------------------------------------------------------------- batches
def test_flatten_round_trips_nested_batches_bit_for_bit() -> None:
    batch = features(Squares(50).get_range(10, 20))
    skeleton, tensors = flatten(batch)
    msg = frames.decode(frames.encode(tensors, step=3, meta={"tree": skeleton}))
    back = unflatten(msg.meta["tree"], msg.tensors)  # type: ignore[index]
    assert isinstance(back["dense"], tuple) and isinstance(back["ids"], list)
    assert equal(back, batch)


@pytest.mark.parametrize("bad", [{"x": [1, 2]}, {3: torch.zeros(1)}, "text"])
def test_flatten_refuses_what_is_not_tensors(bad: Any) -> None:
    with pytest.raises(BatchError):
        flatten(bad)


def test_unflatten_refuses_a_skeleton_that_does_not_match_the_tensors() -> None:
    tensors = {"a": torch.zeros(2)}
    for skeleton in ({"t": "b"}, {"d": {"a": {"t": "a"}, "b": {"t": "a"}}}, {"x": 1}, [1]):
        with pytest.raises(BatchError):
            unflatten(skeleton, tensors)
    with pytest.raises(BatchError, match="does not name"):
        unflatten({"t": "a"}, {"a": torch.zeros(1), "b": torch.zeros(1)})


def test_a_batch_that_changes_dtype_or_shape_is_named_by_its_range() -> None:
    shape = BatchShape()
    shape.check(*flatten({"x": torch.zeros(4, 3)}), start=0, end=4)
    shape.check(*flatten({"x": torch.zeros(2, 3)}), start=4, end=6)  # a short last batch is fine
    with pytest.raises(BatchError, match=r"samples \[6, 10\).*float32\[3\] then float64\[3\]"):
        shape.check(*flatten({"x": torch.zeros(4, 3, dtype=torch.float64)}), start=6, end=10)
    with pytest.raises(BatchError, match="structure changed"):
        shape.check(*flatten({"y": torch.zeros(4, 3)}), start=10, end=14)


def test_a_failing_preprocess_names_the_samples() -> None:
    def fails(raw: dict[str, torch.Tensor]) -> Any:
        if int(raw["x"][0]) >= 300:
            raise ValueError("bad record")
        return raw

    assert build_batch(Squares(1000), 0, 100, fails)["x"].shape == (100,)
    with pytest.raises(BatchError, match=r"preprocess failed on samples \[300, 400\): ValueError: bad record"):
        build_batch(Squares(1000), 300, 400, fails)


# ---------------------------------------------------------------------------- dispatch
def test_batches_from_data_workers_equal_the_local_ones_in_order() -> None:
    plan = ranges(40)
    with data_workers(3) as (addresses, _, workers):
        d = make_dispatcher(addresses)
        try:
            got = consume(d, plan)
        finally:
            d.close()
    assert same(got, built_here(plan))
    assert d.received == 40 and d.built_here == 0 and d.taken == 40
    assert all(w.batches > 0 for w in workers)  # every data worker had a share: no fixed pairing


def test_with_no_data_worker_the_trainer_builds_its_batches() -> None:
    plan = ranges(5)
    d = make_dispatcher([])
    try:
        got = consume(d, plan)
    finally:
        d.close()
    assert d.built_here == 5 and d.received == 0
    assert same(got, built_here(plan))


def test_a_data_worker_that_goes_away_has_its_batches_redispatched() -> None:
    plan = ranges(30)
    with data_workers(2) as (addresses, stops, _):
        listed = list(addresses)
        d = make_dispatcher(listed, prefetch=6)

        def lose_one(i: int) -> None:
            if i == 5:
                stops[0].set()  # it stops answering, with batches in flight
                listed.remove(addresses[0])  # and the master takes it off the list

        try:
            got = consume(d, plan, lose_one)
        finally:
            d.close()
    assert same(got, built_here(plan))
    assert d.taken == 30


def test_a_silent_data_worker_times_out_and_its_batch_is_built_elsewhere() -> None:
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)  # accepts tasks, never answers
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    plan = ranges(4)
    d = make_dispatcher([f"tcp://127.0.0.1:{port}"], timeout_s=0.3)
    try:
        got = consume(d, plan)
    finally:
        d.close()
        mute.close(0)
        ctx.term()
    assert d.redispatched >= 1 and d.built_here == 4  # the only data worker is mute: built here
    assert same(got, built_here(plan))


def test_rogue_answers_are_dropped_or_rebuilt_never_trained(caplog: pytest.LogCaptureFixture) -> None:
    """A data worker that answers with a step id never given, with another range's batch, and
    with frames whose header does not match its buffers."""
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def answer() -> None:
        n = 0
        while not stop.is_set():
            if not rogue.poll(50):
                continue
            ident, *body = rogue.recv_multipart()
            task = frames.decode(body)
            meta, step = task.meta or {}, task.step
            assert step is not None
            good = build_batch(Squares(10_000), meta["start"], meta["end"], features)
            skeleton, tensors = flatten(good)
            if n % 3 == 0:  # a step id nobody gave out
                rogue.send_multipart([ident, *frames.encode(tensors, step=step + 10_000, meta={
                    "start": meta["start"], "end": meta["end"], "tree": skeleton})])
            elif n % 3 == 1:  # another range's samples
                rogue.send_multipart([ident, *frames.encode(tensors, step=step, meta={
                    "start": meta["start"] + 1, "end": meta["end"], "tree": skeleton})])
            else:  # a header whose sizes do not match its buffers
                parts = frames.encode(tensors, step=step, meta={"start": meta["start"], "end": meta["end"],
                                                                "tree": skeleton})
                rogue.send_multipart([ident, parts[0], *[bytes(p)[:-1] for p in parts[1:]]])
            n += 1

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    plan = ranges(3)
    d = make_dispatcher([f"tcp://127.0.0.1:{port}"], timeout_s=2.0)
    try:
        got = consume(d, plan)
    finally:
        stop.set()
        t.join(5)
        d.close()
        rogue.close(0)
        ctx.term()
    assert same(got, built_here(plan))
    text = caplog.text
    assert "never gave out" in text and "but the step is samples" in text and "malformed batch" in text


def test_a_preprocess_error_in_a_data_worker_reaches_the_trainer_by_name() -> None:
    def fails(raw: dict[str, torch.Tensor]) -> Any:
        if int(raw["x"][0]) == 200:
            raise KeyError("field 'age' missing")
        return raw

    plan = ranges(4)
    with data_workers(1, preprocess=fails) as (addresses, _, _):
        d = make_dispatcher(addresses, preprocess=fails)
        try:
            with pytest.raises(BatchError, match=r"preprocess failed on samples \[200, 300\): KeyError.*in data worker 0"):
                consume(d, plan)
        finally:
            d.close()


def test_a_task_without_the_token_gets_no_batch() -> None:
    with data_workers(1, token="another") as (addresses, _, workers):
        d = make_dispatcher(addresses, timeout_s=0.3)
        try:
            got = consume(d, ranges(2))
        finally:
            d.close()
    assert workers[0].batches == 0 and d.built_here == 2 and len(got) == 2


def test_a_second_loader_is_built_by_the_trainer(caplog: pytest.LogCaptureFixture) -> None:
    """Data workers serve the script's first loader; another one's tasks are refused by name and
    built by the trainer, never failed."""
    plan = ranges(3)
    with data_workers(1, dataset=Squares(500)) as (addresses, _, workers):
        d = make_dispatcher(addresses)  # the trainer's dataset has 10,000 samples
        try:
            got = consume(d, plan)
        finally:
            d.close()
    assert same(got, built_here(plan)) and d.built_here == 3 and workers[0].batches == 0
    assert caplog.text.count("serves loader 500:features") == 1


def test_a_reset_drops_every_batch_in_flight_by_its_step_id() -> None:
    """After a re-form the old leases are void: their batches, arriving late, are dropped."""
    plan = ranges(12)
    with data_workers(2) as (addresses, _, _):
        d = make_dispatcher(addresses, prefetch=8)
        try:
            consume(d, plan[:2])  # six more are in flight
            d.reset()
            again = [((1, *k[1:]), a, b) for k, a, b in plan]  # the same ranges under a new generation
            got = consume(d, again[2:])
        finally:
            d.close()
    assert same(got, built_here(plan[2:]))
    assert d.taken == 12 and d.queued == 0
