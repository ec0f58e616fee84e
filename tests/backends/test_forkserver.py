"""The fork server of the local backend (tidal.backends.forkserver), with real processes: what a
forked node looks like from outside (its command line, environment, session, parent and exit
status), its random generators, and what the backend does when the server runs short of
descriptors, is killed, or is asked to kill a node it has not forked yet. The contract suite runs
whole on forked nodes too (test_contract.py, ``TestForkedLocalBackend``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.backends.test_local import polled
from tidal.backends.api import NodeSpec
from tidal.backends.local import LocalBackend

READY_S = 90  # the server imports torch before its first node: seconds on CI's loaded cores

# Writes what it sees as JSON to argv[1], then waits for argv[2] to appear and exits with its content.
NODE = """\
import json, os, random, sys, time
import numpy, torch
seen = {"argv": sys.argv, "own": os.environ.get("TIDAL_OWN"), "cwd": os.getcwd(), "ppid": os.getppid(),
        "sid": os.getsid(0), "pid": os.getpid(), "torch": torch.rand(3).tolist(),
        "numpy": numpy.random.rand(3).tolist(), "random": random.random()}
tmp = sys.argv[1] + ".tmp"
with open(tmp, "w") as f:
    json.dump(seen, f)
os.rename(tmp, sys.argv[1])
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
sys.exit(int(open(sys.argv[2]).read()))
"""


@pytest.fixture
def backend() -> Iterator[LocalBackend]:
    made = LocalBackend(poll_interval_s=0.02, fork=True)
    yield made
    for handle in made.poll().running.values():
        with contextlib.suppress(OSError):
            os.kill(handle.pid, signal.SIGKILL)
    made.close()


class Nodes:
    """Node specs running ``NODE`` from a script file under ``tmp``, and what each saw."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.script = tmp / "node.py"
        self.script.write_text(NODE)

    def spec(self, node_id: str, **env: str) -> NodeSpec:
        return NodeSpec(node_id, "worker", [sys.executable, str(self.script), str(self.seen_path(node_id)),
                                            str(self.stop_path(node_id))],
                        env={"TIDAL_JOB_ID": "forked", **env}, cwd=str(self.tmp),
                        log_path=str(self.tmp / f"{node_id}.log"))

    def seen_path(self, node_id: str) -> Path:
        return self.tmp / f"{node_id}.json"

    def stop_path(self, node_id: str) -> Path:
        return self.tmp / f"{node_id}.exit"

    def seen(self, node_id: str, timeout: float = READY_S) -> dict:
        deadline = time.monotonic() + timeout
        while not self.seen_path(node_id).exists():
            log = self.tmp / f"{node_id}.log"
            assert time.monotonic() < deadline, f"{node_id} never ran: {log.read_text() if log.exists() else ''}"
            time.sleep(0.02)
        return json.loads(self.seen_path(node_id).read_text())

    def stop(self, node_id: str, code: int) -> None:
        tmp = self.stop_path(node_id).with_suffix(".tmp")
        tmp.write_text(str(code))
        tmp.rename(self.stop_path(node_id))


def server_of(pid: int) -> psutil.Process:
    parent = psutil.Process(pid).parent()
    assert parent is not None and "tidal.backends.forkserver" in " ".join(parent.cmdline()), parent
    return parent


def test_a_forked_node_looks_like_one_started_with_exec(tmp_path: Path, backend: LocalBackend) -> None:
    nodes = Nodes(tmp_path)
    spec = nodes.spec("worker-0", TIDAL_OWN="own")
    backend.launch([spec], "r1")
    seen = nodes.seen("worker-0")
    proc = psutil.Process(seen["pid"])
    assert backend.poll().running["worker-0"].pid == seen["pid"]
    server = server_of(seen["pid"])
    assert seen["ppid"] == server.pid != os.getpid()  # forked, not exec'd by this process
    assert seen["sid"] == seen["pid"]  # its own session
    assert seen["argv"] == spec.argv[1:] and seen["own"] == "own" and seen["cwd"] == str(tmp_path)
    # ps and /proc show the node's own command line and environment, not the server's
    assert proc.cmdline() == spec.argv
    assert proc.environ()["TIDAL_OWN"] == "own" and proc.environ()["TIDAL_JOB_ID"] == "forked"
    assert "TIDAL_OWN" not in server.environ()
    nodes.stop("worker-0", 3)
    state = polled(backend, lambda s: bool(s.ended), timeout=30)
    assert [(e.node_id, e.exit_code) for e in state.ended] == [("worker-0", 3)]  # the server reaped it


