"""The contract every backend keeps (tidal.backends.api), one suite run against each (STYLE.md 6).

``BackendContract`` holds the tests and asks its subclass, through a few hooks, for what only an
implementation knows: how to build one, how a node ends by itself, how a launch is made to fail.
``TestLocalBackend`` runs real processes; ``TestFakeBackend`` runs the same tests in memory, so
the master's tests, which drive the fake, rely on nothing the real backend does differently.
Model: Flower's ``StateTest``, run against its in-memory and SQL states.

Asynchronous backends report what happens a little later: ``Seen`` polls until a condition holds,
keeping every exit and error it was given (each is given once), and ``settle`` waits long enough
for a second, wrong report to show up before a test counts them.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import errno
import os
import resource
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.ray_cluster import kill_namespace, ray_cluster
from tidal.backends.api import (
    Backend,
    BackendState,
    NodeError,
    NodeExit,
    NodeHandle,
    NodeSpec,
    Resources,
    Role,
)
from tidal.backends.fake import FakeBackend
from tidal.backends.local import LocalBackend

VALUE_ENV = "TIDAL_CONTRACT_VALUE"


class Seen:
    """Everything one backend's ``poll`` reported, gathered over several polls."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.running: dict[str, NodeHandle] = {}
        self.ended: list[NodeExit] = []
        self.errors: list[NodeError] = []

    def poll(self) -> BackendState:
        state = self.backend.poll()
        self.running = state.running
        self.ended += state.ended
        self.errors += state.errors
        return state

    def until(self, what: str, condition: Callable[[Seen], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if condition(self):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} in {timeout} s: running {sorted(self.running)}, "
                            f"ended {self.ended}, errors {self.errors}")
            time.sleep(0.01)

    def ended_codes(self, node_id: str) -> list[int | None]:
        return [e.exit_code for e in self.ended if e.node_id == node_id]


