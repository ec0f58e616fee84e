"""The processes of a role beside the workers (parameter servers, data workers): one record per
process by id, and what every such role does with its processes the same way: start them
(journaled first), see them end, stop them, adopt them after a master restart, read their logs.

``tidal.master.servers`` and ``tidal.master.dataworkers`` build on ``RoleProcesses``; the
workers themselves have their own, richer records (``tidal.master.fleet``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from tidal.backends.api import Backend, NodeHandle, NodeSpec, Role, node_id
from tidal.master.api import JobSpec
from tidal.master.fleet import last_log_line

LAUNCHING, RUNNING, RETIRING, EXITED = "launching", "running", "retiring", "exited"


class ProcessRecord(Protocol):
    state: str
    pid: int
    exit_code: int | None


R = TypeVar("R", bound=ProcessRecord)


class RoleProcesses(Generic[R]):
    """Records of the ``role``'s processes by id (``records``), made by ``new_record(id)``."""

    def __init__(self, spec: JobSpec, backend: Backend, role: Role, new_record: Callable[[int], R]) -> None:
        self.spec = spec
        self.backend = backend
        self.role = role
        self.new_record = new_record
        self.records: dict[int, R] = {}
        self._seq = 0

    def alive(self) -> list[int]:
        return [i for i, r in self.records.items() if r.state != EXITED]

    def start(self, count: int, journal_first: Callable[[], None], tag: str) -> list[int]:
        """Records for ``count`` new processes (new ids), journaled before the processes start."""
        first = max(self.records, default=-1) + 1
        new = list(range(first, first + count))
        for i in new:
            self.records[i] = self.new_record(i)
        journal_first()
        self._seq += 1
        self.backend.launch([self.node_spec(i) for i in new], f"{self.spec.job_id}-{self.role}-{tag}-{self._seq}")
        return new

    def node_spec(self, index: int) -> NodeSpec:
        raise NotImplementedError

    def exited(self, index: int, code: int | None) -> R | None:
        """A process ended; returns its record if it was not known to have ended."""
        rec = self.records.get(index)
        if rec is None or rec.state == EXITED:
            return None
        rec.state, rec.exit_code = EXITED, code
        return rec

    def kill(self, tag: str) -> None:
        """Stop every process of the role that may still run."""
        alive = self.alive()
        if alive:
            self.terminate(alive, tag)

    def terminate(self, ids: list[int], tag: str) -> None:
        self._seq += 1
        self.backend.terminate([node_id(self.role, i) for i in ids], f"{self.spec.job_id}-{self.role}-{tag}-{self._seq}")

    def adopt(self, request_id: str, ids: list[int] | None = None) -> None:
        """Watch the processes of these records (default: every one that may run) that an
        earlier master started; adopting one the backend started itself does nothing."""
        chosen = self.records if ids is None else {i: self.records[i] for i in ids}
        handles = [NodeHandle(node_id(self.role, i), r.pid) for i, r in chosen.items() if r.state != EXITED and r.pid]
        if handles:
            self.backend.adopt(handles, request_id)

    def rows(self) -> list[dict[str, Any]]:
        return [r.to_row() for r in self.records.values()]  # type: ignore[attr-defined]

    def log_tail(self, index: int) -> str:
        """The last line the process printed (why it crashed)."""
        return last_log_line(Path(self.spec.job_dir) / "logs" / f"{self.role}-{index}.log")

    def log_path(self, index: int) -> str:
        return str(Path(self.spec.job_dir) / "logs" / f"{self.role}-{index}.log")
