"""Which flash checkpoint a resume may load (tidal.master.checkpoints): the newest the master
has the data of, never one of a step the job rolled back from, never one that failed to load."""

from __future__ import annotations

import json
from pathlib import Path

from tidal.master.checkpoints import Checkpoint, CheckpointBook, found_on_disk


def test_the_newest_checkpoint_with_final_data_is_chosen() -> None:
    book = CheckpointBook()
    for step in (9, 19, 29):
        book.note(step)
    assert book.newest_step == 29
    assert book.choose(finalized_step=30) == Checkpoint(29, 0)
    assert book.choose(finalized_step=28) == Checkpoint(19, 0)  # step 29's data is not final yet
    assert book.choose(finalized_step=5) is None


def test_a_checkpoint_that_failed_to_load_is_skipped() -> None:
    book = CheckpointBook()
    book.note(9)
    book.note(19)
    book.mark_bad(Checkpoint(19, 0))
    assert book.choose(30) == Checkpoint(9, 0)


def test_checkpoints_past_a_rollback_leave_the_history_and_their_steps_come_again() -> None:
    book = CheckpointBook()
    for step in (9, 19, 29):
        book.note(step)
    book.rollback(19)  # resumed from 19: 29 of lineage 0 is no longer the job's model
    assert book.lineage == 1 and book.reported == [Checkpoint(9, 0), Checkpoint(19, 0)]
    assert not book.in_history(Checkpoint(29, 0)) and book.in_history(Checkpoint(19, 0))
    book.note(29, lineage=0)  # an old persister's checkpoint found on disk later: refused
    book.note(29)  # the new lineage's own
    assert book.choose(40) == Checkpoint(29, 1)
    book.rollback(9)
    assert book.choose(40) == Checkpoint(9, 0) and book.newest_step == 9


def test_the_book_survives_the_journal() -> None:
    book = CheckpointBook()
    book.note(4)
    book.note(8)
    book.rollback(4)
    book.mark_bad(Checkpoint(4, 0))
    again = CheckpointBook.from_meta(json.loads(json.dumps(book.to_meta())))
    assert again == book and CheckpointBook.from_meta(None) == CheckpointBook()


def test_a_restarted_master_finds_the_checkpoints_on_disk(tmp_path: Path) -> None:
    for step, lineage in ((9, 0), (19, 1)):
        (tmp_path / f"step-{step:08d}").mkdir()
        (tmp_path / f"step-{step:08d}" / "meta.json").write_text(json.dumps({"step": step, "lineage": lineage}))
    (tmp_path / "step-00000029").mkdir()  # no meta.json (a torn copy): not a candidate
    (tmp_path / ".tmp-step-00000039-1").mkdir()
    assert found_on_disk(tmp_path) == [Checkpoint(9, 0), Checkpoint(19, 1)]
    assert found_on_disk(tmp_path / "missing") == []


def test_the_choice_follows_every_change_of_the_book() -> None:
    """choose() answers each report (its last answer is kept): a new checkpoint, a failed one and
    a rollback each change it at the same finalized step."""
    book = CheckpointBook()
    book.note(9)
    assert book.choose(30) == Checkpoint(9, 0)
    book.note(19)
    assert book.choose(30) == Checkpoint(19, 0)
    book.mark_bad(Checkpoint(19, 0))
    assert book.choose(30) == Checkpoint(9, 0)
    book.rollback(5)
    assert book.choose(30) is None