class BackendContract(abc.ABC):
    """The tests. Not collected itself (no ``Test`` prefix): each subclass runs them all."""

    settle_s = 0.0  # how long a wrong second report could take to show up

    # ------------------------------------------------------------------ hooks
    @abc.abstractmethod
    def make(self) -> Backend:
        """A new backend on a new machine."""

    @abc.abstractmethod
    def restarted(self, first: Backend) -> Backend:
        """The backend a restarted master gets: a new instance on ``first``'s machine."""

    @abc.abstractmethod
    def spec(self, node_id: str, role: Role = "worker", env: dict[str, str] | None = None,
             log_path: str | None = None) -> NodeSpec:
        """A node that runs until ``end_by_itself`` or ``terminate`` (it first writes the
        ``VALUE_ENV`` variable of its environment to its output)."""

    @abc.abstractmethod
    def end_by_itself(self, backend: Backend, node_id: str, code: int) -> None:
        """Make the running node ``node_id`` exit with ``code``, not through the backend."""

    @abc.abstractmethod
    def launch_unstartable(self, backend: Backend, spec: NodeSpec, request_id: str, retryable: bool) -> None:
        """``backend.launch([spec], request_id)`` such that the node cannot start: for want of the
        machine's resources (``retryable``) or because the script is wrong."""

    @abc.abstractmethod
    def started(self, backend: Backend, spec: NodeSpec) -> int:
        """A count that grows by one for each node ``backend`` starts for ``spec`` (the processes
        alive for it, or the records of a backend without processes)."""

    @abc.abstractmethod
    def check_started_as(self, backend: Backend, spec: NodeSpec) -> None:
        """Fail unless the node of ``spec`` got its env, its role and its log file."""

    def settle(self) -> None:
        time.sleep(self.settle_s)

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(autouse=True)
    def _backends(self, tmp_path: Path) -> Iterator[None]:
        """Gives ``self.tmp`` and ``self.new()``; closes every backend made and ends its nodes."""
        self.tmp = tmp_path
        self.made: list[Backend] = []
        yield
        for backend in self.made:
            backend.terminate(list(backend.poll().running), "contract-teardown")
            backend.close()
        self.cleanup()

    def cleanup(self) -> None:  # noqa: B027 (an optional hook: a backend without processes has nothing to end)
        """End what a test left behind that its backends no longer watch."""

    def new(self, first: Backend | None = None) -> Backend:
        backend = self.make() if first is None else self.restarted(first)
        self.made.append(backend)
        return backend

    def running(self, backend: Backend, *specs: NodeSpec, request_id: str = "r1") -> Seen:
        backend.launch(list(specs), request_id)
        seen = Seen(backend)
        seen.until("running nodes", lambda s: all(sp.node_id in s.running for sp in specs))
        return seen

    # ------------------------------------------------------------------ launch
    def test_launched_node_is_running_with_a_handle(self) -> None:
        backend = self.new()
        seen = self.running(backend, self.spec("ps-0", role="ps"), self.spec("worker-0"))
        assert sorted(seen.running) == ["ps-0", "worker-0"]
        for node_id, handle in seen.running.items():
            assert handle.node_id == node_id and handle.pid > 0 and handle.create_time is not None
        assert seen.running["ps-0"].pid != seen.running["worker-0"].pid
        self.settle()
        seen.poll()
        assert seen.ended == [] and seen.errors == []
        assert seen.running == backend.poll().running  # a handle stays the same while it runs

    def test_same_request_id_starts_once(self) -> None:
        backend = self.new()
        spec = self.spec("worker-0")
        seen = self.running(backend, spec)
        backend.launch([spec], "r1")
        backend.launch([spec], "r2")  # a running node id, under a new request: still one node
        self.settle()
        seen.poll()
        assert list(seen.running) == ["worker-0"] and seen.errors == [] and seen.ended == []
        assert self.started(backend, spec) == 1

    def test_request_ids_of_a_kind_do_not_clash_with_other_kinds(self) -> None:
        backend = self.new()
        seen = self.running(backend, self.spec("worker-0"), request_id="x")
        backend.terminate(["worker-0"], "x")  # a terminate is not the launch "x" retried
        seen.until("the kill", lambda s: s.ended_codes("worker-0") == [-9])

    def test_node_that_ended_cannot_be_launched_again(self) -> None:
        backend = self.new()
        spec = self.spec("worker-0")
        seen = self.running(backend, spec)
        backend.terminate(["worker-0"], "t1")
        seen.until("the kill", lambda s: bool(s.ended))
        before = self.started(backend, spec)
        backend.launch([spec], "r2")
        seen.until("an error", lambda s: bool(s.errors))
        assert [e.node_id for e in seen.errors] == ["worker-0"] and not seen.errors[0].retryable
        self.settle()
        seen.poll()
        assert seen.running == {} and len(seen.ended) == 1 and self.started(backend, spec) == before

    # ------------------------------------------------------------------ ends
    def test_terminate_reports_sigkill_once(self) -> None:
        backend = self.new()
        seen = self.running(backend, self.spec("worker-0"), self.spec("worker-1"))
        backend.terminate(["worker-0"], "t1")
        seen.until("the kill", lambda s: bool(s.ended))
        assert [(e.node_id, e.exit_code) for e in seen.ended] == [("worker-0", -9)]
        assert list(seen.running) == ["worker-1"]
        backend.terminate(["worker-1"], "t1")  # "t1" again: a retry of the call above, whatever it lists
        backend.terminate(["worker-0"], "t2")  # ended: ignored
        backend.terminate(["worker-9"], "t3")  # never launched: ignored
        self.settle()
        seen.poll()
        assert len(seen.ended) == 1 and seen.errors == [] and list(seen.running) == ["worker-1"]

    def test_node_that_exits_by_itself_reports_its_code(self) -> None:
        backend = self.new()
        seen = self.running(backend, self.spec("data-0", role="data"))
        self.end_by_itself(backend, "data-0", 3)
        seen.until("the exit", lambda s: bool(s.ended))
        self.settle()
        seen.poll()
        assert [(e.node_id, e.exit_code) for e in seen.ended] == [("data-0", 3)]
        assert seen.running == {} and seen.errors == []
        assert seen.ended[0].time > 0

    # ------------------------------------------------------------------ launch errors
    @pytest.mark.parametrize("retryable", [True, False], ids=["machine-at-fault", "script-at-fault"])
    def test_launch_that_cannot_start_is_an_error_reported_once(self, retryable: bool) -> None:
        backend = self.new()
        spec = self.spec("worker-0", log_path=str(self.tmp / "worker-0.log"))
        self.launch_unstartable(backend, spec, "r1", retryable)  # does not raise
        seen = Seen(backend)
        seen.until("a launch error", lambda s: bool(s.errors))
        assert [e.node_id for e in seen.errors] == ["worker-0"]
        assert seen.errors[0].retryable is retryable and seen.errors[0].message
        backend.launch([spec], "r1")  # the same request again: nothing, not even an error
        self.settle()
        seen.poll()
        assert len(seen.errors) == 1 and seen.running == {} and seen.ended == []
        assert self.started(backend, spec) == 0
        if retryable:  # the machine has room again: a new request starts it
            backend.launch([spec], "r2")
            seen.until("the node running", lambda s: "worker-0" in s.running)
            assert len(seen.errors) == 1

    # ------------------------------------------------------------------ adopt
    def test_restarted_master_adopts_running_nodes(self) -> None:
        first = self.new()
        handles = self.running(first, self.spec("worker-0"), self.spec("ps-0", role="ps")).running
        first.close()  # the first master is gone; its nodes are not
        second = self.new(first)
        seen = Seen(second)
        seen.poll()
        assert seen.running == {}  # nothing is watched before it is adopted
        second.adopt(list(handles.values()), "a1")
        seen.until("the adopted nodes", lambda s: len(s.running) == 2)
        assert {n: h.pid for n, h in seen.running.items()} == {n: h.pid for n, h in handles.items()}
        self.settle()
        seen.poll()
        assert seen.ended == [] and seen.errors == []

    def test_adopted_node_that_ends_is_reported_with_unknown_status(self) -> None:
        first = self.new()
        handles = self.running(first, self.spec("worker-0"), self.spec("worker-1")).running
        first.close()
        second = self.new(first)
        second.adopt(list(handles.values()), "a1")
        seen = Seen(second)
        seen.until("the adopted nodes", lambda s: len(s.running) == 2)
        second.terminate(["worker-0"], "t1")
        self.end_by_itself(second, "worker-1", 3)
        seen.until("both ends", lambda s: len(s.ended) == 2)
        self.settle()
        seen.poll()
        # not a child of this master: its exit status cannot be read
        assert sorted((e.node_id, e.exit_code) for e in seen.ended) == [("worker-0", None), ("worker-1", None)]
        assert seen.running == {}

    def test_adopt_twice_reports_one_end(self) -> None:
        first = self.new()
        handles = list(self.running(first, self.spec("worker-0")).running.values())
        first.close()
        second = self.new(first)
        second.adopt(handles, "a1")
        second.adopt(handles, "a1")  # retried
        second.adopt(handles, "a2")  # the master reloaded its journal
        seen = Seen(second)
        seen.until("the adopted node", lambda s: "worker-0" in s.running)
        second.terminate(["worker-0"], "t1")
        seen.until("the end", lambda s: bool(s.ended))
        second.adopt(handles, "a3")  # ended: adopting it again reports nothing
        self.settle()
        seen.poll()
        assert seen.ended_codes("worker-0") == [None] and seen.running == {}

    def test_adopting_its_own_node_changes_nothing(self) -> None:
        backend = self.new()
        seen = self.running(backend, self.spec("worker-0"))
        backend.adopt(list(seen.running.values()), "a1")  # a master reloading its journal
        backend.terminate(["worker-0"], "t1")
        seen.until("the kill", lambda s: bool(s.ended))
        self.settle()
        seen.poll()
        assert seen.ended_codes("worker-0") == [-9]  # still its child: the status is known

    def test_adopting_a_node_that_is_gone_reports_it_ended(self) -> None:
        first = self.new()
        seen_first = self.running(first, self.spec("worker-0"))
        handles = list(seen_first.running.values())
        first.terminate(["worker-0"], "t1")
        seen_first.until("the kill", lambda s: bool(s.ended))
        second = self.new(first)
        second.adopt([*handles, NodeHandle("worker-1", 0, None)], "a1")  # pid 0: a journal with no pid
        seen = Seen(second)
        seen.until("the ends", lambda s: len(s.ended) == 2)
        second.adopt(handles, "a2")
        self.settle()
        seen.poll()
        assert [(e.node_id, e.exit_code) for e in seen.ended] == [("worker-0", None), ("worker-1", None)]
        assert seen.running == {} and seen.errors == []

    def test_adopting_a_reused_pid_reports_the_node_ended(self) -> None:
        first = self.new()
        seen_first = self.running(first, self.spec("worker-0"))
        real = seen_first.running["worker-0"]
        assert real.create_time is not None
        # the same pid, started at another time: another process that got the node's pid
        impostor = dataclasses.replace(real, create_time=real.create_time - 1000)
        second = self.new(first)
        second.adopt([impostor], "a1")
        seen = Seen(second)
        seen.until("the end", lambda s: bool(s.ended))
        assert [(e.node_id, e.exit_code) for e in seen.ended] == [("worker-0", None)]
        assert seen.running == {}
        seen_first.poll()
        assert "worker-0" in seen_first.running  # the process itself is not touched

    # ------------------------------------------------------------------ the spec
    def test_env_role_and_log_path_are_honoured(self) -> None:
        backend = self.new()
        spec = self.spec("data-3", role="data", env={VALUE_ENV: "tide-42"}, log_path=str(self.tmp / "data-3.log"))
        seen = self.running(backend, spec)
        assert list(seen.running) == ["data-3"]
        self.check_started_as(backend, spec)