def test_forked_nodes_draw_different_random_numbers(tmp_path: Path, backend: LocalBackend) -> None:
    """A fresh process seeds torch's and numpy's generators from the OS; forked copies of one server
    would otherwise all draw the same numbers."""
    nodes = Nodes(tmp_path)
    backend.launch([nodes.spec("worker-0"), nodes.spec("worker-1")], "r1")
    a, b = nodes.seen("worker-0"), nodes.seen("worker-1")
    assert server_of(a["pid"]).pid == server_of(b["pid"]).pid
    for kind in ("torch", "numpy", "random"):
        assert a[kind] != b[kind], kind


def test_a_node_terminated_before_it_is_forked_never_runs(tmp_path: Path, backend: LocalBackend) -> None:
    nodes = Nodes(tmp_path)
    backend.launch([nodes.spec("worker-0")], "r1")  # the server is still importing torch
    backend.terminate(["worker-0"], "t1")
    state = polled(backend, lambda s: bool(s.ended), timeout=READY_S)
    assert [(e.node_id, e.exit_code) for e in state.ended] == [("worker-0", -9)]
    backend.launch([nodes.spec("worker-1")], "r2")
    nodes.seen("worker-1")  # the server is ready now and forks the next
    assert not nodes.seen_path("worker-0").exists()


def test_a_server_out_of_descriptors_reports_a_retryable_error(tmp_path: Path, backend: LocalBackend) -> None:
    nodes = Nodes(tmp_path)
    backend.launch([nodes.spec("worker-0")], "r1")
    server = server_of(nodes.seen("worker-0")["pid"])
    soft, hard = server.rlimit(psutil.RLIMIT_NOFILE)
    server.rlimit(psutil.RLIMIT_NOFILE, (server.num_fds(), hard))  # its next open fails with EMFILE
    backend.launch([nodes.spec("worker-1")], "r2")
    state = polled(backend, lambda s: bool(s.errors), timeout=30)
    assert [(e.node_id, e.retryable) for e in state.errors] == [("worker-1", True)], state.errors
    assert "EMFILE" in state.errors[0].message and "short of resources" in state.errors[0].message
    server.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))
    backend.launch([nodes.spec("worker-2")], "r3")
    assert server_of(nodes.seen("worker-2")["pid"]).pid == server.pid


def test_a_killed_server_leaves_its_nodes_running_and_exec_takes_over(tmp_path: Path, backend: LocalBackend) -> None:
    nodes = Nodes(tmp_path)
    backend.launch([nodes.spec("worker-0")], "r1")
    pid = nodes.seen("worker-0")["pid"]
    server = server_of(pid)
    server.kill()
    server.wait(10)
    assert psutil.Process(pid).is_running()  # the node outlives its parent
    backend.launch([nodes.spec("worker-1")], "r2")
    later = nodes.seen("worker-1")
    assert later["ppid"] == os.getpid()  # started with exec: the server is gone
    nodes.stop("worker-0", 0)
    state = polled(backend, lambda s: any(e.node_id == "worker-0" for e in s.ended), timeout=30)
    # its status went with the server that would have reaped it: unknown, as for an adopted node
    assert [(e.node_id, e.exit_code) for e in state.ended] == [("worker-0", None)]
    nodes.stop("worker-1", 5)
    state = polled(backend, lambda s: any(e.node_id == "worker-1" for e in s.ended), timeout=30)
    assert [(e.node_id, e.exit_code) for e in state.ended] == [("worker-1", 5)]


def test_what_a_fork_cannot_change_starts_with_exec(tmp_path: Path, backend: LocalBackend) -> None:
    """Interpreter options, and variables read only when a process starts, need a new process."""
    nodes = Nodes(tmp_path)
    backend.launch([nodes.spec("worker-0")], "r1")
    assert server_of(nodes.seen("worker-0")["pid"])
    flagged = nodes.spec("worker-1")
    flagged = NodeSpec(flagged.node_id, flagged.role, [sys.executable, "-X", "utf8", *flagged.argv[1:]],
                       flagged.env, cwd=flagged.cwd, log_path=flagged.log_path)
    threads = nodes.spec("worker-2", OMP_NUM_THREADS="3")
    backend.launch([flagged, threads], "r2")
    for node_id in ("worker-1", "worker-2"):
        assert nodes.seen(node_id)["ppid"] == os.getpid(), node_id
