"""The worker record's state machine: a forbidden transition raises and changes nothing."""

from __future__ import annotations

import pytest

from tidal.api import WorkerState
from tidal.master.api import InvalidTransitionError
from tidal.master.membership import ALLOWED_TRANSITIONS, WorkerRecord

W = WorkerState


@pytest.mark.parametrize("start", list(W))
def test_every_transition_the_table_forbids_raises(start: WorkerState) -> None:
    for new in W:
        rec = WorkerRecord(0, start, launched_at=0.0)
        if new is start or new in ALLOWED_TRANSITIONS[start]:
            rec.move(new, 1.0)
            assert rec.state is new
        else:
            with pytest.raises(InvalidTransitionError, match=f"from {start.value} to {new.value}"):
                rec.move(new, 1.0)
            assert rec.state is start and not rec.history


def test_a_transition_is_recorded_with_its_time() -> None:
    rec = WorkerRecord(3, W.LAUNCHING, launched_at=0.0)
    for t, state in enumerate((W.JOINED, W.WAITING, W.ACTIVE, W.SUCCEEDED)):
        rec.move(state, float(t))
    assert list(rec.history) == [(0.0, "joined"), (1.0, "waiting"), (2.0, "active"), (3.0, "succeeded")]
    assert rec.ever_active
