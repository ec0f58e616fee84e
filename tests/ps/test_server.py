"""Parameter servers as real processes (``python -m tidal.ps.server``, no master) and the worker's
client (tidal.ps.client.PSClient): the sync mode applies each step exactly once, in key order,
scaled by the step's samples; bad requests are refused with a clear error and the server keeps
serving; and the model does not depend on the number of servers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import zmq

from tidal.api import frames
from tidal.api.rpc import Caller, RemoteRefusedError
from tidal.master.servers import ShardMove, rebalanced
from tidal.ps.api import (
    PSAbortedError,
    PSError,
    PSUnavailableError,
    TableSpec,
    default_shard_map,
    initial_rows,
)
from tidal.ps.client import PSClient

TOKEN = "ps-secret-of-the-job"
SPECS = [TableSpec("emb", 2, optimizer="sgd", lr=0.5, init_scale=0.1),
         TableSpec("fixed", 3, num_ids=1000, optimizer="adagrad", lr=0.1)]
ONE = default_shard_map(64, 1)

Launch = Callable[[int], list[str]]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}  # no master: print the address
    return {**env, "TIDAL_TOKEN": TOKEN}


def _kill(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGCONT)  # a stopped server would not die of SIGKILL any later
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def _start(n: int, into: list[subprocess.Popen[str]]) -> list[str]:
    """Start ``n`` servers at once (they import torch in parallel), then read their addresses."""
    procs = []
    for _ in range(n):
        proc = subprocess.Popen([sys.executable, "-m", "tidal.ps.server"], env=_env(), stdout=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        into.append(proc)
        procs.append(proc)
    addresses = []
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("tidal-ps listening tcp://"), (line, proc.poll())
        addresses.append(line.split()[-1])
    return addresses


@pytest.fixture
def launch() -> Iterator[Launch]:
    """Starts fresh servers for one test; every one is killed (its process group) after it."""
    started: list[subprocess.Popen[str]] = []
    yield lambda n: _start(n, started)
    for proc in started:
        _kill(proc)


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """One server for the tests of refused requests (they never commit a step: it stays at -1)."""
    started: list[subprocess.Popen[str]] = []
    try:
        (address,) = _start(1, started)
        yield address, started[0]
    finally:
        for proc in started:
            _kill(proc)


@pytest.fixture
def client(shared: tuple[str, subprocess.Popen[str]]) -> Iterator[PSClient]:
    c = PSClient([shared[0]], ONE, TOKEN, SPECS, timeout_s=10)
    yield c
    c.close()


def connect(addresses: list[str], specs: list[TableSpec] = SPECS, **kw: Any) -> PSClient:
    return PSClient(addresses, default_shard_map(64, len(addresses)), TOKEN, specs, **kw)


def ids_of(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def raw(address: str, body: list[Any]) -> dict[str, Any]:
    """Send one multipart message through a DEALER of our own; the reply's meta."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(body)
        assert sock.poll(10_000), "the server did not answer"
        reply = frames.decode(sock.recv_multipart())
        assert reply.meta is not None
        return reply.meta
    finally:
        sock.close(0)
        ctx.term()


def still_serving(c: PSClient) -> None:
    (stats,) = c.stats()
    assert stats["applied_step"] == -1
    rows = c.pull({"emb": ids_of(1, 2)}, round_=0, step=0, key=None)
    assert torch.equal(rows["emb"], initial_rows(SPECS[0], ids_of(1, 2)))


def sgd_expected(spec: TableSpec, ids: torch.Tensor, grads: list[torch.Tensor], total: int) -> torch.Tensor:
    """The server's rule by hand: the contributions summed in the order given, times 1/total, one
    SGD step from the initial rows."""
    acc = torch.zeros(ids.numel(), spec.dim)
    for g in grads:
        acc += g
    acc.mul_(1.0 / total)
    return initial_rows(spec, ids).sub_(acc, alpha=spec.lr)


