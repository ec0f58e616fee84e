"""The rendezvous store: the pure map's limits and garbage collection, then a real ``tidal run``
master on 127.0.0.1 serving it (token, sizes, prefixes, bounded memory, no wildcard listener),
and real gloo process groups formed through it."""

from __future__ import annotations

import base64
import datetime
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.test_control_plane import Master, start_master, stop_master
from tidal.api import MAX_STORE_KEY_CHARS, MAX_STORE_VALUE_BYTES
from tidal.master.api import MasterError, StaleRoundMasterError
from tidal.master.store import (
    ENTRY_OVERHEAD_BYTES,
    RoundStore,
    StoreFullError,
    StoreKeyError,
    StoreLimits,
    StoreStaleRoundError,
    StoreValueError,
    StoreValueTooLargeError,
)

ROUTES = ["set", "get", "add", "compare_set", "check", "wait", "delete", "num_keys"]


def key(r: int, name: str = "k", job: str = "j") -> str:
    return f"tidal/{job}/round{r}/{name}"


# ----------------------------------------------------------------------------- the pure store
def test_c10d_operations() -> None:
    s = RoundStore("j")
    s.observe_round(0)
    assert s.get(key(0)) is None
    s.set(key(0), b"v")
    assert s.get(key(0)) == b"v"
    assert s.add(key(0, "n"), 5) == 5
    assert s.add(key(0, "n"), -7) == -2
    assert s.get(key(0, "n")) == b"-2"  # counters are decimal ASCII, as in c10d
    assert s.check([key(0), key(0, "n")])
    assert not s.check([key(0), key(0, "absent")])
    assert s.num_keys("tidal/j/round0/") == 2
    assert s.delete(key(0))
    assert not s.delete(key(0))
    assert s.num_keys("tidal/j/round0/") == 1


def test_compare_set_follows_tcpstore() -> None:
    s = RoundStore("j")
    s.observe_round(0)
    assert s.compare_set(key(0), b"x", b"new") == b"x"  # absent, expected non-empty: not set
    assert s.get(key(0)) is None
    assert s.compare_set(key(0), b"", b"first") == b"first"  # absent, expected empty: set
    assert s.compare_set(key(0), b"other", b"second") == b"first"  # mismatch: unchanged
    assert s.compare_set(key(0), b"first", b"second") == b"second"
    assert s.get(key(0)) == b"second"


@pytest.mark.parametrize("bad", [
    "other/key",
    "tidal/otherjob/round0/k",
    "tidal/j/round0",  # no slash after the round
    "tidal/j/round/k",
    "tidal/j/round-1/k",
    "tidal/j/round01/k",
    "tidal/j/round+1/k",
    "tidal/j/round\u0661/k",  # an Arabic-Indic digit one
    "tidal/j/round0/\u00e9",
    "tidal/j/round0/" + "x" * MAX_STORE_KEY_CHARS,
])
def test_keys_outside_the_round_prefix_are_400(bad: str) -> None:
    s = RoundStore("j")
    s.observe_round(0)
    with pytest.raises(StoreKeyError) as err:
        s.set(bad, b"v")
    assert err.value.status == 400
    assert s.key_count == 0


def test_only_rounds_next_to_the_current_one_are_open() -> None:
    s = RoundStore("j")
    s.observe_round(5)
    for r in (4, 5, 6):
        s.set(key(r), b"v")
    for r in (0, 3, 7, 10**17):
        with pytest.raises(StoreStaleRoundError) as err:
            s.set(key(r), b"v")
        assert err.value.status == 409
        assert isinstance(err.value, StaleRoundMasterError)
    with pytest.raises(StoreStaleRoundError):
        s.get(key(3))


