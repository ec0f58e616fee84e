"""Checkpoints verify only when the manifest vouches for every file (tidal.worker.checkpoint)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal.worker.checkpoint import (
    FILES,
    MANIFEST,
    CheckpointError,
    fingerprint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify,
)

TIDAL = str(Path(sys.executable).with_name("tidal"))


def tree(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"weight": torch.randn(4, 3, generator=g), "bias": torch.zeros(4)}, "step": seed}


def rewrite_manifest(path: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps(change(manifest)))


def test_a_saved_checkpoint_verifies_and_loads(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 7, tree(1), [{"est": 0}])
    assert path.name == "step-00000007"
    manifest = verify(path)
    assert manifest["step"] == 7 and sorted(manifest["files"]) == sorted(FILES)
    assert sorted(p.name for p in path.iterdir()) == sorted([*FILES, MANIFEST])  # FILES is all it writes
    loaded, contexts = load_checkpoint(path)
    assert torch.equal(loaded["model"]["weight"], tree(1)["model"]["weight"]) and contexts == [{"est": 0}]
    assert fingerprint(path) == fingerprint(save_checkpoint(tmp_path / "again", 7, tree(1), []))


def _drop(name: str) -> Callable[[dict[str, Any]], Any]:
    def change(m: dict[str, Any]) -> Any:
        del m["files"][name]
        return m
    return change


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], Any]:
    def change(m: dict[str, Any]) -> Any:
        m[key] = value
        return m
    return change


def _without(key: str) -> Callable[[dict[str, Any]], Any]:
    def change(m: dict[str, Any]) -> Any:
        del m[key]
        return m
    return change


def _digest(name: str, value: Any) -> Callable[[dict[str, Any]], Any]:
    def change(m: dict[str, Any]) -> Any:
        m["files"][name] = value
        return m
    return change


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (_set("files", {}), "does not list tensors.safetensors, skeleton.json, contexts.json"),
        (_drop("tensors.safetensors"), "does not list tensors.safetensors"),
        (_drop("contexts.json"), "does not list contexts.json"),
        (_without("files"), "no table of files"),
        (_set("files", ["tensors.safetensors"]), "no table of files"),
        (_without("format"), "format None"),
        (_set("format", 3), "format 3"),
        (_set("step", 8), "of step 8, the directory of step 7"),
        (_set("step", "7"), "step '7'"),
        (_digest("skeleton.json", "0" * 64), "skeleton.json does not match"),
        (_digest("skeleton.json", None), "no SHA-256 for skeleton.json"),
        (_digest("../escape", "0" * 64), "lists files a checkpoint does not have: ../escape"),
        (lambda m: [m], "not a JSON object"),
    ],
    ids=["no-files-listed", "tensors-unlisted", "contexts-unlisted", "files-key-missing", "files-not-a-table",
         "format-missing", "format-3", "step-of-another-directory", "step-not-a-number", "wrong-digest",
         "digest-missing", "path-outside", "not-an-object"],
)
def test_a_manifest_that_does_not_vouch_for_every_file_fails(
    tmp_path: Path, change: Callable[[dict[str, Any]], Any], needle: str
) -> None:
    path = save_checkpoint(tmp_path, 7, tree(1), [])
    rewrite_manifest(path, change)
    with pytest.raises(CheckpointError, match="not a valid checkpoint") as info:
        verify(path)
    assert needle in str(info.value)
    with pytest.raises(CheckpointError):
        fingerprint(path)


def test_an_unlisted_extra_file_fails(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 1, tree(1), [])
    (path / "extra.safetensors").write_bytes(b"tensors nobody checked")
    with pytest.raises(CheckpointError, match=r"extra\.safetensors not listed in the manifest"):
        verify(path)


def test_a_missing_listed_file_fails(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 1, tree(1), [])
    (path / "skeleton.json").unlink()
    with pytest.raises(CheckpointError, match=r"skeleton\.json is listed in the manifest but missing"):
        verify(path)


def test_a_tampered_tensor_file_fails(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 1, tree(1), [])
    data = bytearray((path / "tensors.safetensors").read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's data: still a well-formed safetensors file
    (path / "tensors.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensors\.safetensors does not match its manifest"):
        verify(path)
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


def test_a_missing_or_unparsable_manifest_fails(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 1, tree(1), [])
    (path / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid checkpoint"):
        verify(path)
    (path / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="not a valid checkpoint"):
        verify(path)


def test_latest_checkpoint_falls_back_to_the_previous_valid_one(tmp_path: Path) -> None:
    good = save_checkpoint(tmp_path, 1, tree(1), [])
    emptied = save_checkpoint(tmp_path, 2, tree(2), [])
    tampered = save_checkpoint(tmp_path, 3, tree(3), [])
    assert latest_checkpoint(tmp_path) == tampered
    rewrite_manifest(emptied, _set("files", {}))
    (tampered / "tensors.safetensors").write_bytes(b"\0" * 64)
    assert latest_checkpoint(tmp_path) == good
    rewrite_manifest(good, _drop("contexts.json"))
    with pytest.raises(CheckpointError, match=re.escape(f"no valid checkpoint in {tmp_path}")):
        latest_checkpoint(tmp_path)


def run_fingerprint(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TIDAL, "fingerprint", str(directory)], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def test_tidal_fingerprint_of_a_valid_checkpoint(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 4, tree(1), [])
    for target in (path, tmp_path):
        r = run_fingerprint(target)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [fingerprint(path), str(path)]


@pytest.mark.parametrize("target", ["checkpoint", "checkpoint-dir"])
def test_tidal_fingerprint_of_an_invalid_checkpoint_is_a_one_line_error(tmp_path: Path, target: str) -> None:
    path = save_checkpoint(tmp_path, 4, tree(1), [])
    rewrite_manifest(path, _set("files", {}))  # lists nothing: nothing of it would be checked
    r = run_fingerprint(path if target == "checkpoint" else tmp_path)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tidal: error: "), r.stderr
    assert str(path) in lines[0] and "does not list" in lines[0], lines
    assert "Traceback" not in r.stderr and r.stdout == ""


_SAVE_STEP_7_AGAIN_AND_AGAIN = """
import sys, torch
from tidal.worker.checkpoint import save_checkpoint
for i in range(40):
    save_checkpoint(sys.argv[1], 7, {"w": torch.full((1 << 16,), float(i))}, [], {"writer": sys.argv[2]})
"""


def test_two_processes_writing_the_same_step_both_succeed(tmp_path: Path) -> None:
    """A persister and the final checkpoint may write one step at the same moment (CI saw the
    second rename fail with ENOTEMPTY and the job end failed): each rename swaps, neither fails,
    and the step that remains verifies."""
    procs = [subprocess.Popen([sys.executable, "-c", _SAVE_STEP_7_AGAIN_AND_AGAIN, str(tmp_path), str(w)],
                              stderr=subprocess.PIPE, text=True) for w in range(2)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000007"]  # no temporary left behind
    assert verify(tmp_path / "step-00000007")["step"] == 7
