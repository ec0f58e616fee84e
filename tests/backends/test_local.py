"""What only ``LocalBackend`` does, beyond the contract (test_contract.py): the text and the
retryable flag of a real EMFILE and ENOENT, the log file kept and closed, stdin, one watcher per
adopted process (the fork server's own: test_forkserver.py).

The EMFILE test moved here from tests/master/test_connections.py: a master flooded with
connections runs out of descriptors, and the launch of a replacement must then be reported as the
machine's fault (retryable), not as the script crashing.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tidal.backends.api import BackendError, BackendState, NodeHandle, NodeSpec
from tidal.backends.local import LocalBackend

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
FORK_READY_S = 90  # a fork server imports torch before its first node: seconds on CI's loaded cores


@pytest.fixture
def backends() -> Iterator[list[LocalBackend]]:
    """Backends a test made: each node they still run is SIGKILLed, each is closed."""
    made: list[LocalBackend] = []
    yield made
    for backend in made:
        for handle in backend.poll().running.values():
            with contextlib.suppress(OSError):
                os.kill(handle.pid, signal.SIGKILL)
        backend.close()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A process the test starts itself (as an earlier master's node), killed after the test."""
    proc = subprocess.Popen(SLEEP, start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def polled(backend: LocalBackend, condition: Callable[[BackendState], bool], timeout: float = 10) -> BackendState:
    """Poll until ``condition`` holds for what has been reported so far (ended and errors gathered)."""
    seen = BackendState()
    deadline = time.monotonic() + timeout
    while True:
        state = backend.poll()
        seen = BackendState(state.running, seen.ended + state.ended, seen.errors + state.errors)
        if condition(seen):
            return seen
        assert time.monotonic() < deadline, f"condition not met in {timeout} s: {seen}"
        time.sleep(0.01)


def _threads(name: str) -> int:
    return sum(t.name == name for t in threading.enumerate())


def _lowest_free_limit() -> int:
    return max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1


def test_launch_out_of_descriptors_is_retryable(tmp_path: Path, backends: list[LocalBackend]) -> None:
    backend = LocalBackend(fork=False)
    backends.append(backend)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    specs = [NodeSpec("worker-0", "worker", [sys.executable, "-c", "pass"], log_path=str(tmp_path / "w0.log")),
             NodeSpec("worker-1", "worker", [sys.executable, "-c", "pass"])]
    fillers: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (_lowest_free_limit(), hard))
        while True:  # fill any holes below the limit: the next descriptor anyone asks for fails
            try:
                fillers.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
                break
        backend.launch(specs, "r1")  # reports, never raises
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    state = backend.poll()
    assert [e.node_id for e in state.errors] == ["worker-0", "worker-1"]
    for e in state.errors:
        assert e.retryable, e
        assert "EMFILE" in e.message and "Too many open files" in e.message, e.message
        assert "short of resources" in e.message, e.message
    assert state.running == {} and backend.poll().errors == []


def test_launch_of_a_missing_program_is_not_retryable(tmp_path: Path, backends: list[LocalBackend]) -> None:
    backend = LocalBackend(fork=False)
    backends.append(backend)
    missing = str(tmp_path / "no-such-python")
    with warnings.catch_warnings(record=True) as caught:  # a file left to the garbage collector warns
        warnings.simplefilter("always", ResourceWarning)
        backend.launch([NodeSpec("ps-3", "ps", [missing, "train.py"], log_path=str(tmp_path / "ps-3.log"))], "r1")
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []  # the log file was closed
    errors = backend.poll().errors
    assert len(errors) == 1 and errors[0].node_id == "ps-3"
    assert not errors[0].retryable
    assert missing in errors[0].message and "ENOENT" in errors[0].message, errors[0].message


@pytest.mark.parametrize("argv", [[], ["python\0", "-c", "pass"]], ids=["empty", "nul-byte"])
def test_a_bad_argv_is_an_error_not_an_exception(argv: list[str], backends: list[LocalBackend]) -> None:
    backend = LocalBackend(fork=False)
    backends.append(backend)
    backend.launch([NodeSpec("worker-0", "worker", argv)], "r1")
    errors = backend.poll().errors
    assert [(e.node_id, e.retryable) for e in errors] == [("worker-0", False)], errors


