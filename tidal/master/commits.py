"""Step commits: which steps are final, their journal rows and the ledger (DESIGN.md 4).

``Commits`` owns the tentative records (reported, not yet final), the last final step, the
members' progress that decides finality, and the ledger file. The protocol:

* Workers report their own records asynchronously. The records of step ``s`` are *final* when
  every member of the round has reported ``applied_step >= s``: then every survivor, whoever
  dies next, holds a model that includes step ``s``. Only final records reach the shard table,
  the journal and the ledger (``finalize_reported``).
* When a round ends, the source of the next round's state has its records of not-yet-final
  steps finalized and every other tentative record is discarded (``settle_round``): a dead
  worker may have applied a step no survivor applied, and those samples go back to TODO.
* When every worker holding the model is lost and the job resumes from the flash checkpoint of
  step ``s``, the steps after ``s`` are no longer in the model (``rollback``): their ranges leave
  the journal's ledger, the shard table is rebuilt from the ranges of steps up to ``s`` (the
  journal tags each with its step), and the ledger file gets ``{"rollback_to_step": s}``.

Every write goes through ``write``: the shard rows, the ledger rows and the master's meta (a
callback, since the meta is every component's) in one journal transaction, then the ledger
file. A failed write raises ``JournalUnavailableError`` and the master pauses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import TextIO

from tidal.api import StepRecord, TidalError
from tidal.api.streams import unpack_id
from tidal.master.api import JournalUnavailableError
from tidal.master.events import EventLog
from tidal.master.journal import Journal
from tidal.master.progress import MemberProgress
from tidal.master.shards import CommittedRange, ShardManager
from tidal.master.streams import StreamTable

log = logging.getLogger(__name__)


class Commits:
    def __init__(self, journal: Journal, shards: ShardManager, events: EventLog, ledger_path: str | None,
                 streams: StreamTable | None = None) -> None:
        self.journal = journal
        self.shards = shards
        self.streams = streams  # a stream job's positions (then ``shards`` stays empty)
        self.events = events
        self.ledger_path = ledger_path
        self.finalized_step = -1
        # step -> (worker, epoch, start) -> record: reported, not yet final (a stream step may
        # hold several ranges of one worker, one per partition)
        self.tentative: dict[int, dict[tuple[int, int, int], StepRecord]] = {}
        self.progress = MemberProgress()
        self._ledger: TextIO | None = None
        self._rollback_to: int | None = None  # journaled and written to the ledger by the next ``write``

    # ------------------------------------------------------------------ ledger file
    def open_ledger(self, rewrite: bool = False) -> None:
        """Open the ledger file. On resume it is rewritten from the journal (the truth)."""
        path = self.ledger_path
        if not path:
            return
        try:
            if rewrite:
                with open(path, "w") as out:
                    for row in self.journal.load_ledger():
                        out.write(self.line(row))
            self._ledger = open(path, "a")
        except OSError as exc:
            raise JournalUnavailableError(f"cannot write ledger {path}: {exc.strerror}") from exc

    def close(self) -> None:
        if self._ledger:
            try:
                self._ledger.close()
            except OSError as exc:  # buffered lines on a full disk: the journal has them
                log.warning("job %s: closing the ledger: %s", self.events.job_id, exc)
            self._ledger = None

    # ------------------------------------------------------------------ records
    def add_reported(self, record: StepRecord) -> None:
        """A member's record of a step it applied: tentative until every member has the step."""
        if record.step > self.finalized_step:
            self.tentative.setdefault(record.step, {})[(record.worker, record.epoch, record.start)] = record
        elif not self._is_committed(record):
            # a step was finalized without this record: a protocol bug, never silent
            self.events.add("error", f"late record of final step {record.step} from worker {record.worker}")
            log.error("job %s: late record %s", self.events.job_id, record)

    def pending_ranges(self) -> list[tuple[int, int, int]]:
        """(epoch, start, end) of every tentative record: trained, not final yet."""
        return [(r.epoch, r.start, r.end) for records in self.tentative.values() for r in records.values()]

    def finalize_reported(self, save_meta: Callable[[], None]) -> None:
        """Finalize every step each live member has reported (members that failed or exited are
        removed from ``progress``; one already waiting at the rendezvous still counts)."""
        upto = self.progress.minimum()
        if upto is None or upto <= self.finalized_step:
            return
        records = [r for step in sorted(self.tentative) if step <= upto for r in self.tentative.pop(step).values()]
        committed = self.commit(records)
        self.finalized_step = upto
        self.write(committed, save_meta)

    def settle_round(self, source_records: Iterable[StepRecord], source_applied: int, has_state: bool,
                     members: list[int]) -> list[CommittedRange]:
        """A round closes: finalize what its source applied, discard every other tentative record,
        count the new members' progress from scratch and return unfinished shards to TODO. The
        caller writes the returned rows with the round (``write``)."""
        committed = self.commit([r for r in source_records if self.finalized_step < r.step <= source_applied])
        if has_state and source_applied > self.finalized_step:
            self.finalized_step = source_applied
        self.tentative.clear()
        self.progress = MemberProgress(members)
        self.shards.release()
        return committed

    def rollback(self, step: int) -> int:
        """Every worker holding the model was lost: the job resumes from the checkpoint of
        ``step`` (-1: from scratch), so only the ranges of steps up to it stay consumed. The
        shard table goes back to them; the next ``write`` deletes the later rows from the journal
        and appends ``{"rollback_to_step": step}`` to the ledger file. Returns the samples of
        the voided steps (trained again)."""
        rows = self.journal.load_ledger()
        kept = [r for r in rows if r.step <= step]
        if self.streams is not None:
            self.streams.restore(kept)
        elif self.shards.config is not None:
            self.shards.rollback(kept)
        self.finalized_step = step
        self.tentative.clear()
        self._rollback_to = step
        return sum(r.end - r.start for r in rows if r.step > step)

    def commit(self, records: list[StepRecord]) -> list[CommittedRange]:
        out = []
        for r in sorted(records, key=attrgetter("step", "worker")):
            if r.end <= r.start:
                continue
            try:
                if self.streams is not None:
                    if self.streams.commit(r.epoch, r.start, r.first, r.end, r.samples):
                        out.append(CommittedRange(r.epoch, r.first, r.end, r.step, r.worker, r.start))
                elif self.shards.commit(r.epoch, r.start, r.end):
                    out.append(CommittedRange(r.epoch, r.start, r.end, r.step, r.worker))
            except TidalError as exc:  # a protocol bug must show, and must not stop the master
                self.events.add("error", f"cannot commit step {r.step} of worker {r.worker}: {exc}")
                log.error("job %s: cannot commit %s: %s", self.events.job_id, r, exc)
        return out

    def write(self, committed: list[CommittedRange], save_meta: Callable[[], None]) -> None:
        """Journal the shard table, the committed rows and the meta in one transaction, then append
        the rows to the ledger file (rewritten from the journal on a reload if that fails)."""
        rollback, self._rollback_to = self._rollback_to, None
        with self.journal.transaction():
            if rollback is not None:
                self.journal.truncate_ledger(rollback)
            self.journal.save_shards(self.shards.dirty())
            self.journal.append_ledger(committed)
            save_meta()
        if self._ledger and (committed or rollback is not None):
            lines = [] if rollback is None else [f'{{"rollback_to_step": {rollback}}}\n']
            try:
                self._ledger.write("".join(lines + [self.line(c) for c in committed]))
                self._ledger.flush()
            except OSError as exc:
                raise JournalUnavailableError(f"cannot write ledger {self.ledger_path}: {exc.strerror}") from exc


    def _is_committed(self, r: StepRecord) -> bool:
        if self.streams is not None:
            return self.streams.is_committed(r.epoch, r.end)
        return self.shards.is_committed(r.epoch, r.start, r.end)

    def line(self, c: CommittedRange) -> str:
        """The ledger file's line of a committed range: a stream job's names record ids."""
        if self.streams is not None:
            return (f'{{"step": {c.step}, "worker": {c.worker}, "partition": {c.epoch}, '
                    f'"ids": [["{unpack_id(c.start)}", "{unpack_id(c.end)}"]]}}\n')
        return ledger_line(c)


def ledger_line(c: CommittedRange) -> str:
    return f'{{"epoch": {c.epoch}, "start": {c.start}, "end": {c.end}, "step": {c.step}, "worker": {c.worker}}}\n'
