"""Idle connections must not kill a job (DESIGN.md 5: connection limits and header timeouts).

A hostile client opened about 1,100 TCP connections to a master with a 1,024 descriptor limit and
sent nothing: accept() failed, asyncio logged a traceback per failed accept (87 MB in 10 s),
workers could not be replaced and the job failed. These tests open such floods against real
``tidal run`` masters on 127.0.0.1 (bounded in count and time). The launch of a replacement when the
master is out of descriptors (a real EMFILE in ``LocalBackend.launch``, reported as retryable) is
tested beside the backend, in tests/backends/test_local.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import select
import socket
import subprocess
import textwrap
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from tests.jobtools import EXAMPLE, ROOT, Job, example_args, wait_for
from tidal.master.connections import (
    HEADER_TIMEOUT_S,
    ConnectionGuard,
    RateLimitFilter,
    accept_batch,
    connection_cap,
)

SLEEPER = textwrap.dedent(
    """
    import os, time
    parent = os.getppid()
    deadline = time.time() + 120
    while time.time() < deadline and os.getppid() == parent:
        time.sleep(0.2)
    """
)


class LimitedJob(Job):
    """A ``tidal run`` whose soft *and* hard RLIMIT_NOFILE are ``nofile``, so the master's raise
    to the hard limit cannot escape the shortage."""

    def __init__(self, tmp: Path, workers: str, script_args: list[str], *, nofile: int,
                 run_args: list[str] | None = None, script: Path = EXAMPLE) -> None:
        super().__init__(tmp, workers, script_args, run_args=run_args, script=script)
        self.nofile = nofile

    def _spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        nofile = self.nofile

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with open(self.out, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                    env={**os.environ, "TIDAL_HOME": str(self.dir.parent / ".tidal")},
                                    preexec_fn=limit)
        self.masters.append(proc)
        return proc

    def address(self) -> tuple[str, int]:
        url = urlsplit(self.info()["url"])
        assert url.hostname and url.port
        return url.hostname, url.port

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.info()['token']}"}


def connect_idle(addr: tuple[str, int]) -> socket.socket:
    """A connection that sends nothing (blocking connect: the kernel's queue may make it wait)."""
    sock = socket.create_connection(addr, timeout=10)
    sock.setblocking(False)
    return sock


def connect_nowait(addr: tuple[str, int]) -> socket.socket:
    """A connection that sends nothing, without waiting for the handshake (a flooder's way)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.connect_ex(addr)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset, refused
        return True


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()
    socks.clear()


@pytest.mark.slow
def test_idle_connections_are_capped_and_closed(tmp_path: Path, jobs: list[Job]) -> None:
    nofile = 512
    cap = connection_cap(nofile, 2)
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    job = LimitedJob(tmp_path, "1:2", [], script=script, run_args=["--heartbeat-timeout", "600"], nofile=nofile)
    jobs.append(job.start())
    job.wait_status(lambda s: s["state"] == "running", 60, "the master")
    assert job.proc is not None
    master = psutil.Process(job.proc.pid)
    base = master.num_fds()
    addr = job.address()
    flood: list[socket.socket] = []
    peak = 0
    try:
        with httpx.Client(base_url=job.info()["url"], headers=job.auth(), timeout=5) as keep_alive:
            assert keep_alive.get("/v1/status").status_code == 200
            for i in range(cap + 200):
                flood.append(connect_idle(addr))
                if i % 25 == 0:
                    peak = max(peak, master.num_fds())
            # a few that start a request head and never finish it (slowloris)
            for _ in range(5):
                s = connect_idle(addr)
                s.send(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")
                flood.append(s)
            opened = time.monotonic()
            time.sleep(0.5)
            peak = max(peak, master.num_fds())
            # over the cap, a new client with the token still gets in, and a kept-alive one stays
            r = httpx.get(job.info()["url"] + "/v1/status", headers=job.auth(), timeout=5)
            assert r.status_code == 200
            assert keep_alive.get("/v1/status").status_code == 200
            # accepted connections the guard has not yet seen: at most four batches (accept_batch)
            assert peak <= base + cap + 4 * accept_batch(nofile) + 8, (peak, base, cap)
            open_now = [s for s in flood if not closed_by_server(s)]
            assert len(open_now) <= cap, len(open_now)
            # silence is closed within the header timeout (plus the guard's 1 s sweep)
            deadline = opened + HEADER_TIMEOUT_S + 4
            while open_now and time.monotonic() < deadline:
                time.sleep(1)
                assert keep_alive.get("/v1/status").status_code == 200  # a worker-like client is never cut
                open_now = [s for s in open_now if not closed_by_server(s)]
            assert not open_now, f"{len(open_now)} idle connections still open {HEADER_TIMEOUT_S + 4} s later"
            assert keep_alive.get("/v1/status").status_code == 200
        wait_for(lambda: master.num_fds() <= base + 4, 10, f"the master's descriptors back to {base}")
    finally:
        close_all(flood)
    assert job.proc.poll() is None, job.output()[-3000:]
    assert len(job.output()) < 100_000


@pytest.mark.slow
def test_job_survives_a_flood_of_idle_connections_at_a_low_descriptor_limit(
        tmp_path: Path, jobs: list[Job]) -> None:
    nofile, samples, epochs = 256, 60_000, 2
    job = LimitedJob(tmp_path, "2:2", example_args(samples, epochs, 256, 0.05), nofile=nofile)
    jobs.append(job.start())
    before = job.wait_step(3)["finalized_step"]
    addr = job.address()
    flood: list[socket.socket] = []
    opened = statuses = 0
    try:
        end = time.monotonic() + 10
        while time.monotonic() < end and opened < 3000:
            for s in [s for s in flood if closed_by_server(s)]:
                flood.remove(s)
                s.close()
            while len(flood) < nofile + 50 and opened < 3000:  # more than the master could ever hold
                flood.append(connect_nowait(addr))
                opened += 1
            statuses += job.try_status() is not None
            time.sleep(0.2)
        during = job.wait_step(before + 1, 30)["finalized_step"]
    finally:
        close_all(flood)
    assert opened > nofile and statuses > 0
    assert during > before  # training went on under the flood
    assert job.wait(240) == 0, job.output()[-3000:]
    result = job.audit(samples, epochs)
    assert result.ok, result.summary()
    assert job.out.stat().st_size < 1_000_000, job.output()[-3000:]


# ----------------------------------------------------------------------------- the guard's decisions
class FakeConnection:
    """What the guard uses of a connection: whether a request is in progress, and closing it."""

    def __init__(self) -> None:
        self.busy = False
        self.closed = False

    def close_now(self) -> None:
        self.closed = True


def test_guard_evicts_the_silent_first_and_never_a_busy_connection() -> None:
    async def scenario() -> None:
        now = [0.0]
        guard = ConnectionGuard(3, header_timeout_s=10, clock=lambda: now[0])
        a, b, c, d, e, f = (FakeConnection() for _ in range(6))
        for conn in (a, b, c):
            assert guard.admit(conn)  # type: ignore[arg-type]
            now[0] += 1
        a.busy = True  # its request is being answered
        guard.response_done(b)  # type: ignore[arg-type]  # answered: idle, kept over fresh ones
        assert guard.admit(d)  # type: ignore[arg-type]
        assert (a.closed, b.closed, c.closed) == (False, False, True)  # the oldest fresh one, a skipped
        now[0] += 1
        assert guard.admit(e)  # type: ignore[arg-type]
        assert d.closed and not b.closed
        b.busy = e.busy = True
        assert not guard.admit(f)  # type: ignore[arg-type]  # everyone busy: the new one is refused
        assert guard.totals == {"refused": 1, "evicted": 2, "timed_out": 0}
        b.busy = False
        guard.response_done(b)  # type: ignore[arg-type]
        now[0] += 9.5
        guard.sweep()
        assert not b.closed  # answered 9.5 s ago
        now[0] += 1
        guard.sweep()
        assert b.closed and not a.closed and not e.closed  # busy connections wait as long as they need
        assert guard.open_count == 2 and guard.totals["timed_out"] == 1

    asyncio.run(scenario())


def test_log_floods_are_rate_limited() -> None:
    now = [0.0]
    limiter = RateLimitFilter(every_s=10, clock=lambda: now[0])
    records = [logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource\n"
                                 "socket: fd=3", None, None) for _ in range(1000)]
    assert sum(limiter.filter(r) for r in records) == 1
    other = logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, "Invalid HTTP request received.", None, None)
    assert limiter.filter(other)
    now[0] = 10
    assert limiter.filter(records[0]) and "999 more like this" in str(records[0].msg)
