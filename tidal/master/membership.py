"""Worker records and their state machine (STYLE.md 3: a transition table and a history)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tidal.api import WorkerState
from tidal.master.api import InvalidTransitionError

W = WorkerState

ALLOWED_TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    W.LAUNCHING: frozenset({W.JOINED, W.FAILED, W.SUCCEEDED}),
    W.JOINED: frozenset({W.WAITING, W.LEAVING, W.FAILED, W.SUCCEEDED}),
    W.WAITING: frozenset({W.ACTIVE, W.LEAVING, W.FAILED, W.SUCCEEDED}),
    W.ACTIVE: frozenset({W.WAITING, W.LEAVING, W.FAILED, W.SUCCEEDED}),
    W.LEAVING: frozenset({W.SUCCEEDED, W.FAILED}),
    W.SUCCEEDED: frozenset(),
    W.FAILED: frozenset(),
}

ALIVE = frozenset({W.LAUNCHING, W.JOINED, W.WAITING, W.ACTIVE})
REGISTERED = frozenset({W.JOINED, W.WAITING, W.ACTIVE})
HISTORY = 64


@dataclass
class WorkerRecord:
    worker_id: int
    state: WorkerState
    launched_at: float
    pid: int = 0
    create_time: float | None = None
    rank: int = -1
    last_seen: float = 0.0
    applied_step: int = -1
    compute_s_per_sample: float = 0.0
    samples_per_s: float = 0.0
    straggler: bool = False
    size_factor: float = 1.0  # < 1: the worker gets smaller shards and batches
    slow_since: float | None = None  # since when it has been slower than its peers
    exit_code: int | None = None
    ever_active: bool = False
    finished: bool = False  # its training loop ended: exiting, no heartbeats expected
    slot: int = 0  # the place it fills: a replacement takes over a failed worker's slot
    progressed_at: float = 0.0  # when its applied step last grew (liveness by progress)
    step_s: float = 0.0  # seconds per step it has shown (a running mean; 0: not measured yet)
    # where its steps' time goes, as it reports (running means, seconds per step; 0: not measured):
    # waiting for data between steps, computing, the collectives (tidal.worker.reporter)
    data_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    cpu_percent: float = 0.0  # of one core, as it reports (psutil; 0: not measured)
    rss_bytes: int = 0
    stream_backlog: int = -1  # a stream job: records waiting after what it has read (-1: not reported)
    stream_malformed: int = 0
    stream_lag: dict[int, int] = field(default_factory=dict)  # per partition it reads
    stream_oldest_ms: int = 0  # arrival of the oldest record waiting in its partitions (0: none)
    stream_oldest_by_partition: dict[int, int] = field(default_factory=dict)  # the same, per partition
    stream_measured_ms: int = 0  # when it looked (its clock, ms; 0: not said)
    stream_busy: float = -1.0  # share of the last second its steps had records
    stream_capacity: float = -1.0  # records/s its steps trained while busy (-1: unknown; 0: not yet this round)
    stream_queued: int = -1  # global shuffling: records in its local queue (-1: none)
    stream_forwarded_out: int = 0  # records it forwarded to others, and received from them
    stream_forwarded_in: int = 0
    stream_batch: int = 0  # records one of its steps takes (0: not said)
    stream_queue_upper: int = 0  # global shuffling: its local queue's upper threshold (0: none)
    stream_intake_spread: float = -1.0  # global shuffling: the spread of its steps' intake (-1: not measured)
    # with data workers: the dispatcher's counters of its last report (ReportRequest's data_*)
    data_counts: dict[str, float] = field(default_factory=dict)
    threads: int = 0  # its torch intra-op threads, as it reports (0: not said)
    # the latest transitions (a worker moves ACTIVE <-> WAITING every round: bounded)
    history: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=HISTORY))

    def move(self, new: WorkerState, now: float) -> None:
        """Apply a transition (moving to the state it is in changes nothing).

        Raises:
            InvalidTransitionError: the table forbids it; nothing changed.
        """
        if new is self.state:
            return
        if new not in ALLOWED_TRANSITIONS[self.state]:
            raise InvalidTransitionError(f"worker {self.worker_id} cannot go from {self.state.value} to {new.value}")
        self.state = new
        self.history.append((now, new.value))
        if new is W.ACTIVE:
            self.ever_active = True

    def progressed(self, step: int, now: float) -> None:
        """It reports ``step`` applied: note when, and how long its steps take."""
        if step <= self.applied_step:
            return
        if self.applied_step >= 0 and self.progressed_at:
            per_step = (now - self.progressed_at) / (step - self.applied_step)
            self.step_s = per_step if not self.step_s else 0.8 * self.step_s + 0.2 * per_step
        self.applied_step = step
        self.progressed_at = now

    def allowance(self, timeout_s: float) -> float:
        """How long it may go without arriving or progressing: the job's timeout, or three of its
        own steps where those are longer (a step of a large model can take minutes; a hang is
        judged against the worker's own pace)."""
        return max(timeout_s, 3 * self.step_s)

    @property
    def alive(self) -> bool:
        return self.state in ALIVE

    def to_row(self) -> dict[str, Any]:
        return {
            "state": self.state.value, "launched_at": self.launched_at, "pid": self.pid,
            "create_time": self.create_time, "rank": self.rank, "applied_step": self.applied_step,
            "exit_code": self.exit_code, "ever_active": self.ever_active, "slot": self.slot,
        }

    @classmethod
    def from_row(cls, worker_id: int, row: dict[str, Any]) -> WorkerRecord:
        return cls(
            worker_id=worker_id, state=WorkerState(row["state"]), launched_at=row["launched_at"],
            pid=row["pid"], create_time=row["create_time"], rank=row["rank"],
            applied_step=row["applied_step"], exit_code=row["exit_code"], ever_active=row["ever_active"],
            slot=row.get("slot", worker_id),
        )
