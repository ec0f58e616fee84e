"""Flash checkpoint (tidal.worker.flash): shared-memory slots, the persister process, load_latest.

Real processes, real files, real /dev/shm; every test uses its own slot name and removes its
slot files.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.jobtools import tmpfs_mounts
from tidal.worker import checkpoint, persister
from tidal.worker.checkpoint import MANIFEST, CheckpointError, load_checkpoint, verify
from tidal.worker.flash import (
    FlashCheckpoint,
    FlashError,
    list_checkpoints,
    load_latest,
    load_step,
    remove_shm,
)
from tidal.worker.state import split_tree

SHM = Path("/dev/shm")


@pytest.fixture
def name() -> Iterator[str]:
    value = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield value
    remove_shm(value)
    assert not list(SHM.glob(f"*tidal-{value}-*"))


@pytest.fixture
def make(name: str, tmp_path: Path) -> Iterator[Callable[..., FlashCheckpoint]]:
    made: list[FlashCheckpoint] = []

    def factory(directory: Path | None = None, **kwargs: Any) -> FlashCheckpoint:
        fc = FlashCheckpoint(directory or tmp_path / "ckpt", name=name, **kwargs)
        made.append(fc)
        return fc

    yield factory
    for fc in made:
        fc.close(timeout=30)


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"weight": torch.randn(5, 3, generator=g), "half": torch.randn(4, generator=g).half(),
                  "bf16": torch.randn(3, 2, generator=g).bfloat16(), "f64": torch.randn(2, generator=g).double()},
        "optimizer": {"state": {0: {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(5, 3, generator=g)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "ints": [torch.arange(7, dtype=torch.int64) * seed, torch.tensor([-1, 2], dtype=torch.int32),
                 torch.tensor([-3], dtype=torch.int8), torch.tensor([250], dtype=torch.uint8),
                 torch.tensor([[-7, 9]], dtype=torch.int16)],
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(seed, dtype=torch.int64),
        "strided": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # not contiguous
        "pair": (torch.ones(2), "text", None, 1.5, True),
        "applied_step": seed,
    }


def assert_same(a: Any, b: Any) -> None:
    """Equal trees; tensors bitwise equal, of the same dtype and shape."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() and a.dim() else a,
                           b.reshape(-1).view(torch.uint8) if b.numel() and b.dim() else b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


def slot_of(fc: FlashCheckpoint, step: int) -> Path:
    return next(Path(s["path"]) for s in fc.slot_states() if s["step"] == step)


def wait_state(fc: FlashCheckpoint, step: int, wanted: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s["step"] == step and s["state"] == wanted for s in fc.slot_states()):
            return
        time.sleep(0.005)
    raise AssertionError(f"step {step} never {wanted}: {fc.slot_states()}")


def test_the_disk_format_constants_agree() -> None:
    assert (persister.MANIFEST, persister.FORMAT, persister.FILES) == (MANIFEST, checkpoint.FORMAT, checkpoint.FILES)


def test_save_persist_load_gives_back_exactly_the_state(make: Callable[..., FlashCheckpoint], tmp_path: Path,
                                                        name: str) -> None:
    fc = make()
    tree, contexts, meta = state(3), [{"est": 0, "rng": [1, 2]}, {"est": 1}], {"epoch": 2, "role": "worker"}
    result = fc.save(3, tree, contexts, meta)
    assert (result.step, result.where, result.dropped_step, result.note) == (3, "shm", None, "")
    assert result.nbytes == sum(t.numel() * t.element_size() for t in _tensors(tree))
    path = fc.wait_persisted(3, timeout=30)
    assert path == (tmp_path / "ckpt" / "step-00000003").resolve()
    manifest = verify(path)
    assert manifest["format"] == 2 and sorted(manifest["files"]) == sorted(checkpoint.FILES)
    disk = load_latest(tmp_path / "ckpt")
    assert (disk.source, disk.step, disk.path, disk.contexts, disk.meta) == ("disk", 3, path, contexts, meta)
    assert_same(disk.tree, tree)
    shm = load_latest(tmp_path / "ckpt", name=name)
    assert (shm.source, shm.step, shm.contexts, shm.meta) == ("shm", 3, contexts, meta)
    assert_same(shm.tree, tree)
    shm.tree["model"]["weight"].add_(1)  # the loaded tensors are the caller's own, not views of the slot
    assert_same(load_latest(tmp_path / "ckpt", name=name).tree, tree)
    loaded, loaded_contexts = load_checkpoint(path)  # the old reader reads what the persister wrote
    assert_same(loaded, tree) and loaded_contexts == contexts
    assert fc.problems() == []


