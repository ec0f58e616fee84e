"""What a job shows its user: the event log, the training pauses per round, the workers' metrics.

Owned by ``JobMaster`` and kept when its runtime state is reloaded from the journal (a reload is
an event of its own, not a reason to forget the earlier ones). Everything is bounded: a job that
runs for weeks with thousands of re-forms keeps the latest ``MAX_EVENTS`` events and
``MAX_PAUSES`` pauses.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from tidal.api import Event

log = logging.getLogger(__name__)

MAX_EVENTS = 500
MAX_PAUSES = 1000  # pause records kept (one per round); older ones are dropped
MAX_METRICS = 256  # keys of worker-sent metrics kept


class EventLog:
    def __init__(self, job_id: str, clock: Callable[[], float]) -> None:
        self.job_id = job_id
        self.clock = clock
        self.events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self.seq = 0
        self.metrics: dict[str, float] = {}
        self.round_causes: dict[int, str] = {}  # why each round formed: a pause is shown with it
        self.pause_events: dict[int, Event] = {}

    def add(self, kind: str, message: str, worker: int | None = None) -> Event:
        self.seq += 1
        ev = Event(seq=self.seq, time=self.clock(), kind=kind, worker=worker, message=message)
        self.events.append(ev)
        log.info("job %s: %s", self.job_id, message)
        return ev

    def note_round(self, round_: int, cause: str) -> None:
        self.round_causes[round_] = cause
        self.round_causes.pop(round_ - MAX_PAUSES, None)  # a pause reported that late is not kept

    def record_pause(self, round_: int, seconds: float) -> None:
        """A worker reports how long training stood still before round ``round_``'s first step;
        the round's pause is the longest any worker saw."""
        ev = self.pause_events.get(round_)
        cause = self.round_causes.get(round_, "re-form")
        if ev is None:
            self.seq += 1
            ev = Event(seq=self.seq, time=self.clock(), kind="pause",
                       message=f"training paused {seconds:.3f}s ({cause})", seconds=round(seconds, 4), cause=cause)
            self.pause_events[round_] = ev
            self.events.append(ev)
            while len(self.pause_events) > MAX_PAUSES:
                self.pause_events.pop(min(self.pause_events))
        elif ev.seconds is not None and seconds > ev.seconds:
            ev.seconds = round(seconds, 4)
            ev.message = f"training paused {seconds:.3f}s ({cause})"

    def pauses(self) -> list[Event]:
        return [self.pause_events[r] for r in sorted(self.pause_events)]

    def add_metrics(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if key in self.metrics or len(self.metrics) < MAX_METRICS:
                self.metrics[key[:64]] = value

    def recent(self, n: int = 50) -> list[Event]:
        return list(self.events)[-n:]
