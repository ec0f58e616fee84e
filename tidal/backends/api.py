"""The backend interface: start, stop and watch worker processes.

Calls are idempotent by request id (a retried launch with the same id starts nothing new) and
report failures as data (``LaunchError``), never by raising, so the master's reconcile loop can
record them and carry on (STYLE.md 4, after Ray's ``ICloudInstanceProvider``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    log_path: str | None = None  # stdout and stderr go here (never a pipe: workers outlive the master)


@dataclass(frozen=True)
class LaunchError:
    """A process that could not start. ``retryable``: the machine, not the script, is at fault
    (out of file descriptors, processes, memory or disk): the master backs off and tries again
    without counting it as a crash of the script."""

    worker_id: int
    message: str
    retryable: bool = False


@dataclass(frozen=True)
class BackendEvent:
    """A process ended. ``exit_code`` is negative for a signal (-9: SIGKILL), None if unknown."""

    worker_id: int
    exit_code: int | None
    time: float


class Backend(Protocol):
    def launch(self, specs: list[WorkerSpec], request_id: str) -> list[LaunchError]:
        """Start the processes; returns one error per spec that could not start."""
        ...

    def terminate(self, worker_ids: list[int], request_id: str) -> None:
        """SIGKILL the processes (a hung worker ignores anything gentler)."""
        ...

    def adopt(self, worker_id: int, pid: int, create_time: float | None) -> bool:
        """Watch a process started by an earlier master; False if it is gone."""
        ...

    def pids(self) -> dict[int, tuple[int, float]]:
        """Live processes: worker id -> (pid, create time)."""
        ...

    def poll_events(self) -> list[BackendEvent]:
        """Processes that ended since the last call."""
        ...

    def close(self) -> None: ...
