"""The job's processes: their records, launches, replacements and exits, per role.

``Fleet`` owns the worker records (``tidal.master.membership``), the ids and slots new workers
take, the restart and crash-loop counts, and the one conversation with the ``Backend``: it
launches the missing processes (journaled first: a process the journal does not know would be
an orphan after a reload), kills, adopts after a restart, and turns ``Backend.poll()`` into
the exits and launch errors the master has not handled yet (kept until handled: a journal
failure mid-way keeps them for the reload).

Node ids are ``{role}-{id}`` (``tidal.backends.api``). The fleet owns the ``worker`` role; what
the backend reports of parameter servers (role ``ps``, tidal.master.servers) it queues for the
master in ``server_reports``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidal.api import WorkerState
from tidal.backends.api import (
    Backend,
    NodeError,
    NodeExit,
    NodeHandle,
    NodeSpec,
    Resources,
    node_id,
    parse_node_id,
)
from tidal.master.api import JobSpec
from tidal.master.membership import ALIVE, WorkerRecord

log = logging.getLogger(__name__)
W = WorkerState

LAUNCH_BATCH = 32  # processes started per tick: a huge target must not stall the event loop
LAUNCH_CHECK_S = 0.1  # how often the fleet looks for missing workers


class Fleet:
    def __init__(self, spec: JobSpec, backend: Backend) -> None:
        self.spec = spec
        self.backend = backend
        self.workers: dict[int, WorkerRecord] = {}
        self.next_worker_id = 0
        self.restarts = 0
        # consecutive start failures per worker slot (a replacement inherits its slot's count;
        # a worker that trains resets it)
        self.slot_failures: dict[int, int] = {}
        self.launch_seq = 0
        self.kill_seq = 0
        self.next_launch_at = 0.0  # back-off after a failed start
        self.next_launch_check = 0.0
        self._exits: deque[tuple[int, NodeExit]] = deque()
        self._errors: deque[tuple[int, NodeError]] = deque()
        self._awaiting_pid: set[int] = set()  # launched, pid not yet seen in Backend.poll()
        # parameter servers' and data workers' exits and launch errors: (id, exit code or None, why)
        self.server_reports: deque[tuple[int, int | None, str]] = deque()
        self.data_reports: deque[tuple[int, int | None, str]] = deque()

    # ------------------------------------------------------------------ journal
    def to_meta(self) -> dict[str, Any]:
        return {"next_worker_id": self.next_worker_id, "restarts": self.restarts,
                "slot_failures": {str(k): v for k, v in self.slot_failures.items()}}

    def restore(self, meta: dict[str, Any], rows: dict[int, dict[str, Any]], now: float) -> None:
        """Rebuild from the journal and adopt the processes an earlier master started; those that
        are gone show as exits at the next ``poll``."""
        self.next_worker_id = meta.get("next_worker_id", 0)
        self.restarts = meta.get("restarts", 0)
        self.slot_failures = {int(k): v for k, v in (meta.get("slot_failures") or {}).items()}
        handles = []
        for worker_id, row in rows.items():
            rec = WorkerRecord.from_row(worker_id, row)
            # liveness and progress count from now: the time the master was away is no one's fault
            rec.last_seen = rec.progressed_at = now
            self.workers[worker_id] = rec
            if rec.alive:
                handles.append(NodeHandle(node_id("worker", worker_id), rec.pid, rec.create_time))
        if handles:
            self.backend.adopt(handles, f"{self.spec.job_id}-adopt-{now:.6f}")

    # ------------------------------------------------------------------ views
    def alive_ids(self) -> list[int]:
        """Workers with a process that may still run (leaving ones included)."""
        return [w for w, r in self.workers.items() if r.state in ALIVE or r.state is W.LEAVING]

    # ------------------------------------------------------------------ backend
    def poll(self) -> None:
        """Take what the backend saw: pids of started processes, exits and launch errors (queued
        until ``pending_exits``/``pending_errors`` handle them).

        Runs every tick: only the workers launched without a known pid are looked up among the
        running nodes, not every running node (thousands, 50 times a second)."""
        state = self.backend.poll()
        for launched in list(self._awaiting_pid):
            rec = self.workers.get(launched)
            handle = state.running.get(node_id("worker", launched))
            if rec is None or rec.pid or not rec.alive:
                self._awaiting_pid.discard(launched)  # its join told the pid, or it is gone
            elif handle is not None:
                rec.pid, rec.create_time = handle.pid, handle.create_time
                self._awaiting_pid.discard(launched)
        for ev in state.ended:
            role, index = _node_of(ev.node_id)
            if role == "worker":
                self._exits.append((index, ev))
            elif role == "ps":
                self.server_reports.append((index, ev.exit_code, f"exited with code {ev.exit_code}"))
            elif role == "data":
                self.data_reports.append((index, ev.exit_code, f"exited with code {ev.exit_code}"))
        for err in state.errors:
            role, index = _node_of(err.node_id)
            if role == "worker":
                self._errors.append((index, err))
            elif role == "ps":
                self.server_reports.append((index, None, f"could not start: {err.message}"))
            elif role == "data":
                self.data_reports.append((index, None, f"could not start: {err.message}"))

    def pending_exits(self) -> deque[tuple[int, NodeExit]]:
        """Exits not handled yet: the caller pops each once handled."""
        return self._exits

    def pending_errors(self) -> deque[tuple[int, NodeError]]:
        return self._errors

    def kill(self, worker_ids: list[int], tag: str) -> None:
        """SIGKILL the workers' processes. Every call is a new request (a failed job kills what is
        left on every tick until nothing is)."""
        if worker_ids:
            self.kill_seq += 1
            self.backend.terminate([node_id("worker", w) for w in worker_ids],
                                   f"{self.spec.job_id}-{tag}-{self.kill_seq}")

    def launch_missing(self, target: int, now: float, journal_first: Callable[[], None]) -> list[WorkerRecord]:
        """Start the workers missing to ``target`` (at most ``LAUNCH_BATCH`` per call); returns
        the new records. ``journal_first`` journals them before any process starts."""
        # a scan of every worker: ten times a second is soon enough for a replacement that takes
        # seconds to start (``scale`` resets it so a user's change acts at once)
        if now < self.next_launch_check:
            return []
        self.next_launch_check = now + LAUNCH_CHECK_S
        alive = [r for r in self.workers.values() if r.alive]
        missing = min(target - len(alive), LAUNCH_BATCH)
        if missing <= 0 or now < self.next_launch_at:
            return []
        taken = {r.slot for r in alive}
        new = []
        for _ in range(missing):
            worker_id = self.next_worker_id
            self.next_worker_id += 1
            slot = self.free_slot(taken)
            taken.add(slot)
            rec = WorkerRecord(worker_id, W.LAUNCHING, launched_at=now, last_seen=now, slot=slot)
            rec.history.append((now, W.LAUNCHING.value))
            self.workers[worker_id] = rec
            new.append(rec)
            self._awaiting_pid.add(worker_id)
        journal_first()
        self.launch_seq += 1
        self.backend.launch([self.node_spec(r) for r in new], f"{self.spec.job_id}-launch-{self.launch_seq}")
        self.poll()  # the pids of what started, and what could not
        return new

    def free_slot(self, taken: set[int]) -> int:
        """The slot a new worker fills: a vacant one that saw start failures first (so its count
        goes on), else the lowest vacant one, else a new one."""
        vacant = [s for s in self.slot_failures if s not in taken]
        if vacant:
            return min(vacant, key=lambda s: (-self.slot_failures[s], s))
        slot = max([*self.slot_failures, *taken], default=-1) + 1
        self.slot_failures[slot] = 0
        return slot

    def node_spec(self, rec: WorkerRecord) -> NodeSpec:
        spec = self.spec
        env = {
            "TIDAL_MASTER_URL": spec.node_url,
            "TIDAL_TOKEN": spec.token,
            "TIDAL_JOB_ID": spec.job_id,
            "TIDAL_WORKER_ID": str(rec.worker_id),
            "PYTHONUNBUFFERED": "1",
            **spec.env,
        }
        gpus = spec.gpus_per_worker  # placed by the backend, which sets CUDA_VISIBLE_DEVICES (ray)
        if gpus:
            env["TIDAL_OWN_GPU"] = "1"
        elif spec.gpus:
            # one GPU per worker slot (a replacement takes its slot's GPU); when MAX exceeds the
            # GPUs, workers share them and say so, and their groups use gloo (tidal.worker.placement)
            env["CUDA_VISIBLE_DEVICES"] = spec.gpus[rec.slot % len(spec.gpus)]
            env["TIDAL_OWN_GPU"] = "1" if spec.max_workers <= len(spec.gpus) else "0"
            gpus = 1
        log_path = str(Path(spec.job_dir) / "logs" / f"worker-{rec.worker_id}.log")
        return NodeSpec(node_id("worker", rec.worker_id), "worker", list(spec.argv), env,
                        Resources(cpus=1.0, gpus=gpus), spec.cwd, log_path)

    # ------------------------------------------------------------------ failures
    def count_failure(self, rec: WorkerRecord, now: float, counts: bool) -> int:
        """A worker failed: count it towards ``max_restarts`` and its slot's crash loop (unless
        the machine was at fault) and back off the next launch. Returns the slot's consecutive
        start failures (0 for a worker that had trained)."""
        if not counts:
            self.next_launch_at = now + 1.0
            return 0
        self.restarts += 1
        if rec.ever_active:
            return 0
        failures = self.slot_failures[rec.slot] = self.slot_failures.get(rec.slot, 0) + 1
        self.next_launch_at = now + min(5.0, 0.5 * 2 ** failures)
        return failures

    def trained(self, rec: WorkerRecord) -> None:
        """It trains: its slot's start failures are over."""
        if self.slot_failures.get(rec.slot):
            self.slot_failures[rec.slot] = 0

    def log_tail(self, worker_id: int) -> str:
        """The last line the worker printed (why a script crashed), for the job's error."""
        return last_log_line(Path(self.spec.job_dir) / "logs" / f"worker-{worker_id}.log")


def last_log_line(path: Path) -> str:
    """The last non-empty line of a node's log (at most 300 characters; "" when none)."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _node_of(value: str) -> tuple[str | None, int]:
    try:
        return parse_node_id(value)
    except ValueError:
        log.warning("backend reported an unknown node %r", value)
        return None, -1