def _tensors(tree: Any) -> list[torch.Tensor]:
    return list(split_tree(tree, copy=False)[1].values())


def test_saves_of_one_layout_reuse_the_slot_files(make: Callable[..., FlashCheckpoint], name: str) -> None:
    fc = make()
    fc.save(1, state(1), [])
    fc.wait_persisted(1)
    first = os.stat(slot_of(fc, 1)).st_ino
    fc.save(2, state(2), [])
    fc.wait_persisted(2)
    fc.save(3, state(3), [])  # the slot of step 1, the oldest snapshot
    fc.wait_persisted(3)
    assert slot_of(fc, 3).name == f"tidal-{name}-0" and os.stat(slot_of(fc, 3)).st_ino == first
    bigger = state(4)
    bigger["model"]["weight"] = torch.randn(6, 3)  # another layout: the slot is made anew
    fc.save(4, bigger, [])
    fc.wait_persisted(4)
    assert os.stat(slot_of(fc, 4)).st_ino != first
    assert_same(load_latest(fc.directory, name=name).tree, bigger)


def test_the_other_slot_is_created_ahead_so_the_second_save_does_not(make: Callable[..., FlashCheckpoint],
                                                                      name: str) -> None:
    fc = make()
    fc.save(1, state(1), [])
    other = SHM / f"tidal-{name}-1"
    deadline = time.monotonic() + 10
    while not other.exists() and time.monotonic() < deadline:  # created by a background thread
        time.sleep(0.01)
    assert other.exists(), "the second slot was not created ahead"
    ahead = os.stat(other).st_ino
    fc.save(2, state(2), [])
    assert slot_of(fc, 2) == other and os.stat(other).st_ino == ahead  # used as created, not re-created
    fc.wait_persisted(2)
    assert_same(load_latest(fc.directory, name=name).tree, state(2))


TRAINER = """
import json, sys, time, torch
from tidal.worker.flash import FlashCheckpoint
directory, name, then = sys.argv[1], sys.argv[2], sys.argv[3]
fc = FlashCheckpoint(directory, name=name)
g = torch.Generator().manual_seed(7)
tree = {"w": torch.randn(50 * 2**20 // 4, generator=g), "step": 5}
result = fc.save(5, tree, [{"est": 0}], {"k": "v"})
print(json.dumps({"persister": fc._proc.pid, "where": result.where}), flush=True)
if then == "sleep":
    time.sleep(600)
"""  # then == "exit": returns without close()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie nobody reaped has exited