# ============================================================================== LocalBackend
# Runs until the file named by argv[1] appears, then exits with the code written in it.
NODE_SCRIPT = f"""\
import os, sys, time
print(os.environ.get({VALUE_ENV!r}, ""), flush=True)
stop = sys.argv[1]
while not os.path.exists(stop):
    time.sleep(0.01)
sys.exit(int(open(stop).read()))
"""


def fill_descriptors() -> Callable[[], None]:
    """Lower the soft RLIMIT_NOFILE to this process's open descriptors and fill any hole below it:
    the next descriptor anyone asks for fails with EMFILE. Returns what undoes it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1, hard))
    fillers: list[int] = []
    while True:
        try:
            fillers.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as exc:
            assert exc.errno == errno.EMFILE
            break

    def undo() -> None:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return undo


class TestLocalBackend(BackendContract):
    """Nodes started with ``exec`` (``TestForkedLocalBackend``: from the fork server)."""

    settle_s = 0.2  # 4 adopted-watch intervals, and time for a second waiter to report
    fork = False

    def make(self) -> Backend:
        return LocalBackend(poll_interval_s=0.02, fork=self.fork)

    def restarted(self, first: Backend) -> Backend:
        return LocalBackend(poll_interval_s=0.02, fork=self.fork)  # the processes are the machine's

    def stop_file(self, node_id: str) -> Path:
        return self.tmp / f"{node_id}.exit"

    def spec(self, node_id: str, role: Role = "worker", env: dict[str, str] | None = None,
             log_path: str | None = None) -> NodeSpec:
        return NodeSpec(node_id, role, [sys.executable, "-c", NODE_SCRIPT, str(self.stop_file(node_id))],
                        env=env or {}, log_path=log_path)

    def end_by_itself(self, backend: Backend, node_id: str, code: int) -> None:
        tmp = self.stop_file(node_id).with_suffix(".tmp")
        tmp.write_text(str(code))
        tmp.rename(self.stop_file(node_id))  # whole, or not there

    def launch_unstartable(self, backend: Backend, spec: NodeSpec, request_id: str, retryable: bool) -> None:
        if not retryable:
            backend.launch([dataclasses.replace(spec, argv=[str(self.tmp / "no-such-python"), *spec.argv[1:]])],
                           request_id)
            return
        undo = fill_descriptors()
        try:
            backend.launch([spec], request_id)
        finally:
            undo()

    def ours(self) -> list[psutil.Process]:
        """The processes this test started (their argv names a file under its tmp_path)."""
        marker = str(self.tmp)
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            if any(marker in arg for arg in proc.info["cmdline"] or ()) and proc.pid != os.getpid():
                found.append(proc)
        return found

    def started(self, backend: Backend, spec: NodeSpec) -> int:
        alive = 0
        for proc in self.ours():
            with contextlib.suppress(psutil.Error):
                alive += spec.argv[-1] in proc.info["cmdline"] and proc.status() != psutil.STATUS_ZOMBIE
        return alive

    def check_started_as(self, backend: Backend, spec: NodeSpec) -> None:
        assert spec.log_path is not None
        log_path = Path(spec.log_path)
        deadline = time.monotonic() + 10
        while spec.env[VALUE_ENV] not in (log_path.read_text() if log_path.exists() else ""):
            assert time.monotonic() < deadline, "the node's output never reached its log file"
            time.sleep(0.01)
        pid = backend.poll().running[spec.node_id].pid
        assert os.getsid(pid) == pid  # its own session: a Ctrl-C for the master does not reach it

    def cleanup(self) -> None:
        for proc in self.ours():
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)


class TestForkedLocalBackend(TestLocalBackend):
    """The same suite with every node forked from the fork server (tidal.backends.forkserver): the
    nodes are found by the command line they write over the server's."""

    fork = True


