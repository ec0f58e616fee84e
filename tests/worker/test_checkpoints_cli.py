"""``tidal checkpoints DIR``: newest first, each verified; a truncated newest one is shown as bad."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from tests.jobtools import TIDAL
from tidal.worker.checkpoint import save_checkpoint


def test_lists_newest_first_and_names_a_corrupt_one(tmp_path: Path) -> None:
    for step in (3, 7):
        save_checkpoint(tmp_path, step, {"w": torch.full((1000, 100), float(step))}, [])
    run = subprocess.run([TIDAL, "checkpoints", str(tmp_path), "--json"], capture_output=True, text=True)
    assert run.returncode == 0
    listed = json.loads(run.stdout)
    assert [(c["step"], c["ok"]) for c in listed] == [(7, True), (3, True)] and listed[0]["bytes"] > 400_000
    with open(tmp_path / "step-00000007" / "tensors.safetensors", "r+b") as f:
        f.truncate(100)
    bad = subprocess.run([TIDAL, "checkpoints", str(tmp_path)], capture_output=True, text=True)
    lines = bad.stdout.splitlines()
    assert bad.returncode == 1 and "BAD:" in lines[0] and "does not match its manifest" in lines[0]
    assert lines[1].startswith("step         3") and lines[1].endswith("ok")
    missing = subprocess.run([TIDAL, "checkpoints", str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2 and "is not a directory" in missing.stderr