@pytest.mark.parametrize("end", ["sigkill", "exit"])
def test_the_persister_outlives_its_trainer(tmp_path: Path, name: str, end: str) -> None:
    """SIGKILLed right after save returned, or exiting without close(): the snapshot reaches the disk."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    directory = tmp_path / "ckpt"
    with open(tmp_path / "trainer.err", "wb") as err:
        proc = subprocess.Popen([sys.executable, str(script), str(directory), name,
                                 "sleep" if end == "sigkill" else "exit"],
                                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if end == "sigkill":
            os.kill(proc.pid, signal.SIGKILL)
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    errors = (tmp_path / "trainer.err").read_text()
    assert line, errors
    assert code == (-signal.SIGKILL if end == "sigkill" else 0), errors
    assert "Fatal" not in errors and "Traceback" not in errors, errors
    info = json.loads(line)
    assert info["where"] == "shm"
    deadline = time.monotonic() + 30
    while _alive(info["persister"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(info["persister"]), "the persister did not exit after its trainer died"
    expected = torch.randn(50 * 2**20 // 4, generator=torch.Generator().manual_seed(7))
    disk = load_latest(directory)
    assert (disk.source, disk.step, disk.contexts, disk.meta) == ("disk", 5, [{"est": 0}], {"k": "v"})
    assert torch.equal(disk.tree["w"], expected)
    shm = load_latest(directory, name=name)  # the trainer did not close: the slot stays for a resume
    assert (shm.source, shm.step) == ("shm", 5) and torch.equal(shm.tree["w"], expected)


def test_a_corrupt_or_torn_slot_is_skipped_with_a_warning(make: Callable[..., FlashCheckpoint], name: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    fc = make()
    for step in (1, 2):
        fc.save(step, state(step), [{"step": step}])
        fc.wait_persisted(step)
    wait_state(fc, 2, "persisted")
    slot = slot_of(fc, 2)
    head, _ = persister.peek_header(slot)
    assert head is not None and head.crc_ok
    with open(slot, "r+b") as f:  # in place: the same file the saver maps
        f.seek(persister.HEADER_BYTES + head.st_len - 1)  # the last byte of the last tensor
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    caplog.set_level(logging.WARNING, logger="tidal.worker.flash")
    loaded = load_latest(fc.directory, name=name)
    assert (loaded.source, loaded.step) == ("disk", 2)  # the disk copy of step 2, not the slot
    assert any("CRC-32" in r.getMessage() and str(slot) in r.getMessage() for r in caplog.records)
    (loaded.path / "tensors.safetensors").write_bytes(b"\0" * 16)  # and the disk copy is broken too
    loaded = load_latest(fc.directory, name=name)
    assert (loaded.source, loaded.step) == ("shm", 1)  # the other slot, newer than step 1 on disk
    assert_same(loaded.tree, state(1))
    caplog.clear()
    with open(slot_of(fc, 1), "r+b") as f:  # the saver died in the middle of a copy: FILLING
        f.seek(persister.STATE_AT)
        f.write(persister.FILLING.to_bytes(4, "little"))
    loaded = load_latest(fc.directory, name=name)
    assert (loaded.source, loaded.step) == ("disk", 1)
    assert any("filling" in r.getMessage() for r in caplog.records)


def test_a_new_snapshot_replaces_an_older_pending_one(make: Callable[..., FlashCheckpoint],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_PERSIST_DELAY_S", "0.6")
    fc = make()
    assert fc.save(1, state(1), []).where == "shm"
    wait_state(fc, 1, "persisting")
    second = fc.save(2, state(2), [])  # the other slot
    assert (second.where, second.dropped_step) == ("shm", None)
    third = fc.save(3, state(3), [])  # slot of 1 busy, slot of 2 pending: 2 is replaced
    assert (third.where, third.dropped_step) == ("shm", 2) and "2" in third.note
    assert fc.wait_persisted(3).name == "step-00000003"
    with pytest.raises(FlashError, match="replaced"):
        fc.wait_persisted(2)
    assert fc.wait_persisted(1).name == "step-00000001"
    assert [i.step for i in list_checkpoints(fc.directory)] == [3, 1]


def test_without_replace_pending_a_save_keeps_the_pending_snapshot(make: Callable[..., FlashCheckpoint],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's worker has reported its pending snapshot to the master: a newer save is skipped."""
    monkeypatch.setenv("TIDAL_PERSIST_DELAY_S", "0.6")
    fc = make(replace_pending=False)
    fc.save(1, state(1), [])
    wait_state(fc, 1, "persisting")
    assert fc.save(2, state(2), []).where == "shm"
    skipped = fc.save(3, state(3), [])  # slot of 1 busy, slot of 2 pending and kept
    assert (skipped.where, skipped.dropped_step) == ("none", None) and "not yet persisted" in skipped.note
    assert fc.wait_persisted(2).name == "step-00000002"
    assert fc.wait_persisted(1).name == "step-00000001"
    assert [i.step for i in list_checkpoints(fc.directory)] == [2, 1]


