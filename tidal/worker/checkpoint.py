"""On-demand checkpoints of the training state and its fingerprint (EasyScale 3.2, DESIGN.md 5).

A checkpoint is a directory ``step-XXXXXXXX`` holding the tensors (safetensors, named by their
path in the state tree), the tree's JSON skeleton, the logical workers' contexts, the saver's
meta (a JSON object; format 2, absent from format 1 directories, which still load), and a
manifest with the SHA-256 of every file. It is written under a temporary name and renamed, so
a reader sees a whole checkpoint or none; one whose files do not match the manifest is skipped
and the previous one used. The manifest must list exactly the files of its format and the
directory must hold nothing else: a manifest that lists fewer files would vouch for tensors
nobody checked.

The fingerprint is the SHA-256 over every tensor in canonical order (sorted by path): name,
dtype, shape, bytes. Two runs that trained bitwise the same model have the same fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tidal.worker.persister import publish
from tidal.worker.state import join_tree, split_tree

MANIFEST = "manifest.json"
FORMAT = 2
# every file of a FORMAT checkpoint besides the manifest, each listed in it with its SHA-256
FILES = ("tensors.safetensors", "skeleton.json", "contexts.json", "meta.json")
# the files of each format this tidal reads (format 1 had no meta.json)
FORMAT_FILES = {1: FILES[:3], 2: FILES}


class CheckpointError(ValueError):
    """No readable checkpoint, or one that does not match its manifest."""


def save_checkpoint(directory: str | Path, step: int, tree: Any, contexts: list[dict[str, Any]],
                    meta: dict[str, Any] | None = None) -> Path:
    """Write ``tree`` (tensors and JSON values), the EST contexts and ``meta`` as checkpoint ``step``."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    skeleton, tensors = split_tree(tree)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "tensors.safetensors"))
    (tmp / "skeleton.json").write_text(json.dumps(skeleton))
    (tmp / "contexts.json").write_text(json.dumps(contexts, indent=1))
    (tmp / "meta.json").write_text(json.dumps(meta or {}))
    files = {name: _sha256(tmp / name) for name in FILES}
    (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1))
    for path in tmp.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    publish(tmp, final)
    return final


def checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoint directories, newest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step-*") if (p / MANIFEST).is_file()), reverse=True)


def verify(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path`` once every file of it matches.

    Raises:
        CheckpointError: the manifest is missing, unreadable, of another format or does not list
            exactly the checkpoint's files (``FILES``); the directory holds a file the manifest
            does not list, or misses one it does; a file's SHA-256 differs from the manifest's.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        present = {p.name for p in path.iterdir()} - {MANIFEST}
        listed = _listed_files(manifest, path)
        for name, digest in listed.items():
            if name not in present:
                raise CheckpointError(f"{name} is listed in the manifest but missing")
            if _sha256(path / name) != digest:
                raise CheckpointError(f"{name} does not match its manifest")
        unlisted = sorted(present - set(listed))
        if unlisted:
            raise CheckpointError(f"{', '.join(unlisted)} not listed in the manifest")
    except (OSError, ValueError) as exc:  # the above, an unreadable file, JSON that does not parse
        raise CheckpointError(f"{path} is not a valid checkpoint: {exc}") from exc
    return manifest  # type: ignore[no-any-return]


def _listed_files(manifest: Any, path: Path) -> dict[str, str]:
    """``manifest["files"]`` once the manifest has a format this tidal reads, this step and lists
    exactly the files of its format (``FORMAT_FILES``)."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{MANIFEST} is not a JSON object")
    version = manifest.get("format")
    if type(version) is not int or version not in FORMAT_FILES:
        raise CheckpointError(f"{MANIFEST} has format {version!r}, this tidal reads formats 1 to {FORMAT}")
    names = FORMAT_FILES[version]
    step = manifest.get("step")
    if type(step) is not int or step < 0:
        raise CheckpointError(f"{MANIFEST} has step {step!r}, not a step number")
    number = path.name.removeprefix("step-")
    if number != path.name and number.isdigit() and int(number) != step:
        raise CheckpointError(f"{MANIFEST} is of step {step}, the directory of step {int(number)}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{MANIFEST} has no table of files")
    missing = [name for name in names if name not in files]
    if missing:
        raise CheckpointError(f"{MANIFEST} does not list {', '.join(missing)}")
    unknown = sorted(str(name) for name in files if name not in names)
    if unknown:
        raise CheckpointError(f"{MANIFEST} lists files a checkpoint does not have: {', '.join(unknown)}")
    for name, digest in files.items():
        if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            raise CheckpointError(f"{MANIFEST} has no SHA-256 for {name}")
    return files


def latest_checkpoint(directory: str | Path) -> Path:
    """The newest checkpoint that verifies; a corrupt or partial newer one is skipped."""
    problems = []
    for path in checkpoints(directory):
        try:
            verify(path)
            return path
        except CheckpointError as exc:
            problems.append(str(exc))
    raise CheckpointError(f"no valid checkpoint in {directory}" + (f" ({'; '.join(problems)})" if problems else ""))


def load_checkpoint(path: Path) -> tuple[Any, list[dict[str, Any]]]:
    verify(path)
    tensors = load_file(str(path / "tensors.safetensors"))
    skeleton = json.loads((path / "skeleton.json").read_text())
    contexts = json.loads((path / "contexts.json").read_text())
    return join_tree(skeleton, tensors), contexts


def load_meta(path: Path) -> dict[str, Any]:
    """The saver's meta of checkpoint ``path`` (``{}`` for a format 1 checkpoint, which has none)."""
    if verify(path)["format"] == 1:
        return {}
    meta = json.loads((path / "meta.json").read_text())
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a valid checkpoint: meta.json is not a JSON object")
    return meta


def fingerprint(path: Path) -> str:
    """SHA-256 of the checkpoint's tensors in canonical (sorted path) order."""
    verify(path)
    tensors = load_file(str(path / "tensors.safetensors"))
    return fingerprint_tensors(tensors)


def fingerprint_tensors(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(list(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
