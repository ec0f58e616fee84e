"""The job's flash checkpoints as the master knows them, and which one a resume may load.

Workers report the step of their newest flash checkpoint (``tidal.worker.flash``); when every
worker holding the model is lost, the master resumes from the newest one whose data it knows
(a step it had finalized) and rolls the data back to it (``JobMaster._form_round``).

Lineages. A resume from step ``c`` voids every step above ``c``: the job trains them again, and
a checkpoint an old worker took of such a step holds a model that is no longer the job's, though
its step number comes again. So every checkpoint carries the *lineage* it was taken in (the
number of rollbacks before it: workers write it into the checkpoint's meta, the master tags what
they report), and a checkpoint ``(step, lineage)`` belongs to the current model's history iff
every rollback since its lineage went back no further than its step. The loader checks the
lineage it is given against the checkpoint's meta, so an old worker's snapshot of the same step
(still in shared memory, or written by its persister after the rollback) is never loaded.

``CheckpointBook`` is pure state; the master journals ``to_meta()``. ``found_on_disk`` reads the
checkpoint directory for a restarted master.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

KEEP_REPORTED = 64  # checkpoints remembered per job: a resume needs the newest few


class Checkpoint(NamedTuple):
    step: int
    lineage: int


@dataclass
class CheckpointBook:
    reported: list[Checkpoint] = field(default_factory=list)  # oldest first
    rollbacks: list[int] = field(default_factory=list)  # the step each resume went back to, in order
    bad: set[Checkpoint] = field(default_factory=set)  # could not be loaded
    # choose()'s last answer, by finalized step: every report's response names it (the persisters
    # keep it), 2,000 a second; note, mark_bad and rollback drop it
    _chosen: tuple[int, Checkpoint | None] | None = field(default=None, compare=False, repr=False)

    @property
    def lineage(self) -> int:
        return len(self.rollbacks)

    @property
    def newest_step(self) -> int:
        return max((c.step for c in self.reported if self.in_history(c)), default=-1)

    def note(self, step: int, lineage: int | None = None) -> None:
        """A checkpoint of ``step`` exists (reported by a worker of the current lineage, or found
        on disk with its own)."""
        ckpt = Checkpoint(step, self.lineage if lineage is None else lineage)
        if step < 0 or ckpt in self.reported or not self.in_history(ckpt):
            return
        self.reported.append(ckpt)
        self.reported.sort()
        del self.reported[:-KEEP_REPORTED]
        self._chosen = None

    def in_history(self, ckpt: Checkpoint) -> bool:
        """Whether the checkpoint's model is in the current model's history."""
        return all(ckpt.step <= back for back in self.rollbacks[ckpt.lineage:])

    def choose(self, finalized_step: int) -> Checkpoint | None:
        """The newest loadable checkpoint whose data the master knows, or None."""
        if self._chosen is not None and self._chosen[0] == finalized_step:
            return self._chosen[1]
        usable = [c for c in self.reported if c.step <= finalized_step and c not in self.bad and self.in_history(c)]
        chosen = max(usable, key=lambda c: (c.step, c.lineage), default=None)
        self._chosen = (finalized_step, chosen)
        return chosen

    def mark_bad(self, ckpt: Checkpoint) -> None:
        self.bad.add(ckpt)
        self._chosen = None

    def rollback(self, step: int) -> None:
        """The job resumed from ``step``: a new lineage begins; later checkpoints are void."""
        self.rollbacks.append(step)
        self._chosen = None
        self.reported = [c for c in self.reported if self.in_history(c)]

    # ------------------------------------------------------------------ journal
    def to_meta(self) -> dict[str, Any]:
        return {"reported": [list(c) for c in self.reported], "rollbacks": self.rollbacks,
                "bad": sorted(list(c) for c in self.bad)}

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> CheckpointBook:
        meta = meta or {}
        return cls([Checkpoint(int(s), int(g)) for s, g in meta.get("reported", [])],
                   [int(s) for s in meta.get("rollbacks", [])],
                   {Checkpoint(int(s), int(g)) for s, g in meta.get("bad", [])})


def found_on_disk(directory: str | Path) -> list[Checkpoint]:
    """The ``step-<step>`` checkpoints of ``directory`` (``tidal.worker.checkpoint``'s layout), with
    the lineage their ``meta.json`` names; unverified (the loader verifies what it loads). A
    restarted master knows them this way: the workers that reported them may be gone with it."""
    root = Path(directory)
    out = []
    for path in sorted(root.glob("step-*")) if root.is_dir() else []:
        if not path.name[5:].isdigit():
            continue
        try:
            meta = json.loads((path / "meta.json").read_text())
            out.append(Checkpoint(int(path.name[5:]), int(meta.get("lineage", 0))))
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.warning("checkpoint %s: no readable meta.json (%s); not a resume candidate", path, exc)
    return out
