"""``tidal audit LEDGER --stream URL``: a stream job's ledger against the records the stream holds,
on a real ``redis-server`` and on a recorded stream in files."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.jobtools import TIDAL
from tests.redis_server import free_port, redis_server
from tidal.data.streams import open_source


def ledger_lines(url: str) -> list[str]:
    """Appends 8 records to each of 2 partitions of ``url``; a ledger that trains each once, two
    records a line, with a rollback to step 0 that voids a step-1 line committed again after it."""
    source = open_source(url)
    try:
        ids = {p: source.append(p, [{"i": str(i).encode()} for i in range(8)]) for p in (0, 1)}
    finally:
        source.close()

    def commit(step: int, p: int, k: int) -> str:
        return json.dumps({"step": step, "worker": k % 2, "partition": p, "ids": [[ids[p][k], ids[p][k + 1]]]})

    return ([commit(0, p, 0) for p in (0, 1)] + [commit(1, 0, 2), json.dumps({"rollback_to_step": 0})]
            + [commit(1, 0, 2), commit(1, 1, 2)] + [commit(2, p, k) for p in (0, 1) for k in (4, 6)])


def audit(ledger: Path, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TIDAL, "audit", str(ledger), "--stream", url], capture_output=True, text=True, timeout=60)


def check_cli(tmp_path: Path, url: str) -> None:
    lines = ledger_lines(url)
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("\n".join(lines) + "\n")
    ok = audit(ledger, url)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("PASSED: partition 0: 8 records up to ") and "exactly once in 4 ranges" in ok.stdout
    assert "partition 1: 8 records" in ok.stdout

    ledger.write_text("\n".join(x for x in lines if x != lines[5]) + "\n")  # partition 1's step 1: records 2 and 3
    gap = audit(ledger, url)
    assert gap.returncode == 1, gap.stderr
    assert gap.stdout.startswith("FAILED: partition 0: 8 records")
    assert "partition 1 (up to " in gap.stdout and "1 gaps (2 records) [" in gap.stdout

    # the same without the rollback line: the voided step-1 line counts twice
    ledger.write_text("\n".join(x for x in lines if "rollback" not in x) + "\n")
    twice = audit(ledger, url)
    assert twice.returncode == 1 and "1 overlaps (2 records)" in twice.stdout


def test_the_cli_audits_a_redis_stream(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as server:
        check_cli(tmp_path, server.url("events"))


def test_the_cli_audits_a_file_stream(tmp_path: Path) -> None:
    check_cli(tmp_path, f"file://{tmp_path}/events")


def test_bad_input_exits_2_in_one_line(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text('{"step": 0, "partition": 0, "ids": []}\n')
    url = f"redis://127.0.0.1:{free_port()}/events"
    down = audit(ledger, url)
    assert down.returncode == 2 and down.stderr.count("\n") == 1 and f"cannot reach redis at {url}" in down.stderr
    neither = subprocess.run([TIDAL, "audit", str(ledger)], capture_output=True, text=True)
    assert neither.returncode == 2 and "--size" in neither.stderr and "--stream" in neither.stderr
    dataset = tmp_path / "dataset.jsonl"
    dataset.write_text('{"epoch": 0, "start": 0, "end": 4, "step": 0}\n')
    wrong = audit(dataset, f"file://{tmp_path}/events")
    assert wrong.returncode == 2 and "line 1 is not a stream commit or a rollback" in wrong.stderr


@pytest.mark.parametrize("extra", [["--size", "10"], ["--epochs", "1"]])
def test_stream_takes_neither_size_nor_epochs(tmp_path: Path, extra: list[str]) -> None:
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("")
    result = subprocess.run([TIDAL, "audit", str(ledger), "--stream", f"file://{tmp_path}/s", *extra],
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("tidal: error: ")
