"""The ledger audit with rollbacks (a job resumed from a checkpoint of step s voids the lines of
later steps), as a function and as ``tidal audit``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.jobtools import TIDAL
from tidal.master.audit import audit_ledger, audit_stream, lineage


def line(epoch: int, start: int, end: int, step: int) -> str:
    return json.dumps({"epoch": epoch, "start": start, "end": end, "step": step, "worker": 0})


ROLLED_BACK = [line(0, 0, 4, 0), line(0, 4, 6, 1), line(0, 6, 8, 2), json.dumps({"rollback_to_step": 0}),
               line(0, 4, 8, 1), line(0, 8, 10, 2)]


def test_a_rollback_voids_the_later_steps_before_it_only() -> None:
    assert lineage(ROLLED_BACK) == [(0, 0, 4, 0), (0, 4, 8, 1), (0, 8, 10, 2)]
    assert audit_ledger(ROLLED_BACK, 10, 1).ok
    # without the rollback line the retrained samples count twice
    assert not audit_ledger([x for x in ROLLED_BACK if "rollback" not in x], 10, 1).ok


def test_a_line_that_is_neither_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="line 2 is not a range or a rollback"):
        lineage([line(0, 0, 4, 0), '{"epoch": 0}'])


def test_the_cli_exits_0_1_2(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("\n".join(ROLLED_BACK) + "\n")
    ok = subprocess.run([TIDAL, "audit", str(ledger), "--size", "10", "--epochs", "1"], capture_output=True, text=True)
    assert (ok.returncode, ok.stdout.strip()) == (0, "PASSED: epoch 0: [0, 10) exactly once in 3 ranges")
    short = subprocess.run([TIDAL, "audit", str(ledger), "--size", "12"], capture_output=True, text=True)
    assert short.returncode == 1 and "gaps [(10, 12)]" in short.stdout
    missing = subprocess.run([TIDAL, "audit", str(tmp_path / "nope"), "--size", "10"], capture_output=True, text=True)
    assert missing.returncode == 2 and "cannot read ledger" in missing.stderr


# ---------------------------------------------------------------- a stream job's ledger


def commit(step: int, partition: int, *pairs: tuple[str, str], worker: int = 0) -> str:
    return json.dumps({"step": step, "worker": worker, "partition": partition, "ids": [list(p) for p in pairs]})


IDS = [f"1000-{i}" for i in range(4)] + [f"1001-{i}" for i in range(4)]  # 8 records of partition 0


def test_a_stream_ledger_that_covers_each_record_once_passes() -> None:
    lines = [commit(0, 0, (IDS[0], IDS[1])), commit(0, 0, (IDS[2], IDS[4]), worker=1), commit(1, 0, (IDS[5], IDS[5]))]
    result = audit_stream(lines, {0: IDS})
    assert result.ok
    assert result.summary() == "PASSED: partition 0: 6 records up to 1001-1 exactly once in 3 ranges (2 later ones not committed)"
    assert (result.partitions[0].records, result.partitions[0].later) == (6, 2)


def test_a_gap_an_overlap_and_ids_not_in_the_stream_are_reported() -> None:
    gap = audit_stream([commit(0, 0, (IDS[0], IDS[1])), commit(1, 0, (IDS[4], IDS[7]))], {0: IDS}).partitions[0]
    assert (gap.ok, gap.gaps, gap.overlaps) == (False, [("1000-2", "1000-3", 2)], [])
    leading = audit_stream([commit(0, 0, (IDS[2], IDS[7]))], {0: IDS}).partitions[0]
    assert leading.gaps == [("1000-0", "1000-1", 2)]  # from the partition's first record on

    over = audit_stream([commit(0, 0, (IDS[0], IDS[3])), commit(1, 0, (IDS[2], IDS[7])), commit(1, 0, (IDS[3], IDS[4]))],
                        {0: IDS})
    assert over.partitions[0].overlaps == [("1000-2", "1001-0", 3)] and not over.partitions[0].gaps
    assert "1 overlaps (3 records) [1000-2..1001-0]" in over.summary() and over.summary().startswith("FAILED")

    # ends that are no record's id, and a range between records
    odd = audit_stream([commit(0, 0, ("999-0", IDS[3]), (IDS[4], "1001-9")), commit(1, 0, ("1000-3", "1000-3")),
                        commit(2, 0, ("1000-7", "1000-9"))], {0: IDS}).partitions[0]
    assert odd.unknown == ["999-0", "1001-9"]
    assert odd.empty == [("1000-7", "1000-9")]
    assert odd.overlaps == [("1000-3", "1000-3", 1)]
    assert "2 ids not in the stream [999-0, 1001-9]" in odd.summary() and "1 ranges of no record [1000-7..1000-9]" in odd.summary()


def test_several_ranges_per_line_and_several_partitions() -> None:
    other = ["5-0", "5-1", "6-0"]
    lines = [commit(0, 0, (IDS[0], IDS[1]), (IDS[2], IDS[3])), commit(0, 1, ("5-0", "5-0"), ("5-1", "6-0")),
             commit(1, 0, (IDS[4], IDS[7]))]
    result = audit_stream(lines, {0: IDS, 1: other, 2: ["7-0"]})
    assert result.ok, result.summary()
    assert [p.ranges for p in result.partitions] == [3, 2, 0]
    assert result.summary().endswith("; partition 2: nothing committed (1 records)")
    # a gap in one partition fails the audit and names that partition only
    cut = audit_stream([lines[0], commit(0, 1, ("5-0", "5-0"), ("6-0", "6-0")), lines[2]], {0: IDS, 1: other})
    assert not cut.ok and [p.ok for p in cut.partitions] == [True, False]
    assert cut.partitions[1].gaps == [("5-1", "5-1", 1)]
    assert "; partition 1 (up to 6-0): 1 gaps (1 records) [5-1..5-1]" in cut.summary()
    # the span ends at the highest committed id: the records after it are not due yet
    assert audit_stream([commit(0, 1, ("5-0", "5-0"))], {1: other}).ok
    # the ledger commits to a partition the stream lacks
    assert audit_stream([commit(0, 3, ("1-0", "1-1"))], {}).partitions[0].empty == [("1-0", "1-1")]


def test_a_rollback_voids_the_later_steps_of_a_stream_ledger() -> None:
    lines = [commit(0, 0, (IDS[0], IDS[1])), commit(1, 0, (IDS[2], IDS[3])), commit(2, 0, (IDS[4], IDS[4])),
             json.dumps({"rollback_to_step": 0}), commit(1, 0, (IDS[2], IDS[4])), commit(2, 0, (IDS[5], IDS[7]))]
    assert audit_stream(lines, {0: IDS}).ok
    unvoided = audit_stream([x for x in lines if "rollback" not in x], {0: IDS})
    assert unvoided.partitions[0].overlaps == [("1000-2", "1001-0", 3)]
    # voided and not committed again: a gap
    assert audit_stream(lines[:4] + lines[5:], {0: IDS}).partitions[0].gaps == [("1000-2", "1001-0", 3)]


def test_stream_ids_compare_as_integer_pairs() -> None:
    ids = ["9-5", "9-10", "10-0", "100-2"]  # as strings: "10-0" < "100-2" < "9-10" < "9-5"
    assert audit_stream([commit(0, 0, ("9-5", "10-0")), commit(1, 0, ("100-2", "100-2"))], {0: ids}).ok
    result = audit_stream([commit(0, 0, ("9-5", "9-5")), commit(1, 0, ("10-0", "100-2"))], {0: ids})
    assert result.partitions[0].gaps == [("9-10", "9-10", 1)]


def test_an_empty_stream_ledger_fails_and_a_bad_line_is_an_error() -> None:
    assert audit_stream([], {0: IDS}).summary() == "FAILED: the ledger is empty"
    assert not audit_stream([commit(1, 0, (IDS[0], IDS[7])), json.dumps({"rollback_to_step": 0})], {0: IDS}).ok
    for bad in ['{"step": 0, "partition": 0}', commit(0, 0, ("1000-1", "1000-0")), commit(0, 0, ("1000-x", "1000-1")),
                line(0, 0, 4, 0), '{"step": 0, "partition": -1, "ids": []}']:
        with pytest.raises(ValueError, match="line 2 is not a stream commit or a rollback"):
            audit_stream([commit(0, 0, (IDS[0], IDS[1])), bad], {0: IDS})
    with pytest.raises(ValueError, match="not in increasing id order"):
        audit_stream([commit(0, 0, (IDS[0], IDS[1]))], {0: IDS[::-1]})