def test_limits_give_clear_errors_and_leave_the_store_as_it_was() -> None:
    limits = StoreLimits(max_value_bytes=100, max_total_bytes=1000, max_keys=5)
    s = RoundStore("j", limits)
    s.observe_round(0)
    with pytest.raises(StoreValueTooLargeError) as too_large:
        s.set(key(0), b"x" * 101)
    assert too_large.value.status == 413
    with pytest.raises(StoreValueTooLargeError):
        s.compare_set(key(0), b"", b"x" * 101)
    s.set(key(0), b"x" * 100)
    assert s.total_bytes == len(key(0)) + 100 + ENTRY_OVERHEAD_BYTES
    s.set(key(0), b"y" * 100)  # an overwrite costs nothing more
    assert (s.key_count, s.total_bytes) == (1, len(key(0)) + 100 + ENTRY_OVERHEAD_BYTES)
    written = 1
    with pytest.raises(StoreFullError) as full:
        for i in range(100):
            s.set(key(0, f"k{i}"), b"z" * 100)
            written += 1
    assert full.value.status == 507
    assert s.total_bytes <= 1000 and s.key_count == written
    before = (s.key_count, s.total_bytes)
    with pytest.raises(StoreFullError):
        s.add(key(0, "counter"), 1)
    assert (s.key_count, s.total_bytes) == before
    assert s.delete(key(0))
    s.add(key(0, "counter"), 1)  # space came back

    few = RoundStore("j", StoreLimits(max_keys=3))
    few.observe_round(0)
    for i in range(3):
        few.set(key(0, str(i)), b"")
    with pytest.raises(StoreFullError, match="3 keys"):
        few.set(key(0, "3"), b"")


def test_add_needs_an_integer_and_stays_in_int64() -> None:
    s = RoundStore("j")
    s.observe_round(0)
    for text in (b"abc", b"1_000", b" 1", b"1.5", b""):
        s.set(key(0), text)
        with pytest.raises(StoreValueError):
            s.add(key(0), 1)
    s.set(key(0), str(2**63 - 1).encode())
    with pytest.raises(StoreValueError, match="int64"):
        s.add(key(0), 1)
    assert isinstance(StoreValueError("x"), MasterError)


def test_memory_stays_flat_over_thousands_of_rounds() -> None:
    s = RoundStore("j")
    peak = 0
    for r in range(5000):
        s.observe_round(r)  # the master closed round r; its members form the group
        for rank in range(4):
            s.set(key(r, f"0/{rank}"), b"a" * 200)
        s.add(key(r, "barrier"), 4)
        peak = max(peak, s.total_bytes)
        assert len(s.rounds) <= 2  # r - 1 and r: older rounds were dropped whole
    last = 4999  # the longest keys
    one_round = (4 * (len(key(last, "0/0")) + 200 + ENTRY_OVERHEAD_BYTES)
                 + len(key(last, "barrier")) + 1 + ENTRY_OVERHEAD_BYTES)
    assert peak <= 2 * one_round
    assert s.rounds == [4998, 4999]
    assert s.key_count == 10


# ----------------------------------------------------------------------------- a real master
def job_id(m: Master) -> str:
    return str(json.loads((m.job_dir / "job.json").read_text())["job_id"])


def round0(m: Master, name: str) -> str:
    """Before any round has formed the master is at round -1, so round 0's keys are open."""
    return f"tidal/{job_id(m)}/round0/{name}"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize("route", ROUTES)
