"""A backend without processes, for driving the master's state machine in tests (STYLE.md 7).

It implements ``tidal.backends.api.Backend``: launches are recorded (idempotent by request id),
``terminate`` reports the process killed, and a test says when a process exits or makes the next
launches fail, as a real backend would report them.
"""

from __future__ import annotations

from tidal.backends.api import BackendEvent, LaunchError, WorkerSpec


class FakeBackend:
    def __init__(self) -> None:
        self.launched: list[WorkerSpec] = []
        self.terminated: list[int] = []
        self.events: list[BackendEvent] = []
        self.refuse: str | None = None  # launches fail with this message while set ...
        self.refuse_retryable = False  # ... as the machine's fault (True) or the script's
        self._requests: set[str] = set()

    def launch(self, specs: list[WorkerSpec], request_id: str) -> list[LaunchError]:
        if request_id in self._requests:
            return []
        self._requests.add(request_id)
        if self.refuse is not None:
            return [LaunchError(s.worker_id, self.refuse, self.refuse_retryable) for s in specs]
        self.launched.extend(specs)
        return []

    def terminate(self, worker_ids: list[int], request_id: str) -> None:
        for w in worker_ids:
            if w not in self.terminated:
                self.terminated.append(w)
                self.events.append(BackendEvent(w, -9, 0.0))

    def adopt(self, worker_id: int, pid: int, create_time: float | None) -> bool:
        return worker_id not in self.terminated

    def pids(self) -> dict[int, tuple[int, float]]:
        return {s.worker_id: (10_000 + s.worker_id, 1.0) for s in self.launched}

    def poll_events(self) -> list[BackendEvent]:
        out, self.events = self.events, []
        return out

    def exit(self, worker_id: int, code: int) -> None:
        """The process of ``worker_id`` ended with ``code`` (negative: killed by that signal)."""
        self.events.append(BackendEvent(worker_id, code, 0.0))

    def close(self) -> None:
        pass
