"""The backend interface: where a job's processes run, for every role (DESIGN.md 3).

A backend starts, stops and watches *nodes*: the processes of a job, each with a role
(``worker``, ``ps``, ``data``) and a string id unique within the job (``worker-3``). The master
never blocks on it and never catches its exceptions in the normal course:

* ``launch`` and ``terminate`` are idempotent by request id: a retried call with an id already
  seen does nothing (the master retries after a crash or a journal reload).
* Failures are data, reported by ``poll``: a node that could not start is a ``NodeError``
  (``retryable`` when the machine, not the script, is at fault), a node that ended is a
  ``NodeExit`` with its exit status. After Ray's ``ICloudInstanceProvider.launch(shape,
  request_id)`` / ``poll_errors()`` (STYLE.md 4).
* ``adopt`` re-attaches a restarted master to nodes an earlier master started (by the handles it
  journaled); a node that is gone shows in the next ``poll`` as ended with an unknown status.

Implementations are registered by name in ``tidal.backends.registry``; every one passes the
contract suite in ``tests/backends/test_contract.py``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Literal, Protocol

Role = Literal["worker", "ps", "data"]
ROLES: tuple[Role, ...] = ("worker", "ps", "data")


class BackendError(Exception):
    """A backend that cannot be built or used at all (an unknown name, a bad option): raised at
    set-up, never from ``launch``/``terminate``/``poll``, which report failures as data."""


@dataclass(frozen=True)
class Resources:
    """What a node asks for. ``memory_mb`` 0: no limit asked."""

    cpus: float = 1.0
    gpus: int = 0
    memory_mb: int = 0


@dataclass(frozen=True)
class NodeSpec:
    node_id: str  # unique within the job: "{role}-{n}"
    role: Role
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    resources: Resources = Resources()
    cwd: str | None = None
    log_path: str | None = None  # stdout and stderr go here (never a pipe: nodes outlive the master)


@dataclass(frozen=True)
class NodeHandle:
    """What finds a running node again after the master restarts (journaled by the master)."""

    node_id: str
    pid: int
    create_time: float | None = None  # tells a reused pid from the node's own


@dataclass(frozen=True)
class NodeExit:
    """A node ended. ``exit_code`` is negative for a signal (-9: SIGKILL), None if unknown (a
    node adopted from an earlier master is not our child: its status cannot be read)."""

    node_id: str
    exit_code: int | None
    time: float


@dataclass(frozen=True)
class NodeError:
    """A node that could not start. ``retryable``: the machine, not the script, is at fault (out
    of file descriptors, processes, memory or disk): the master backs off and tries again without
    counting it as a crash of the script."""

    node_id: str
    message: str
    retryable: bool = False


@dataclass
class BackendState:
    """What ``poll`` saw: the nodes running now, and what ended or failed since the last poll
    (each exit and error is reported once)."""

    running: dict[str, NodeHandle] = field(default_factory=dict)
    ended: list[NodeExit] = field(default_factory=list)
    errors: list[NodeError] = field(default_factory=list)


class Backend(Protocol):
    name: str

    def launch(self, specs: list[NodeSpec], request_id: str) -> None:
        """Start the nodes. A node that cannot start is reported by the next ``poll`` as a
        ``NodeError``; a request id already seen starts nothing. A node id already running
        starts nothing; one that ran and ended is a ``NodeError`` (ids are never reused)."""
        ...

    def terminate(self, node_ids: list[str], request_id: str) -> None:
        """Kill the nodes (SIGKILL or the backend's equivalent: a hung node ignores anything
        gentler). Unknown or ended ids are ignored; each killed node is reported by ``poll``."""
        ...

    def adopt(self, handles: list[NodeHandle], request_id: str) -> None:
        """Watch nodes started by an earlier master. One that is gone (or whose pid now belongs
        to another process) is reported by the next ``poll`` as ended with ``exit_code`` None."""
        ...

    def poll(self) -> BackendState:
        """The running nodes, and the exits and launch errors not reported before. Never raises
        for a node's failure."""
        ...

    def close(self) -> None:
        """Stop watching (nodes keep running: a restarted master adopts them)."""
        ...


class RequestIds:
    """The request ids a backend has served, per call: what makes ``launch``, ``terminate`` and
    ``adopt`` idempotent. Thread-safe (a backend's watcher threads run beside the master's)."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def first(self, call: str, request_id: str) -> bool:
        """Record ``request_id`` for ``call``; False if it was seen before (a retried call)."""
        key = (call, request_id)
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True


def node_id(role: Role, index: int) -> str:
    return f"{role}-{index}"


def parse_node_id(value: str) -> tuple[Role, int]:
    """``"worker-3"`` -> ``("worker", 3)``.

    Raises:
        ValueError: not an id ``node_id`` makes.
    """
    role, sep, index = value.rpartition("-")
    if not sep or role not in ROLES or not index.isdigit():
        raise ValueError(f"not a node id: {value!r}")
    return role, int(index)  # type: ignore[return-value]