# ---------------------------------------------------------------------------- configuration
def test_hello_configures_the_server_and_others_must_agree(launch: Launch) -> None:
    (address,) = launch(1)
    reply = raw(address, frames.encode({}, meta={"op": "export", "table": "x", "token": TOKEN, "req": 3}))
    assert reply["ok"] is False and "before hello" in reply["error"] and reply["req"] == 3
    # stats answer before hello (the master settles a new server before any worker said hello)
    reply = raw(address, frames.encode({}, meta={"op": "stats", "token": TOKEN, "req": 5}))
    assert reply["ok"] is True and reply["rows"] == 0 and reply["specs"] == []
    with pytest.raises(PSError, match="list of 1 to 64 table specs"):
        connect([address], [])
    reply = raw(address, frames.encode({}, meta={"op": "hello", "token": TOKEN, "req": 4,
                                                 "tables": [{"name": "x", "dim": 2, "colour": 1}]}))
    assert reply["ok"] is False and "bad table spec" in reply["error"]

    first = connect([address])  # the server was left unconfigured: this hello configures it
    try:
        (stats,) = first.stats()
        assert stats["applied_step"] == -1 and stats["rows"] == 0
        assert sorted(stats["tables"]) == ["emb", "fixed"]
        second = connect([address])  # the same tables: fine
        second.close()
        with pytest.raises(PSError, match="other settings"):
            connect([address], [TableSpec("emb", 2, optimizer="sgd", lr=0.25, init_scale=0.1), SPECS[1]])
        with pytest.raises(PSError, match="other settings"):
            connect([address], SPECS[:1])
        (stats,) = first.stats()  # still serving the first configuration
        assert sorted(stats["tables"]) == ["emb", "fixed"]
    finally:
        first.close()


# ---------------------------------------------------------------------------- the step rule
# One server for these tests: each starts at the server's next step, in a round of its own (so
# that what a failed test left pending is never applied by another) and on ids of its own.
KEYED = TableSpec("k", 1, optimizer="sgd", lr=1.0, init_scale=0.0)
STEP_SPECS = [*SPECS, KEYED]
_rounds = iter(range(10, 10_000, 10))