def test_with_one_slot_a_save_during_persisting_is_skipped(make: Callable[..., FlashCheckpoint],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_PERSIST_DELAY_S", "0.6")
    fc = make(slots=1)
    fc.save(1, state(1), [])
    wait_state(fc, 1, "persisting")
    skipped = fc.save(2, state(2), [])
    assert skipped.where == "none" and skipped.dropped_step is None and "skipped" in skipped.note
    with pytest.raises(FlashError, match="skipped"):
        fc.wait_persisted(2)
    assert fc.wait_persisted(1).name == "step-00000001"
    assert fc.save(3, state(3), []).where == "shm"  # free again once persisted
    fc.wait_persisted(3)


def test_a_directory_that_cannot_be_created_is_reported_and_saving_goes_on(
        make: Callable[..., FlashCheckpoint], tmp_path: Path, name: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # mkdir under a regular file fails, as root too
    fc = make(blocker / "ckpt")
    assert fc.save(1, state(1), []).where == "shm"
    with pytest.raises(FlashError, match="cannot persist step 1"):
        fc.wait_persisted(1)
    assert len(fc.problems()) == 1 and str(blocker / "ckpt") in fc.problems()[0]
    assert fc.save(2, state(2), []).where == "shm"  # training keeps saving
    with pytest.raises(FlashError):
        fc.wait_persisted(2)
    assert blocker.read_text() == "not a directory" and list(tmp_path.iterdir()) == [blocker]
    loaded = load_latest(blocker / "ckpt", name=name)  # the snapshot stays in shared memory
    assert (loaded.source, loaded.step) == ("shm", 2)
    assert_same(loaded.tree, state(2))
    fc.close()
    assert len(list(SHM.glob(f"tidal-{name}-*"))) == 2  # not on disk: kept by close


def test_a_failed_write_leaves_the_previous_checkpoint_and_nothing_partial(
        make: Callable[..., FlashCheckpoint], tmp_path: Path) -> None:
    fc = make()
    fc.save(1, state(1), [])
    good = fc.wait_persisted(1)
    assert fc._proc is not None
    (tmp_path / "ckpt" / f".tmp-step-00000002-{fc._proc.pid}").write_text("in the way")  # mkdir fails
    fc.save(2, state(2), [])
    with pytest.raises(FlashError, match="cannot persist step 2"):
        fc.wait_persisted(2)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith(".")) == [good.name]
    verify(good)
    assert load_latest(tmp_path / "ckpt").step == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to a 0500 directory")
def test_a_read_only_directory_is_reported(make: Callable[..., FlashCheckpoint], tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    fc = make(directory)
    fc.save(1, state(1), [])
    fc.wait_persisted(1)
    directory.chmod(0o500)
    try:
        fc.save(2, state(2), [])
        with pytest.raises(FlashError, match="Permission denied"):
            fc.wait_persisted(2)
        assert fc.problems()
        assert [i.step for i in list_checkpoints(directory)] == [1]
    finally:
        directory.chmod(0o700)


def test_too_little_shared_memory_falls_back_to_disk(make: Callable[..., FlashCheckpoint], name: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tidal.worker.flash")
    fc = make(max_shm_bytes=4096)
    result = fc.save(1, state(1), [{"est": 0}], {"m": 1})
    assert result.where == "disk" and "max_shm_bytes" in result.note
    assert any("no room in shared memory" in r.getMessage() for r in caplog.records)
    assert fc.wait_persisted(1).name == "step-00000001"
    loaded = load_latest(fc.directory, name=name)
    assert (loaded.source, loaded.step, loaded.meta) == ("disk", 1, {"m": 1})
    assert_same(loaded.tree, state(1))
    assert not list(SHM.glob(f"*tidal-{name}-*"))


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[[str, int], Path]]:
    """Mounts tmpfs filesystems of a given size in KB (a real ENOSPC); unmounted after the test."""
    with tmpfs_mounts(tmp_path) as mount:
        yield lambda name, size_kb: mount(name, f"{size_kb}k")


def test_a_full_disk_is_reported_and_the_previous_checkpoint_stays(
        make: Callable[..., FlashCheckpoint], small_fs: Callable[[str, int], Path], name: str) -> None:
    disk = small_fs("disk", 256)
    fc = make(disk)
    fc.save(1, state(1), [])
    good = fc.wait_persisted(1)
    with open(disk / "filler", "wb", buffering=0) as f:  # fill it up
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    assert fc.save(2, state(2), []).where == "shm"
    with pytest.raises(FlashError, match="No space left on device"):
        fc.wait_persisted(2)
    assert sorted(p.name for p in disk.iterdir()) == ["filler", good.name]  # nothing partial
    assert load_latest(disk).step == 1
    loaded = load_latest(disk, name=name)  # the snapshot that did not fit stays in shared memory
    assert (loaded.source, loaded.step) == ("shm", 2)


def test_a_full_shared_memory_falls_back_to_disk(make: Callable[..., FlashCheckpoint],
                                                 small_fs: Callable[[str, int], Path], tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tidal.worker.flash")
    shm = small_fs("shm", 512)
    fc = make(shm_dir=shm)
    big = {"w": torch.randn(256 << 10)}  # 1 MiB: over the 512 KiB tmpfs
    result = fc.save(1, big, [])
    assert result.where == "disk" and "No space left on device" in result.note
    assert any("no room in shared memory" in r.getMessage() for r in caplog.records)
    assert list(shm.iterdir()) == []  # the half-made slot is gone
    assert torch.equal(load_latest(tmp_path / "ckpt").tree["w"], big["w"])
    assert fc.save(2, {"w": torch.randn(16)}, []).where == "shm"  # a state that fits goes to shm again
    fc.wait_persisted(2)


def test_list_checkpoints_verifies_each(make: Callable[..., FlashCheckpoint], tmp_path: Path) -> None:
    fc = make()
    for step in (4, 9):
        fc.save(step, state(step), [])
        fc.wait_persisted(step)
    infos = list_checkpoints(tmp_path / "ckpt")
    assert [(i.step, i.ok, i.problem) for i in infos] == [(9, True, None), (4, True, None)]
    assert infos[0].bytes == sum(p.stat().st_size for p in infos[0].path.iterdir()) and infos[0].mtime > 0
    tensors = infos[1].path / "tensors.safetensors"
    with open(tensors, "r+b") as f:
        f.truncate(tensors.stat().st_size // 2)
    infos = list_checkpoints(tmp_path / "ckpt")
    assert [(i.step, i.ok) for i in infos] == [(9, True), (4, False)]
    assert "tensors.safetensors does not match its manifest" in (infos[1].problem or "")
    assert list_checkpoints(tmp_path / "absent") == []


def test_a_format_1_checkpoint_still_loads(tmp_path: Path) -> None:
    path = checkpoint.save_checkpoint(tmp_path, 6, state(6), [{"est": 0}])
    (path / "meta.json").unlink()
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["files"]["meta.json"]
    (path / MANIFEST).write_text(json.dumps({**manifest, "format": 1}))
    loaded = load_latest(tmp_path)
    assert (loaded.step, loaded.meta, loaded.contexts) == (6, {}, [{"est": 0}])
    assert_same(loaded.tree, state(6))
    assert checkpoint.load_meta(path) == {} and list_checkpoints(tmp_path)[0].ok
    (path / "meta.json").write_text("{}")  # a file format 1 does not have
    with pytest.raises(CheckpointError, match=r"meta\.json not listed"):
        verify(path)


def test_close_removes_the_slots_once_on_disk(make: Callable[..., FlashCheckpoint], name: str) -> None:
    fc = make()
    fc.save(1, state(1), [])
    fc.save(2, state(2), [])
    fc.close()
    assert not list(SHM.glob(f"*tidal-{name}-*"))
    assert [i.step for i in list_checkpoints(fc.directory) if i.ok] == [2, 1]
    with pytest.raises(FlashError, match="closed"):
        fc.save(3, state(3), [])


def test_without_persisting_the_slots_stay_for_a_resume(make: Callable[..., FlashCheckpoint], name: str) -> None:
    fc = make(persist=False)
    for step in (1, 2, 3):
        assert fc.save(step, state(step), []).dropped_step is None
    fc.close()
    loaded = load_latest(fc.directory, name=name)
    assert (loaded.source, loaded.step) == ("shm", 3)
    assert_same(loaded.tree, state(3))
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        load_latest(fc.directory)


def test_load_step_finds_exactly_that_step_in_any_worker_of_the_job(tmp_path: Path) -> None:
    """A resume loads the step the master rolls the data back to: from the slots any worker of the
    job left (the saver of the round may have been any), else from disk; only of the lineage asked."""
    job = f"t{uuid.uuid4().hex[:8]}"
    ckpt = tmp_path / "ckpt"
    try:
        with FlashCheckpoint(ckpt, name=f"{job}-w3", persist=False) as w3, \
                FlashCheckpoint(ckpt, name=f"{job}-w7") as w7:
            w3.save(4, state(4), [], {"lineage": 0})
            w7.save(9, state(9), [], {"lineage": 0})
            w7.wait_persisted(9, timeout=30)
            w7.save(12, state(12), [], {"lineage": 1})
            got = load_step(ckpt, 4, job=job)
            assert (got.step, got.source) == (4, "shm") and got.path.name.startswith(f"tidal-{job}-w3-")
            assert_same(got.tree, state(4))
            assert load_step(ckpt, 9, job=job, lineage=0).step == 9
            with pytest.raises(CheckpointError, match="of step 12"):
                load_step(ckpt, 12, job=job, lineage=0)  # a step the job rolled back from
            assert load_step(ckpt, 12, job=job, lineage=1).step == 12
            with pytest.raises(CheckpointError, match="no valid checkpoint of step 5"):
                load_step(ckpt, 5, job=job)
            remove_shm(f"{job}-w7")
            disk = load_step(ckpt, 9, job=job)  # its slot is gone: the persisted copy
            assert (disk.step, disk.source) == (9, "disk")
            assert_same(disk.tree, state(9))
    finally:
        for worker in ("w3", "w7"):
            remove_shm(f"{job}-{worker}")


def test_keep_prunes_the_oldest_checkpoints_after_each_write(make: Callable[..., FlashCheckpoint],
                                                             tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    fc = make(keep=2)
    for step in (3, 5, 9, 12):
        fc.save(step, state(step), [], {})
        fc.wait_persisted(step, timeout=30)
    deadline = time.monotonic() + 10
    def pruned() -> bool:
        return ([c.step for c in list_checkpoints(ckpt)] == [12, 9]
                and not [p for p in ckpt.iterdir() if p.name.startswith(".")])
    while not pruned() and time.monotonic() < deadline:
        time.sleep(0.01)  # the prune (rename, then delete) follows the "persisted" event
    assert [(c.step, c.ok) for c in list_checkpoints(ckpt)] == [(12, True), (9, True)]
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]  # nothing half-deleted left
    with pytest.raises(ValueError, match="keep"):
        FlashCheckpoint(ckpt, name="x", keep=-1)


def test_keep_spares_the_checkpoint_the_master_would_resume_from(make: Callable[..., FlashCheckpoint],
                                                                 tmp_path: Path) -> None:
    """A snapshot's ``keep_from`` (the master's resume candidate, learnt late): neither it nor a
    newer one is deleted, however many are newer; the bound moves with each save."""
    ckpt = tmp_path / "ckpt"
    fc = make(keep=1)
    for step in (3, 5):
        fc.save(step, state(step), [], {"keep_from": -1})  # the master knows no checkpoint yet: none is deleted
        fc.wait_persisted(step, timeout=30)
    for step in (9, 12):
        fc.save(step, state(step), [], {"keep_from": 5})
        fc.wait_persisted(step, timeout=30)
    deadline = time.monotonic() + 10
    while [c.step for c in list_checkpoints(ckpt)] != [12, 9, 5] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [c.step for c in list_checkpoints(ckpt)] == [12, 9, 5]  # 3 is older than the candidate 5