def test_every_store_route_needs_the_token(master: Master, route: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {master.token}x"}):
        r = httpx.post(f"{master.url}/v1/store/{route}", headers=headers,
                       json={"key": round0(master, "x"), "value": b64(b"v")}, timeout=10)
        assert r.status_code == 401, (route, headers, r.text)


def test_set_get_over_http_and_the_long_poll(master: Master) -> None:
    k = round0(master, "http")
    with master.client() as c:
        assert c.post("/v1/store/set", json={"key": k, "value": b64(b"\x00\xffbytes")}).status_code == 200
        r = c.post("/v1/store/get", json={"key": k})
        assert r.json() == {"found": True, "value": b64(b"\x00\xffbytes")}
        assert c.post("/v1/store/add", json={"key": k + "n", "amount": 3}).json() == {"value": 3}
        assert c.post("/v1/store/check", json={"keys": [k, k + "n"]}).json() == {"ready": True}
        assert c.post("/v1/store/num_keys", json={"prefix": k}).json() == {"count": 2}

        start = time.monotonic()
        r = c.post("/v1/store/get", json={"key": k + "later", "wait_s": 0.3})
        assert r.json() == {"found": False, "value": ""}
        assert 0.25 <= time.monotonic() - start < 2

        late = threading.Timer(0.2, lambda: httpx.post(f"{master.url}/v1/store/set", headers=master.auth, timeout=10,
                                                       json={"key": k + "later", "value": b64(b"now")}))
        late.start()
        start = time.monotonic()
        r = c.post("/v1/store/wait", json={"keys": [k + "later"], "wait_s": 1.0})
        waited = time.monotonic() - start
        late.join()
        assert r.json() == {"ready": True}
        assert 0.1 < waited < 0.8  # woken by the write, not by the end of the poll

        for body in ({"key": k, "value": "not base64!"}, {"key": k, "value": b64(b"v"), "extra": 1},
                     {"key": "", "value": ""}, {"key": k, "value": 5}):
            assert c.post("/v1/store/set", json=body).status_code in (400, 422), body
        assert c.post("/v1/store/get", json={"key": k, "wait_s": 5}).status_code == 422  # at most a second


def test_an_oversized_value_is_413(master: Master) -> None:
    k = round0(master, "big")
    with master.client(timeout=30) as c:
        for size in (MAX_STORE_VALUE_BYTES + 1, MAX_STORE_VALUE_BYTES + 4096):
            r = c.post("/v1/store/set", json={"key": k, "value": b64(b"x" * size)})
            assert r.status_code == 413, r.text
        r = c.post("/v1/store/compare_set", json={"key": k, "expected": "", "desired": b64(b"x" * (MAX_STORE_VALUE_BYTES + 1))})
        assert r.status_code == 413
        assert c.post("/v1/store/set", json={"key": k, "value": b64(b"x" * MAX_STORE_VALUE_BYTES)}).status_code == 200
        assert c.post("/v1/store/delete", json={"key": k}).json() == {"deleted": True}


def test_keys_outside_the_round_prefix_are_refused(master: Master) -> None:
    with master.client() as c:
        for bad in ("tidal/otherjob/round0/k", "k", "tidal/", f"tidal/{job_id(master)}/round0",
                    f"tidal/{job_id(master)}/roundx/k"):
            r = c.post("/v1/store/set", json={"key": bad, "value": ""})
            assert r.status_code == 400, (bad, r.text)
        stale = f"tidal/{job_id(master)}/round7/k"  # the master is at round -1
        assert c.post("/v1/store/set", json={"key": stale, "value": ""}).status_code == 409
        assert c.post("/v1/store/get", json={"key": stale, "wait_s": 0.5}).status_code == 409


def test_a_400_mib_flood_leaves_the_master_bounded(tmp_path: Path) -> None:
    m = start_master(tmp_path / "flood", "1:1")  # its own master: the flood fills the store
    try:
        proc = psutil.Process(m.proc.pid)
        before = proc.memory_info().rss
        chunk = b64(b"\xab" * MAX_STORE_VALUE_BYTES)
        statuses: dict[int, int] = {}
        deadline = time.monotonic() + 90
        with m.client(timeout=30) as c:
            for i in range(100):  # 100 x 4 MiB
                if time.monotonic() > deadline:
                    break
                r = c.post("/v1/store/set", json={"key": round0(m, f"flood/{i}"), "value": chunk})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        grown = proc.memory_info().rss - before
        assert sum(statuses.values()) >= 50, statuses  # the loop really tried
        assert set(statuses) == {200, 507}, statuses
        assert statuses[200] <= (64 << 20) // MAX_STORE_VALUE_BYTES
        # what the store may hold (64 MiB) plus the parse buffers of a request or two
        assert grown < (64 + 48) << 20, f"the master grew by {grown >> 20} MiB"
        with m.client() as c:  # still serving
            assert c.get("/v1/healthz").status_code == 200
    finally:
        stop_master(m)


def test_nothing_of_the_job_listens_on_a_wildcard_address(master: Master) -> None:
    listening = [c for c in psutil.Process(master.proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening, "the master listens nowhere?"
    assert {c.laddr.ip for c in listening} == {"127.0.0.1"}, listening
    assert len(listening) == 1  # the control plane; the rendezvous store is part of it


# ----------------------------------------------------------------------------- process groups
GROUP = textwrap.dedent(
    """
    import json, sys
    import torch
    from tidal.worker.comm import RoundComm

    url, token, prefix, rank, world = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    comm = RoundComm.connect(url=url, token=token, prefix=prefix, rank=rank, world_size=world, backend="gloo",
                             device=torch.device("cpu"), timeout_s=20)
    rows = comm.exchange_headers([rank + 1] * 4)
    print(json.dumps({"rank": rank, "sum": rows.sum(dim=0).tolist()}), flush=True)
    # the group goes before the store it holds: a Python store that dies first (at interpreter
    # exit, in whatever order) leaves gloo a dangling callback, and the process aborts
    comm.close()
    """
)


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_forms_a_group_through_the_master(master: Master, tmp_path: Path, world: int) -> None:
    script = tmp_path / "group.py"
    script.write_text(GROUP)
    prefix = round0(master, f"group{world}/")
    procs = [subprocess.Popen([sys.executable, str(script), master.url, master.token, prefix, str(r), str(world)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parents[2])
             for r in range(world)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err.decode()[-2000:]
    expected = float(sum(range(1, world + 1)))
    results = sorted((json.loads(out) for out, _ in outs), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == list(range(world))
    assert all(r["sum"] == [int(expected)] * 4 for r in results)


def test_the_store_client_times_out_and_refuses_like_c10d(master: Master) -> None:
    import torch.distributed as dist

    from tidal.worker.store import MasterStore

    store = MasterStore(master.url, master.token, round0(master, "client/"), timeout=datetime.timedelta(seconds=1))
    try:
        store.set("a", b"1")
        assert store.get("a") == b"1"
        assert store.add("n", 2) == 2 and store.get("n") == b"2"
        assert store.compare_set("c", b"", b"v") == b"v"
        assert store.check(["a", "n"]) and not store.check(["absent"])
        assert store.num_keys() == 3
        assert store.delete_key("a") and not store.delete_key("a")
        store.wait(["n", "c"])
        store.set("w", b"1")
        store.wait(["w"])  # one long-polled get, kept for the get that follows ...
        store.set("w", b"2")  # ... and forgotten at any other call
        assert store.get("w") == b"2"
        store.wait(["w"])
        assert store.get("w") == b"2"
        start = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="timeout"):
            store.get("absent")
        with pytest.raises(dist.DistStoreError, match="timeout"):
            store.wait(["absent"], datetime.timedelta(seconds=0.3))
        with pytest.raises(dist.DistStoreError, match="timeout"):
            store.wait(["n", "absent"], datetime.timedelta(seconds=0.3))
        assert time.monotonic() - start < 5
    finally:
        store.close()
    wrong = MasterStore(master.url, "wrong", round0(master, "client/"))
    with pytest.raises(dist.DistStoreError, match="401"):
        wrong.set("a", b"1")
    wrong.close()
    stale = MasterStore(master.url, master.token, f"tidal/{job_id(master)}/round9/")
    with pytest.raises(dist.DistStoreError, match="409"):
        stale.get("a")
    stale.close()