# ============================================================================== FakeBackend
class TestFakeBackend(BackendContract):
    def make(self) -> Backend:
        return FakeBackend(clock=lambda: 1234.5)

    def restarted(self, first: Backend) -> Backend:
        assert isinstance(first, FakeBackend)
        return first.restarted()

    def spec(self, node_id: str, role: Role = "worker", env: dict[str, str] | None = None,
             log_path: str | None = None) -> NodeSpec:
        return NodeSpec(node_id, role, ["python", "train.py"], env=env or {}, log_path=log_path)

    def end_by_itself(self, backend: Backend, node_id: str, code: int) -> None:
        assert isinstance(backend, FakeBackend)
        backend.exit(node_id, code)

    def launch_unstartable(self, backend: Backend, spec: NodeSpec, request_id: str, retryable: bool) -> None:
        assert isinstance(backend, FakeBackend)
        backend.refuse, backend.refuse_retryable = "cannot start python: [Errno 24] Too many open files", retryable
        try:
            backend.launch([spec], request_id)
        finally:
            backend.refuse = None

    def started(self, backend: Backend, spec: NodeSpec) -> int:
        assert isinstance(backend, FakeBackend)
        return backend.launched.count(spec)

    def check_started_as(self, backend: Backend, spec: NodeSpec) -> None:
        assert isinstance(backend, FakeBackend)
        assert backend.launched == [spec]