@dataclass
class Stepper:
    c: PSClient
    address: str
    round: int  # this test's rounds are round and round + 1
    step: int  # the server's next step

    def rows(self, table: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The exported rows of ``ids`` (each must be stored)."""
        out = self.c.export()[table]
        where = torch.searchsorted(out["ids"], ids)
        assert torch.equal(out["ids"][where.clamp(max=len(out["ids"]) - 1)], ids), "rows not stored"
        return {name: value[where] for name, value in out.items()}

    def stored(self, table: str) -> int:
        return int(self.c.stats()[0]["tables"][table]["rows"])


@pytest.fixture(scope="module")
def stepping() -> Iterator[str]:
    started: list[subprocess.Popen[str]] = []
    try:
        (address,) = _start(1, started)
        yield address
    finally:
        for proc in started:
            _kill(proc)


@pytest.fixture
def stepper(stepping: str) -> Iterator[Stepper]:
    c = connect([stepping], STEP_SPECS)
    yield Stepper(c, stepping, next(_rounds), int(c.stats()[0]["applied_step"]) + 1)
    c.close()


def test_a_step_is_applied_exactly_once(stepper: Stepper) -> None:
    c, r, s, spec = stepper.c, stepper.round, stepper.step, SPECS[0]
    ids = ids_of(101, 105, 109)
    before = stepper.stored("emb")
    rows = c.pull({"emb": ids}, round_=r, step=s, key=0)["emb"]
    assert torch.equal(rows, initial_rows(spec, ids))
    g = torch.tensor([[1.0, -2.0], [0.5, 0.25], [-4.0, 3.0]])
    c.push({"emb": (ids, g)}, round_=r, step=s, key=0)
    assert stepper.stored("emb") == before  # nothing is stored before the commit
    want = sgd_expected(spec, ids, [g], total=2)

    c.commit(r, s, 2)
    c.commit(r, s, 2)  # sent twice
    (stats,) = c.stats()  # carries the watermark a third time
    assert stats["applied_step"] == s and stats["tables"]["emb"]["rows"] == before + 3
    assert torch.equal(stepper.rows("emb", ids)["weight"], want)

    # the next step's requests repeat the watermark: nothing moves
    after = c.pull({"emb": ids_of(101, 102)}, round_=r, step=s + 1, key=0)["emb"]
    assert torch.equal(after[0], want[0])
    assert torch.equal(after[1], initial_rows(spec, ids_of(102))[0])
    other = connect([stepper.address], STEP_SPECS)
    other.watermark = [r, s, 2]
    other.stats()
    other.close()
    assert torch.equal(stepper.rows("emb", ids)["weight"], want)
    # a late push of the applied step is refused, and applies nothing
    with pytest.raises(PSError, match=f"step {s} is not the next step: this server applied step {s}"):
        c.push({"emb": (ids, g)}, round_=r, step=s, key=1)
    assert torch.equal(stepper.rows("emb", ids)["weight"], want)
    assert stepper.stored("emb") == before + 3


def test_a_lost_commit_is_made_up_by_the_next_requests_watermark(stepper: Stepper) -> None:
    """The server applies the step before it serves the request that names it."""
    c, r, s, spec = stepper.c, stepper.round, stepper.step, SPECS[0]
    ids = ids_of(203, 204)
    c.pull({"emb": ids}, round_=r, step=s, key=0)
    g = torch.tensor([[2.0, 2.0], [-1.0, 0.5]])
    c.push({"emb": (ids, g)}, round_=r, step=s, key=0)
    c.watermark = [r, s, 4]  # as if the commit had been lost
    rows = c.pull({"emb": ids}, round_=r, step=s + 1, key=0)["emb"]
    assert torch.equal(rows, sgd_expected(spec, ids, [g], total=4))


def test_contributions_of_an_aborted_round_are_dropped(stepper: Stepper) -> None:
    c, r, s, spec = stepper.c, stepper.round, stepper.step, SPECS[0]
    before = stepper.stored("emb")
    # round r breaks before its all-reduce: its pushes are never named by a watermark
    c.pull({"emb": ids_of(301, 302)}, round_=r, step=s, key=0)
    c.push({"emb": (ids_of(301, 302), torch.full((2, 2), 100.0))}, round_=r, step=s, key=0)
    c.pull({"emb": ids_of(307)}, round_=r, step=s, key=1)
    c.push({"emb": (ids_of(307), torch.full((1, 2), 100.0))}, round_=r, step=s, key=1)
    # round r + 1 trains step s again
    ids = ids_of(302, 303)
    c.pull({"emb": ids}, round_=r + 1, step=s, key=0)
    g = torch.tensor([[1.0, 0.0], [0.0, -1.0]])
    c.push({"emb": (ids, g)}, round_=r + 1, step=s, key=0)
    c.commit(r + 1, s, 3)
    assert stepper.stored("emb") == before + 2  # rows 301 and 307 were never created
    assert torch.equal(stepper.rows("emb", ids)["weight"], sgd_expected(spec, ids, [g], total=3))
    # the dropped contributions do not stand in the way of the next step
    c.pull({"emb": ids_of(301)}, round_=r + 1, step=s + 1, key=0)
    c.push({"emb": (ids_of(301), torch.ones(1, 2))}, round_=r + 1, step=s + 1, key=0)
    c.commit(r + 1, s + 1, 1)
    (stats,) = c.stats()
    assert stats["applied_step"] == s + 1 and stats["tables"]["emb"]["rows"] == before + 3


def test_contributions_are_summed_in_key_order_and_scaled_by_the_total(stepper: Stepper) -> None:
    c, r, s = stepper.c, stepper.round, stepper.step
    # float32 addition is not associative: 5 + 1e8 - 1e8 is 8 in key order, 5 in push order
    by_key = {0: 5.0, 1: 1e8, 2: -1e8}
    ids = ids_of(410, 420)
    for key in (2, 1, 0):  # pushed in the reverse of the key order
        c.pull({"k": ids}, round_=r, step=s, key=key)
        g = torch.tensor([[by_key[key]], [float(key + 1)]])
        c.push({"k": (ids, g)}, round_=r, step=s, key=key)
    c.commit(r, s, 4)
    got = stepper.rows("k", ids)["weight"]
    in_key_order = [torch.tensor([[by_key[k]], [float(k + 1)]]) for k in (0, 1, 2)]
    want = sgd_expected(KEYED, ids, in_key_order, total=4)
    assert torch.equal(got, want)
    assert got.flatten().tolist() == [-2.0, -1.5]  # -(8 / 4), -((1 + 2 + 3) / 4)
    assert not torch.equal(want, sgd_expected(KEYED, ids, in_key_order[::-1], total=4))


def test_keys_that_push_different_tables_and_overlapping_rows(stepper: Stepper) -> None:
    c, r, s = stepper.c, stepper.round, stepper.step
    emb, fixed = SPECS
    c.pull({"emb": ids_of(501, 502), "fixed": ids_of(999)}, round_=r, step=s, key=0)
    g_fixed = torch.full((1, 3), 2.0)
    c.push({"emb": (ids_of(501, 502), torch.ones(2, 2)), "fixed": (ids_of(999), g_fixed)}, round_=r, step=s, key=0)
    c.pull({"emb": ids_of(502, 503)}, round_=r, step=s, key=1)
    c.push({"emb": (ids_of(502, 503), torch.tensor([[0.5, 0.5], [3.0, 3.0]]))}, round_=r, step=s, key=1)
    c.commit(r, s, 2)
    want = sgd_expected(emb, ids_of(501, 502, 503), [torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]),
                                                     torch.tensor([[0.0, 0.0], [0.5, 0.5], [3.0, 3.0]])], total=2)
    assert torch.equal(stepper.rows("emb", ids_of(501, 502, 503))["weight"], want)
    got = stepper.rows("fixed", ids_of(999))
    # adagrad's first step from a zero accumulator: w - lr * g / (|g| + eps)
    torch.testing.assert_close(got["weight"], initial_rows(fixed, ids_of(999)) - fixed.lr)
    assert torch.equal(got["sum"], torch.ones(1, 3))  # (2 / 2) ** 2


# ---------------------------------------------------------------------------- refused requests
def test_an_unknown_table_is_refused(client: PSClient) -> None:
    with pytest.raises(PSError, match="unknown table 'nope'"):
        client.pull({"nope": ids_of(1)}, round_=0, step=0, key=10)
    with pytest.raises(PSError, match="unknown table 'nope'"):
        client.push({"nope": (ids_of(1), torch.ones(1, 2))}, round_=0, step=0, key=10)
    still_serving(client)


def test_int32_ids_are_refused_by_the_server(shared: tuple[str, subprocess.Popen[str]], client: PSClient) -> None:
    meta = {"op": "pull", "token": TOKEN, "req": 11, "round": 0, "step": 0, "key": 11, "commit": None}
    reply = raw(shared[0], frames.encode({"emb.ids": torch.tensor([1, 2], dtype=torch.int32)}, meta=meta))
    assert reply["ok"] is False and reply["req"] == 11
    assert "ids must be a 1-d int64 tensor, got torch.int32" in reply["error"]
    still_serving(client)


def test_int32_ids_are_a_ps_error_on_the_client(client: PSClient) -> None:
    for ids in (torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([1, 2, 3, 4], dtype=torch.int32),
                torch.tensor([[1, 2]])):
        with pytest.raises(PSError, match="1-d int64"):
            client.pull({"emb": ids}, round_=0, step=0, key=12)
        with pytest.raises(PSError, match="1-d int64"):
            client.push({"emb": (ids, torch.zeros(ids.numel(), 4))}, round_=0, step=0, key=12)


def test_unsorted_or_repeated_pull_ids_are_refused(client: PSClient) -> None:
    with pytest.raises(PSError, match="pulled ids must be sorted and unique"):
        client.pull({"emb": ids_of(5, 1, 9)}, round_=0, step=0, key=13)
    with pytest.raises(PSError, match="pulled ids must be sorted and unique"):
        client.pull({"emb": ids_of(1, 1)}, round_=0, step=0, key=13)
    still_serving(client)


def test_ids_out_of_a_fixed_tables_range_are_refused(client: PSClient) -> None:
    with pytest.raises(PSError, match=r"id 1000 is out of range \[0, 1000\)"):
        client.pull({"fixed": ids_of(3, 1000)}, round_=0, step=0, key=14)
    with pytest.raises(PSError, match="id -2 is out of range"):
        client.pull({"fixed": ids_of(-2, 3)}, round_=0, step=0, key=14)
    still_serving(client)


def test_gradients_of_the_wrong_shape_or_dtype_or_not_finite_are_refused(client: PSClient) -> None:
    ids = ids_of(1, 2)
    client.pull({"emb": ids}, round_=0, step=0, key=15)
    bad = {"shape": torch.ones(2, 3), "dtype": torch.ones(2, 2, dtype=torch.float64),
           "nan": torch.tensor([[0.0, float("nan")], [1.0, 1.0]]),
           "inf": torch.tensor([[0.0, 1.0], [float("-inf"), 1.0]])}
    for what, grad in bad.items():
        message = "holds NaN or infinity" if what in ("nan", "inf") else r"grad must be float32 \[2, 2\]"
        with pytest.raises(PSError, match=message):
            client.push({"emb": (ids, grad)}, round_=0, step=0, key=15)
    still_serving(client)


def test_a_push_of_rows_not_pulled_in_the_step_is_refused(client: PSClient) -> None:
    client.pull({"emb": ids_of(1, 2)}, round_=0, step=0, key=16)
    with pytest.raises(PSError, match=r"rows not pulled at step 0 \(round 0, key 16\)"):
        client.push({"emb": (ids_of(2, 3), torch.ones(2, 2))}, round_=0, step=0, key=16)
    with pytest.raises(PSError, match="rows not pulled"):  # another key pulled them, not this one
        client.push({"emb": (ids_of(1), torch.ones(1, 2))}, round_=0, step=0, key=17)
    with pytest.raises(PSError, match="rows not pulled"):  # another round
        client.push({"emb": (ids_of(1), torch.ones(1, 2))}, round_=1, step=0, key=16)
    with pytest.raises(PSError, match="rows not pulled"):  # a table this key did not pull
        client.push({"fixed": (ids_of(1), torch.ones(1, 3))}, round_=0, step=0, key=16)
    client.pull({"emb": ids_of(4)}, round_=0, step=0, key=None)  # a read outside the step: untracked
    with pytest.raises(PSError, match="rows not pulled"):
        client.push({"emb": (ids_of(4), torch.ones(1, 2))}, round_=0, step=0, key=16)
    client.push({"emb": (ids_of(2), torch.ones(1, 2))}, round_=0, step=0, key=16)  # pulled: fine
    still_serving(client)


def test_a_step_that_is_not_the_next_is_refused(client: PSClient) -> None:
    with pytest.raises(PSError, match="step 5 is not the next step: this server applied step -1"):
        client.push({"emb": (ids_of(1), torch.ones(1, 2))}, round_=0, step=5, key=18)
    with pytest.raises(PSError, match="step 5 is not the next step"):
        client.pull({"emb": ids_of(1)}, round_=0, step=5, key=18)
    still_serving(client)


def test_a_request_with_a_wrong_token_is_refused(shared: tuple[str, subprocess.Popen[str]],
                                                 client: PSClient) -> None:
    for token in ("wrong", "", None):
        meta = {"op": "stats", "token": token, "req": 21}
        reply = raw(shared[0], frames.encode({}, meta=meta))
        assert reply["ok"] is False and reply["req"] == 21
        assert "token" in reply["error"]
    # nor does a hello with a wrong token get to configure anything
    reply = raw(shared[0], frames.encode({}, meta={"op": "hello", "token": "wrong", "req": 22,
                                                   "tables": [s.to_json() for s in SPECS]}))
    assert reply["ok"] is False
    with pytest.raises(PSError, match="token"):
        PSClient([shared[0]], ONE, "wrong", SPECS, timeout_s=10)
    still_serving(client)


def test_a_message_whose_header_does_not_match_its_buffers_is_refused(
        shared: tuple[str, subprocess.Popen[str]], client: PSClient) -> None:
    meta = {"op": "pull", "token": TOKEN, "req": 31, "round": 0, "step": 0, "key": 19, "commit": None}
    header = json.dumps({"v": 1, "step": None, "keys": ["emb.ids"], "dtype": ["int64"], "shape": [[4]],
                         "meta": meta}).encode()
    reply = raw(shared[0], [header, torch.arange(1).numpy().tobytes()])  # 8 bytes, not 32
    assert reply["ok"] is False and reply["req"] == 31
    assert "needs 32 bytes, its buffer holds 8" in reply["error"]
    # a header that is not JSON at all: refused, no request id to echo
    reply = raw(shared[0], [b"{not json", b"x"])
    assert reply["ok"] is False and reply["req"] is None and "not UTF-8 JSON" in reply["error"]
    # tensors that are not a table's ids
    reply = raw(shared[0], frames.encode({"emb.rows": torch.zeros(1, 2)}, meta={**meta, "req": 32}))
    assert reply["ok"] is False and "expected the tensors" in reply["error"]
    still_serving(client)


def test_a_server_that_does_not_answer_is_unavailable(shared: tuple[str, subprocess.Popen[str]]) -> None:
    c = PSClient([shared[0]], ONE, TOKEN, SPECS, timeout_s=1)
    try:
        os.kill(shared[1].pid, signal.SIGSTOP)
        try:
            with pytest.raises(PSUnavailableError, match=r"parameter server 0 \(tcp://.*\) did not answer within 1 s"):
                c.pull({"emb": ids_of(1)}, round_=0, step=0, key=None)
        finally:
            os.kill(shared[1].pid, signal.SIGCONT)
        c.timeout_s = 10
        still_serving(c)  # the late answer to the request that timed out is skipped
    finally:
        c.close()


# ---------------------------------------------------------------------------- server count
def train_steps(c: PSClient) -> None:
    """A fixed sequence of steps of two keys each, an aborted round among them."""
    gen = torch.Generator().manual_seed(7)
    dims = {s.name: s.dim for s in MIXED}
    round_ = 0
    for step in range(4):
        if step == 2:  # round 0 breaks during step 2: it is trained again in round 1
            ids = torch.unique(torch.randint(0, 300, (20,), generator=gen))
            c.pull({"a": ids}, round_=0, step=2, key=0)
            c.push({"a": (ids, torch.randn(ids.numel(), 3, generator=gen))}, round_=0, step=2, key=0)
            round_ = 1
        total = 0
        for key in range(2):
            ids = {name: torch.unique(torch.randint(0, 300, (40,), generator=gen)) for name in dims}
            c.pull(ids, round_=round_, step=step, key=key)
            grads = {name: (t, torch.randn(t.numel(), dims[name], generator=gen)) for name, t in ids.items()}
            c.push(grads, round_=round_, step=step, key=key)
            total += 40
        c.commit(round_, step, total)


MIXED = [TableSpec("a", 3, optimizer="adam", lr=0.05), TableSpec("b", 2, num_ids=300, optimizer="adagrad"),
         TableSpec("c", 4, optimizer="sgd", lr=0.2)]


def test_the_model_does_not_depend_on_the_number_of_servers(launch: Launch) -> None:
    addresses = launch(3)
    one, two = connect(addresses[:1], MIXED), connect(addresses[1:], MIXED)
    try:
        train_steps(one)
        train_steps(two)
        by_one, by_two = one.export(), two.export()
        assert sorted(by_one) == ["a", "b", "c"]
        for name, fields in by_one.items():
            assert set(by_two[name]) == set(fields)
            assert bool((fields["ids"][1:] > fields["ids"][:-1]).all())
            for field, value in fields.items():
                assert torch.equal(by_two[name][field], value), (name, field)
        rows = [s["rows"] for s in two.stats()]
        assert min(rows) > 0 and sum(rows) == one.stats()[0]["rows"]  # both servers hold rows
        assert [s["applied_step"] for s in two.stats()] == [3, 3]
        assert int(by_one["a"]["steps"].max()) >= 2  # rows trained in several steps
    finally:
        one.close()
        two.close()


# ---------------------------------------------------------------------------- moving shards
def test_rebalanced_moves_few_shards_and_balances() -> None:
    one = [0] * 64
    three = rebalanced(one, [0, 1, 2])
    assert sorted(Counter(three).values()) == [21, 21, 22]
    assert sum(a != b for a, b in zip(one, three, strict=True)) == 64 - 22  # server 0 keeps the most
    two = rebalanced(three, [0, 2])
    assert sorted(Counter(two).values()) == [32, 32]
    # only server 1's shards (and what evens the two out) move
    assert sum(a != b for a, b in zip(three, two, strict=True)) == 21
    assert rebalanced(two, [0, 2]) == two
    with pytest.raises(ValueError):
        rebalanced(one, [])


def move(old: list[int], new: list[int], addresses: dict[int, str], watermark: list[int] | None) -> ShardMove:
    m = ShardMove(old, new, addresses, TOKEN, watermark)
    m.start()
    assert m.done.wait(60)
    assert m.error is None, m.error
    m.finish()
    return m


def positions(shard_map: list[int]) -> tuple[list[int], list[int]]:
    servers = sorted(set(shard_map))
    return servers, [servers.index(i) for i in shard_map]


def test_shards_moved_between_servers_change_no_number_of_the_model(launch: Launch) -> None:
    """The master's move (tidal.master.servers.ShardMove) between real servers: the steps of
    train_steps on 1 server, then on 3 (after a move 1 -> 3), then on 2 (3 -> 2, one server
    emptied), train the same rows as all of them on one server that never moved."""
    addresses = launch(4)
    ref = connect(addresses[3:], MIXED)
    gen = torch.Generator().manual_seed(11)
    maps = [[0] * 64]
    maps.append(rebalanced(maps[0], [0, 1, 2]))
    maps.append(rebalanced(maps[1], [0, 2]))
    by_id = dict(enumerate(addresses[:3]))
    try:
        step, moved = 0, 0
        for phase, shard_map in enumerate(maps):
            if phase:
                m = move(maps[phase - 1], shard_map, by_id, [0, step - 1, 80])
                moved += m.rows
            servers, where = positions(shard_map)
            c = connect([by_id[i] for i in servers], MIXED)
            c.shard_map = torch.tensor(where)
            try:
                for _ in range(2):
                    for client in (c, ref):
                        client.watermark = [0, step - 1, 80] if step else None
                        gen_state = gen.get_state()
                        for key in range(2):
                            ids = {s.name: torch.unique(torch.randint(0, 300, (40,), generator=gen)) for s in MIXED}
                            client.pull(ids, round_=0, step=step, key=key)
                            client.push({s.name: (ids[s.name], torch.randn(ids[s.name].numel(), s.dim, generator=gen))
                                         for s in MIXED}, round_=0, step=step, key=key)
                        if client is c:
                            gen.set_state(gen_state)
                    c.commit(0, step, 80)
                    ref.commit(0, step, 80)
                    step += 1
                if phase == len(maps) - 1:
                    got, want = c.export(), ref.export()
                    for name, fields in want.items():
                        for field, value in fields.items():
                            assert torch.equal(got[name][field], value), (name, field)
                    stats = c.stats()
                    assert all(s["rows"] > 0 and s["applied_step"] == step - 1 for s in stats)
            finally:
                c.close()
        assert moved > 0
        # the emptied server 1 dropped what it handed over (finish runs in a thread)
        with Caller(by_id[1], TOKEN) as one:
            deadline = time.monotonic() + 10
            while one.call({"op": "stats"}).meta["rows"] and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        ref.close()


def test_a_move_refuses_a_server_not_at_the_committed_step(launch: Launch) -> None:
    addresses = launch(2)
    c = connect(addresses[:1], MIXED)
    try:
        ids = torch.arange(10)
        c.pull({"a": ids}, round_=0, step=0, key=0)
        c.push({"a": (ids, torch.ones(10, 3))}, round_=0, step=0, key=0)
        m = ShardMove([0] * 64, rebalanced([0] * 64, [0, 1]), dict(enumerate(addresses)), TOKEN, [0, 1, 10])
        m.start()
        assert m.done.wait(60)
        assert m.error is not None and "skips step 0" in m.error, m.error  # its step 0 was never committed
        c.commit(0, 0, 10)
        c.commit(0, 1, 10)  # the server now applied step 1; a move at step 0 finds it ahead
        # commits are not answered: a request on the same socket is served after them, while
        # the move's own socket could overtake them
        assert c.stats()[0]["applied_step"] == 1
        m = ShardMove([0] * 64, rebalanced([0] * 64, [0, 1]), dict(enumerate(addresses)), TOKEN, [0, 0, 10])
        m.start()
        assert m.done.wait(60)
        assert m.error is not None and "is at step 1, the job committed step 0" in m.error, m.error
        # the load message is checked like any other: rows outside the shards named are refused
        with Caller(addresses[1], TOKEN) as other:
            other.call({"op": "hello", "tables": [s.to_json() for s in MIXED]})
            with pytest.raises(RemoteRefusedError, match="outside the virtual shards"):
                part = {"ids": torch.arange(50, dtype=torch.int64), "weight": torch.zeros(50, 3),
                        "exp_avg": torch.zeros(50, 3), "exp_avg_sq": torch.zeros(50, 3),
                        "steps": torch.zeros(50, dtype=torch.int64)}
                other.call({"op": "load", "table": "a", "shards": [0], "num_shards": 64}, part)
            with pytest.raises(RemoteRefusedError, match="need the tensors"):
                other.call({"op": "load", "table": "a", "shards": [0], "num_shards": 64}, {"ids": part["ids"]})
    finally:
        c.close()


# ---------------------------------------------------------------------------- restore from a checkpoint
def test_a_lost_server_is_restored_from_a_checkpoint_on_any_map(launch: Launch) -> None:
    """Two servers train, the tables are exported at step 1 (a checkpoint), training goes on,
    one server is SIGKILLed: a fresh server and the survivor, under another shard map, go back
    to exactly the checkpoint's rows and step, and accept step 2 again (not step 4)."""
    started: list[subprocess.Popen[str]] = []
    try:
        a, b = _start(2, started)
        c = connect([a, b], MIXED)
        try:
            gen = torch.Generator().manual_seed(3)
            for step in range(4):
                ids = {s.name: torch.unique(torch.randint(0, 300, (40,), generator=gen)) for s in MIXED}
                c.pull(ids, round_=0, step=step, key=0)
                c.push({s.name: (ids[s.name], torch.randn(ids[s.name].numel(), s.dim, generator=gen)) for s in MIXED},
                       round_=0, step=step, key=0)
                c.commit(0, step, 40)
                if step == 1:
                    snapshot = c.export()
            later = c.export()
        finally:
            c.close()
        _kill(started[1])
        (fresh,) = launch(1)
        shard_map = [1 if v % 4 else 0 for v in range(64)]  # another map: most shards on the new server
        r = PSClient([a, fresh], shard_map, TOKEN, MIXED, timeout_s=30)
        try:
            assert len(later["a"]["ids"]) > len(snapshot["a"]["ids"])  # trained on after the checkpoint
            loaded = r.restore(snapshot, 1)
            assert loaded == sum(len(t["ids"]) for t in snapshot.values())
            assert [s["applied_step"] for s in r.stats()] == [1, 1]
            back = r.export()
            for name, fields in snapshot.items():
                for field, value in fields.items():
                    assert torch.equal(back[name][field], value), (name, field)
            with pytest.raises(PSError, match="step 4 is not the next step: this server applied step 1"):
                r.pull({"a": ids_of(1)}, round_=1, step=4, key=0)
            r.pull({"a": ids_of(1)}, round_=1, step=2, key=0)  # step 2 comes again
            with pytest.raises(PSError, match=r"tables \['zz'\] this script does not declare"):
                r.restore({"zz": snapshot["a"]}, 1)
            r.restore({}, -1)  # a job resumed from scratch: empty tables at step -1
            assert [(s["applied_step"], s["rows"]) for s in r.stats()] == [(-1, 0), (-1, 0)]
        finally:
            r.close()
    finally:
        for proc in started:
            _kill(proc)


def test_a_wait_for_a_lost_server_is_given_up_when_the_job_re_forms() -> None:
    """A server that stops answering holds a pull only until ``abort`` says the job re-forms
    (not the whole timeout); the step is then dropped by the worker (PSAbortedError)."""
    started: list[subprocess.Popen[str]] = []
    try:
        (address,) = _start(1, started)
        reforming = [False]
        c = PSClient([address], ONE, TOKEN, SPECS, timeout_s=60, abort=lambda: reforming[0])
        try:
            os.kill(started[0].pid, signal.SIGSTOP)
            reforming[0] = True
            t0 = time.monotonic()
            with pytest.raises(PSAbortedError, match=r"parameter server 0 \(tcp://.*\): the job is re-forming"):
                c.pull({"emb": ids_of(1)}, round_=0, step=0, key=0)
            assert time.monotonic() - t0 < 2.0
        finally:
            c.close()
    finally:
        for proc in started:
            _kill(proc)


# ---------------------------------------------------------------------------- async mode
def test_an_async_push_is_applied_on_arrival_and_a_refusal_surfaces(launch: Launch) -> None:
    """Async mode (Kale Eq. 8): each push is one optimizer step with its own gradient, visible to
    the next pull of the same step, with no watermark; the worker does not wait for the answer,
    and a refused async push raises at ``flush`` (never a silent wrong update)."""
    (address,) = launch(1)
    spec = SPECS[0]  # sgd, lr 0.5
    c = PSClient([address], ONE, TOKEN, SPECS, timeout_s=30)
    try:
        ids = ids_of(3, 9)
        start = c.pull({"emb": ids}, round_=0, step=0, key=0)["emb"]
        c.pull({"emb": ids}, round_=0, step=0, key=1)
        c.pull({"emb": ids}, round_=0, step=0, key=2)
        g0, g1 = torch.full((2, 2), 0.25), torch.full((2, 2), -1.0)
        c.push({"emb": (ids, g0)}, round_=0, step=0, key=0, asynchronous=True)
        c.push({"emb": (ids, g1)}, round_=0, step=0, key=1, asynchronous=True)
        c.flush()
        seen = c.pull({"emb": ids}, round_=0, step=0, key=None)["emb"]  # before any commit
        assert torch.allclose(seen, start - spec.lr * g0 - spec.lr * g1)
        c.commit(0, 0, 6)
        assert c.stats()[0]["applied_step"] == 0
        assert torch.equal(c.pull({"emb": ids}, round_=0, step=1, key=None)["emb"], seen)  # nothing applied twice
        # a push of the step just committed (another worker committed it first) is applied too
        c.push({"emb": (ids, g0)}, round_=0, step=0, key=2, asynchronous=True)
        c.flush()
        seen = c.pull({"emb": ids}, round_=0, step=1, key=None)["emb"]
        assert torch.allclose(seen, start - spec.lr * (2 * g0 + g1))
        # a push of rows not pulled, sent asynchronously: the next call reports the refusal
        c.push({"emb": (ids_of(77), torch.zeros(1, 2))}, round_=0, step=1, key=0, asynchronous=True)
        with pytest.raises(PSError, match="a push for rows not pulled at step 1"):
            c.flush()
        still = c.pull({"emb": ids}, round_=0, step=1, key=None)["emb"]
        assert torch.equal(still, seen)
    finally:
        c.close()
