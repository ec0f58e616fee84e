"""A backend without processes, for driving the master's state machine in tests (STYLE.md 7).

It implements ``tidal.backends.api.Backend`` and reports what a real backend would, down to the
cases a master must get right: a node killed by ``terminate`` ends with -9, each end and each
launch error is reported once, by ``poll``, and a restarted master (``restarted()``: a new
instance on the same machine) sees the earlier nodes only once it adopts them, an adopted node
ending with an unknown status. It passes the same contract suite as ``LocalBackend``
(``tests/backends/test_contract.py``), so a master test that passes on it says something about
the real backend.

What a test controls: ``exit`` ends a node with a chosen status, ``refuse`` makes launches fail;
what it reads: ``launched`` and ``terminated``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tidal.backends.api import BackendState, NodeError, NodeExit, NodeHandle, NodeSpec, RequestIds

FIRST_PID = 10_000
CREATE_TIME = 1.0


@dataclass(eq=False)  # by identity: two processes are never the same one
class _Process:
    pid: int
    parent: FakeBackend  # the instance that launched it: the one that can read its exit status
    watchers: list[FakeBackend] = field(default_factory=list)


@dataclass
class _Machine:
    """The processes alive, shared by a backend and its ``restarted()`` successors."""

    processes: dict[int, _Process] = field(default_factory=dict)  # by pid
    started: int = 0

    def start(self, parent: FakeBackend) -> _Process:
        proc = _Process(FIRST_PID + self.started, parent, [parent])
        self.started += 1
        self.processes[proc.pid] = proc
        return proc

    def end(self, proc: _Process, code: int) -> None:
        """Every backend watching ``proc`` sees it end: its parent with ``code``, an adopter with
        None (not its child: the status cannot be read)."""
        self.processes.pop(proc.pid, None)
        for backend in proc.watchers:
            backend._process_ended(proc, code if backend is proc.parent else None)
        proc.watchers.clear()


class FakeBackend:
    """In-memory nodes (``tidal.backends.api.Backend``).

    Args:
        clock: the time stamped on each ``NodeExit`` (a test passes its fake clock).

    Test hooks:
        launched: every spec started, in order (not the refused ones, not a running id again).
        terminated: the node ids killed by ``terminate``, each once, in order.
        refuse: while set, every launched spec fails with this message as a ``NodeError``
            (``refuse_retryable``: as the machine's fault, or the script's).
        exit(node_id, code): the node ends by itself with ``code``.
    """

    name = "fake"

    def __init__(self, clock: Callable[[], float] = time.time, *, _machine: _Machine | None = None) -> None:
        self.launched: list[NodeSpec] = []
        self.terminated: list[str] = []
        self.refuse: str | None = None  # launches fail with this message while set ...
        self.refuse_retryable = False  # ... as the machine's fault (True) or the script's
        self._clock = clock
        self._machine = _machine or _Machine()
        self._watched: dict[str, _Process] = {}  # running, by node id
        self._gone: set[str] = set()  # node ids whose end was reported (or queued): never twice
        self._ended: list[NodeExit] = []
        self._errors: list[NodeError] = []
        self._requests = RequestIds()

    def restarted(self) -> FakeBackend:
        """The backend a restarted master gets: the same machine (the nodes keep running), none of
        them watched until adopted, no request ids remembered."""
        return FakeBackend(self._clock, _machine=self._machine)

    def launch(self, specs: list[NodeSpec], request_id: str) -> None:
        if not self._requests.first("launch", request_id):
            return
        for spec in specs:
            if spec.node_id in self._watched:
                continue  # running, as asked
            if self.refuse is not None:
                self._errors.append(NodeError(spec.node_id, self.refuse, self.refuse_retryable))
            elif spec.node_id in self._gone:
                self._errors.append(NodeError(spec.node_id, f"node {spec.node_id} already ran and ended; "
                                              "a node id is launched once"))
            elif not spec.argv:
                self._errors.append(NodeError(spec.node_id, "cannot start a node with an empty argv"))
            else:
                self._watched[spec.node_id] = self._machine.start(self)
                self.launched.append(spec)

    def terminate(self, node_ids: list[str], request_id: str) -> None:
        if not self._requests.first("terminate", request_id):
            return
        for node_id in node_ids:
            proc = self._watched.get(node_id)
            if proc is not None:
                self.terminated.append(node_id)
                self._machine.end(proc, -9)

    def adopt(self, handles: list[NodeHandle], request_id: str) -> None:
        if not self._requests.first("adopt", request_id):
            return
        for handle in handles:
            if handle.node_id in self._gone or handle.node_id in self._watched:
                continue  # reported already; launched here or adopted before
            proc = self._machine.processes.get(handle.pid)
            reused = handle.create_time is not None and abs(handle.create_time - CREATE_TIME) > 1.0
            if proc is None or reused:
                self._gone.add(handle.node_id)
                self._ended.append(NodeExit(handle.node_id, None, self._clock()))
            else:
                proc.watchers.append(self)
                self._watched[handle.node_id] = proc

    def poll(self) -> BackendState:
        running = {n: NodeHandle(n, proc.pid, CREATE_TIME) for n, proc in self._watched.items()}
        state = BackendState(running, self._ended, self._errors)
        self._ended, self._errors = [], []
        return state

    def close(self) -> None:
        """Stop watching adopted nodes, as ``LocalBackend`` stops their watcher threads."""
        for node_id, proc in list(self._watched.items()):
            if proc.parent is not self:
                proc.watchers.remove(self)
                del self._watched[node_id]

    def exit(self, node_id: str, code: int) -> None:
        """The node ends by itself with ``code`` (negative: killed by that signal); the next
        ``poll`` reports it (with None to a backend that adopted it rather than launched it).

        Raises:
            ValueError: ``node_id`` is not running here (a process ends once).
        """
        proc = self._watched.get(node_id)
        if proc is None:
            raise ValueError(f"node {node_id} is not running on this backend"
                             + (" (it ended already)" if node_id in self._gone else ""))
        self._machine.end(proc, code)

    def _process_ended(self, proc: _Process, code: int | None) -> None:
        for node_id, watched in list(self._watched.items()):
            if watched is proc:
                del self._watched[node_id]
                self._gone.add(node_id)
                self._ended.append(NodeExit(node_id, code, self._clock()))
