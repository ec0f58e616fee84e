"""The ledger audit with rollbacks (a job resumed from a checkpoint of step s voids the lines of
later steps), as a function and as ``tidal audit``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.jobtools import TIDAL
from tidal.master.audit import audit_ledger, lineage


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