# ============================================================================== RayBackend
#: how long a Ray node may take to start in these tests: a new Ray worker process imports Ray and
#: tidal, which took over 5 s on CI's 2 loaded cores (the node then reported as not placed)
RAY_START_S = 15.0


class TestRayBackend(TestLocalBackend):
    """The same suite on a real one-node Ray cluster on 127.0.0.1 (tests/ray_cluster.py): each node
    a detached actor whose child is the process the local backend would start."""

    settle_s = 0.3  # three status rounds

    address = ""

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _cluster(cls) -> Iterator[None]:
        with ray_cluster(head_cpus=8) as cluster:
            cls.address = cluster.address
            yield

    def make(self) -> Backend:
        from tidal.backends.ray import RayBackend

        namespace = f"contract-{uuid.uuid4().hex[:8]}"
        self.namespaces = [*getattr(self, "namespaces", []), namespace]
        return RayBackend(address=self.address, namespace=namespace, wait_for_resources_s=RAY_START_S, poll_interval_s=0.02)

    def restarted(self, first: Backend) -> Backend:
        from tidal.backends.ray import RayBackend

        assert isinstance(first, RayBackend)
        return RayBackend(address=self.address, namespace=first.namespace, wait_for_resources_s=RAY_START_S,
                          poll_interval_s=0.02)

    def launch_unstartable(self, backend: Backend, spec: NodeSpec, request_id: str, retryable: bool) -> None:
        if not retryable:
            super().launch_unstartable(backend, spec, request_id, retryable)
            return
        # the cluster is full: one CPU held by another actor, and the node asks for all 8 (a
        # machine of the cluster could hold it): not placed within wait_for_resources_s
        import ray

        from tidal.backends.ray import RayBackend

        assert isinstance(backend, RayBackend)
        class Blocker:  # defined here: Ray ships it by value (the workers cannot import this module)
            def ready(self) -> bool:
                return True

        blocker = ray.remote(num_cpus=1)(Blocker).options(
            name="blocker", namespace=backend.namespace, lifetime="detached").remote()  # detached: kept when the handle goes
        ray.get(blocker.ready.remote())
        backend.launch([dataclasses.replace(spec, resources=Resources(cpus=8))], request_id)

    def cleanup(self) -> None:
        super().cleanup()
        for namespace in getattr(self, "namespaces", []):
            kill_namespace(namespace)
        self.namespaces = []

    def test_a_node_whose_pid_was_never_journaled_is_freed_not_adopted(self) -> None:
        # the earlier master died while the node started: its journal has pid 0 for it
        first = self.new()
        spec = self.spec("worker-0")
        self.running(first, spec)
        first.close()
        second = self.new(first)
        second.adopt([NodeHandle("worker-0", 0, None)], "a1")
        seen = Seen(second)
        seen.until("the end", lambda s: bool(s.ended))
        assert seen.ended_codes("worker-0") == [None] and seen.running == {}
        deadline = time.monotonic() + 10
        while self.started(second, spec):  # its process went with its actor
            assert time.monotonic() < deadline, "the node's process outlived its actor"
            time.sleep(0.05)

    def test_request_no_machine_can_hold_is_an_error_naming_the_resource(self) -> None:
        from tidal.backends.ray import RayBackend

        backend = RayBackend(address=self.address, namespace=f"contract-{uuid.uuid4().hex[:8]}")
        self.made.append(backend)
        backend.launch([dataclasses.replace(self.spec("worker-0"), resources=Resources(cpus=1, gpus=2))], "r1")
        seen = Seen(backend)
        seen.until("the launch error", lambda s: bool(s.errors))
        error = seen.errors[0]
        assert not error.retryable and "no Ray node has the GPUs asked for (1 CPU, 2 GPU)" in error.message
        assert "127.0.0.1 (8 CPU, 0 GPU" in error.message  # what the machines have
        assert self.started(backend, self.spec("worker-0")) == 0