@pytest.mark.parametrize("fork", [False, True], ids=["exec", "fork"])
def test_log_is_appended_and_stdin_is_empty(tmp_path: Path, backends: list[LocalBackend], fork: bool) -> None:
    backend = LocalBackend(fork=fork)
    backends.append(backend)
    log_path = tmp_path / "worker-0.log"
    log_path.write_text("from an earlier run\n")
    script = "import sys; print('read', repr(sys.stdin.read())); print('to stderr', file=sys.stderr); sys.exit(4)"
    backend.launch([NodeSpec("worker-0", "worker", [sys.executable, "-c", script], cwd=str(tmp_path),
                             log_path=str(log_path))], "r1")
    seen = polled(backend, lambda s: bool(s.ended), timeout=FORK_READY_S)
    assert [(e.node_id, e.exit_code) for e in seen.ended] == [("worker-0", 4)]
    assert log_path.read_text().splitlines() == ["from an earlier run", "read ''", "to stderr"]


@pytest.mark.parametrize("fork", [False, True], ids=["exec", "fork"])
def test_env_adds_to_the_masters_environment(tmp_path: Path, backends: list[LocalBackend],
                                             monkeypatch: pytest.MonkeyPatch, fork: bool) -> None:
    monkeypatch.setenv("TIDAL_FROM_MASTER", "inherited")
    backend = LocalBackend(fork=fork)
    backends.append(backend)
    log_path = tmp_path / "worker-0.log"
    script = "import os; print(os.environ['TIDAL_FROM_MASTER'], os.environ['TIDAL_OWN'], os.getcwd())"
    backend.launch([NodeSpec("worker-0", "worker", [sys.executable, "-c", script], env={"TIDAL_OWN": "own"},
                             cwd=str(tmp_path), log_path=str(log_path))], "r1")
    polled(backend, lambda s: bool(s.ended), timeout=FORK_READY_S)
    assert log_path.read_text().split() == ["inherited", "own", str(tmp_path)]


def test_adopt_twice_watches_once(sleeper: subprocess.Popen[bytes], backends: list[LocalBackend]) -> None:
    backend = LocalBackend(poll_interval_s=0.02)
    backends.append(backend)
    handle = NodeHandle("worker-7", sleeper.pid, psutil.Process(sleeper.pid).create_time())
    backend.adopt([handle], "a1")
    backend.adopt([handle], "a2")  # the master reloaded its journal
    assert _threads("tidal-watch-worker-7") == 1
    sleeper.send_signal(signal.SIGKILL)
    seen = polled(backend, lambda s: bool(s.ended))
    assert _threads("tidal-watch-worker-7") == 0
    time.sleep(0.2)
    assert [(e.node_id, e.exit_code) for e in seen.ended + backend.poll().ended] == [("worker-7", None)]


def test_adopting_a_zombie_reports_it_ended(backends: list[LocalBackend]) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:  # ended, not reaped by us
            assert time.monotonic() < deadline
            time.sleep(0.01)
        backend = LocalBackend()
        backends.append(backend)
        backend.adopt([NodeHandle("worker-0", proc.pid, None)], "a1")
        state = backend.poll()
        assert [(e.node_id, e.exit_code) for e in state.ended] == [("worker-0", None)] and state.running == {}
        assert _threads("tidal-watch-worker-0") == 0
    finally:
        proc.wait()


def test_adopting_a_process_it_launched_starts_no_watcher(backends: list[LocalBackend]) -> None:
    backend = LocalBackend(fork=False)
    backends.append(backend)
    backend.launch([NodeSpec("worker-0", "worker", SLEEP)], "r1")
    handle = backend.poll().running["worker-0"]
    backend.adopt([handle], "a1")
    assert _threads("tidal-watch-worker-0") == 0
    backend.terminate(["worker-0"], "t1")
    seen = polled(backend, lambda s: bool(s.ended))
    assert [(e.node_id, e.exit_code) for e in seen.ended] == [("worker-0", -9)]


def test_close_stops_the_watchers_and_leaves_the_nodes_running(sleeper: subprocess.Popen[bytes]) -> None:
    backend = LocalBackend(poll_interval_s=0.02)
    backend.adopt([NodeHandle("worker-1", sleeper.pid, None)], "a1")
    assert _threads("tidal-watch-worker-1") == 1
    backend.close()
    assert _threads("tidal-watch-worker-1") == 0
    assert sleeper.poll() is None  # still running: the next master adopts it


def test_poll_interval_must_be_positive() -> None:
    with pytest.raises(BackendError, match="poll_interval_s"):
        LocalBackend(poll_interval_s=0)
