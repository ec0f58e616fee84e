"""A real ``redis-server`` for tests, on a free port of 127.0.0.1; standard library only.

    with redis_server(tmp_path) as server:          # pytest.skip when redis-server is missing
        source = RedisStreamSource(server.url("events"))
        server.restart()                            # same port, same data directory

The server runs in a session of its own with ``--bind 127.0.0.1``, its data in a directory
of the test's, and without persistence unless ``persistent=True`` (then an append-only file
fsynced on every write, so a restart loses nothing). ``stop`` sends SIGTERM, then SIGKILL to
the whole process group (Redis forks for background saves) after 5 s: no process is left.
Port 6379, where a system Redis may listen, is never used.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REDIS_SERVER = "redis-server"


def available() -> bool:
    return shutil.which(REDIS_SERVER) is not None


def free_port() -> int:
    """A port nothing listens on now (bound and released; never Redis' default 6379)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != 6379:
            return port


def ping(port: int, timeout: float = 0.5) -> bool:
    """Whether a server on ``port`` answers PING (not while it is still loading its data)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, directory: Path, *, persistent: bool = False) -> None:
        self.directory = directory
        self.persistent = persistent
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)

    def url(self, name: str) -> str:
        return f"redis://127.0.0.1:{self.port}/{name}"

    def start(self, timeout: float = 10.0) -> None:
        persistence = (["--appendonly", "yes", "--appendfsync", "always"] if self.persistent
                       else ["--appendonly", "no"])
        argv = [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                *persistence, "--dir", str(self.directory), "--daemonize", "no", "--protected-mode", "yes",
                "--logfile", str(self.directory / "redis.log")]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = self.directory / "redis.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")
            time.sleep(0.01)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # a clean shutdown: flushes the append-only file, ends its forks
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # not reaped yet, so the group is still the server's
                proc.wait()

    def restart(self, down_s: float = 0.0) -> None:
        """Stop, stay down ``down_s`` seconds, start again on the same port and data directory."""
        self.stop()
        time.sleep(down_s)
        self.start()


@contextmanager
def redis_server(directory: Path, *, persistent: bool = False) -> Iterator[RedisServer]:
    """A started server, stopped on leaving; skips the test when redis-server is not installed."""
    if not available():
        pytest.skip(f"{REDIS_SERVER} is not installed (make setup installs it)")
    server = RedisServer(directory, persistent=persistent)
    try:
        for attempt in range(3):  # another process may take the free port before the server binds it
            try:
                server.start()
                break
            except RuntimeError:
                if attempt == 2:
                    raise
                server.port = free_port()
        yield server
    finally:
        server.stop()
