"""The flash checkpoint's persister: writes the snapshots a saver left in shared memory to disk.

``tidal.worker.flash.FlashCheckpoint`` starts one per saver, in a session of its own so that a
signal to the saver's process group, or the saver's SIGKILL, does not reach it, as
``python -P .../tidal/worker/persister.py`` (``python -m tidal.worker.persister`` works too, but
imports ``tidal.worker``, hence torch: seconds and hundreds of MB for a process that needs none
of it). This module uses only the standard library, and ``flash`` takes the slot layout from it.

A slot is one file ``<shm_dir>/tidal-<name>-<index>``: a control header of ``HEADER_BYTES``
(``Header``: magic, version, state, the sequence number written at the start and again at the end
of a save, step, the lengths of the payload's parts, the payload's CRC-32 once the persister has
computed it, the checkpoint directory), then the payload: a safetensors file byte for byte, the
JSON skeleton, the JSON contexts and the JSON meta. The saver holds an exclusive ``flock`` on the
slot while it writes it (state FILLING, then READY last); the persister and loaders hold a shared
one while they read it, so the saver never overwrites a slot that is being read: it takes another
or skips (see ``flash``).

Protocol. The saver writes one JSON line per save on the persister's stdin (``{"slot": i, "seq":
n, "step": s}``, a hint: the persister scans every slot for READY ones anyway) and
``{"op": "close"}`` when it closes. The persister writes JSON lines on its stdout: ``{"event":
"persisted", ...}``, ``{"event": "problem", ...}`` (a disk error: the slot is marked FAILED and
stays in shared memory, the previous checkpoint on disk stays), ``{"event": "closed"}``. When
its stdin closes or its parent is gone it writes every READY slot, then exits; it removes the
slot files only when the saver asked to close, and only those whose snapshot is on disk (or that
hold none).

A checkpoint is written as ``tidal.worker.checkpoint`` writes one (format 2): each file under a
temporary directory, hashed while it is written, the manifest last, everything fsynced, then
renamed into place; a failure removes the temporary directory, so no partial checkpoint is ever
visible.

``TIDAL_PERSIST_DELAY_S`` (tests only) makes it sleep that long before writing each snapshot.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import json
import mmap
import os
import queue
import shutil
import struct
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ------------------------------------------------------------------ the on-disk format (checkpoint.py)
# tidal.worker.checkpoint imports torch; these equal its constants (tests/worker/test_flash.py checks)
MANIFEST = "manifest.json"
FORMAT = 2
FILES = ("tensors.safetensors", "skeleton.json", "contexts.json", "meta.json")

# ------------------------------------------------------------------ the slot layout
MAGIC = b"TIDALFC\x00"
VERSION = 1
HEADER_BYTES = 4096  # the payload starts page-aligned
EMPTY, FILLING, READY, PERSISTING, PERSISTED, FAILED = range(6)
STATE_NAMES = {EMPTY: "empty", FILLING: "filling", READY: "ready", PERSISTING: "persisting",
               PERSISTED: "persisted", FAILED: "failed"}
# a snapshot a loader may use: written to the end (FAILED: its persisting failed, it is whole)
INTACT = (READY, PERSISTING, PERSISTED, FAILED)

# magic, version, state, seq_begin, seq_end, step, st_len, skel_len, ctx_len, meta_len, crc, crc_ok,
# saved_at, dir_len
_HEAD = struct.Struct("<8sIIQQqQQQQIIdI")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_COMMIT = struct.Struct("<qQQQQ")  # step and the four lengths
_CRC = struct.Struct("<II")  # crc, crc_ok
_TIME = struct.Struct("<d")
STATE_AT, SEQ_BEGIN_AT, SEQ_END_AT, COMMIT_AT, CRC_AT, TIME_AT, DIR_LEN_AT = 12, 16, 24, 32, 72, 80, 88
DIR_AT = 256
MAX_DIR_BYTES = HEADER_BYTES - DIR_AT
CHUNK = 16 << 20


@dataclass(frozen=True)
class Header:
    """A slot's control header."""

    magic: bytes
    version: int
    state: int
    seq_begin: int
    seq_end: int
    step: int
    st_len: int
    skel_len: int
    ctx_len: int
    meta_len: int
    crc: int
    crc_ok: bool
    saved_at: float
    directory: str

    @property
    def payload_len(self) -> int:
        return self.st_len + self.skel_len + self.ctx_len + self.meta_len

    def problem(self, size: int) -> str | None:
        """Why the slot holds no whole snapshot (``size``: the file's length), or None."""
        if self.magic != MAGIC:
            return "not a tidal flash checkpoint slot"
        if self.version != VERSION:
            return f"slot format {self.version}, this tidal reads {VERSION}"
        if self.state not in INTACT:
            return f"state {STATE_NAMES.get(self.state, self.state)}: the saver had not finished writing it"
        if self.seq_begin != self.seq_end:
            return f"torn: begun as save {self.seq_begin}, ended as {self.seq_end}"
        if HEADER_BYTES + self.payload_len > size:
            return f"payload of {self.payload_len} bytes does not fit in a slot of {size}"
        return None


def read_header(buf: Any) -> Header | None:
    """The header at the start of ``buf`` (an mmap or bytes), or None when it is too short."""
    if len(buf) < HEADER_BYTES:
        return None
    (magic, version, state, seq_begin, seq_end, step, st_len, skel_len, ctx_len, meta_len, crc, crc_ok,
     saved_at, dir_len) = _HEAD.unpack_from(buf, 0)
    raw = bytes(buf[DIR_AT:DIR_AT + min(dir_len, MAX_DIR_BYTES)])
    return Header(magic, version, state, seq_begin, seq_end, step, st_len, skel_len, ctx_len, meta_len, crc,
                  bool(crc_ok), saved_at, raw.decode("utf-8", "replace"))


def peek_header(path: Path) -> tuple[Header | None, int]:
    """(header, file size) of the slot file ``path`` without locking or mapping it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_header(os.pread(fd, HEADER_BYTES, 0)), os.fstat(fd).st_size
    finally:
        os.close(fd)


def init_header(buf: Any, directory: str) -> None:
    """A fresh slot's header: EMPTY, of ``directory`` (its resolved path)."""
    raw = directory.encode()
    if len(raw) > MAX_DIR_BYTES:
        raise ValueError(f"checkpoint directory path over {MAX_DIR_BYTES} bytes")
    buf[0:HEADER_BYTES] = bytes(HEADER_BYTES)
    _HEAD.pack_into(buf, 0, MAGIC, VERSION, EMPTY, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0.0, len(raw))
    buf[DIR_AT:DIR_AT + len(raw)] = raw


def set_state(buf: Any, state: int) -> None:
    _U32.pack_into(buf, STATE_AT, state)


def begin_fill(buf: Any, seq: int) -> None:
    """First write of a save: the slot is FILLING (torn until ``end_fill``), sequence ``seq``."""
    set_state(buf, FILLING)
    _U64.pack_into(buf, SEQ_BEGIN_AT, seq)
    _CRC.pack_into(buf, CRC_AT, 0, 0)


def end_fill(buf: Any, seq: int, step: int, st_len: int, skel_len: int, ctx_len: int, meta_len: int) -> None:
    """Last writes of a save, after the payload: lengths, step, sequence, then READY."""
    _COMMIT.pack_into(buf, COMMIT_AT, step, st_len, skel_len, ctx_len, meta_len)
    _TIME.pack_into(buf, TIME_AT, time.time())
    _U64.pack_into(buf, SEQ_END_AT, seq)
    set_state(buf, READY)


def slot_path(shm_dir: str | Path, name: str, index: int) -> Path:
    return Path(shm_dir) / f"tidal-{name}-{index}"


# ------------------------------------------------------------------ writing a checkpoint
def write_checkpoint(buf: Any, head: Header, directory: Path) -> tuple[Path, int]:
    """Write the snapshot in ``buf`` (a slot's mmap) as checkpoint ``head.step`` of ``directory``.

    Returns (its path, CRC-32 of the payload). Raises OSError; then nothing of it is left.
    """
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{head.step:08d}"
    tmp = directory / f".tmp-step-{head.step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    view = memoryview(buf)
    try:
        tmp.mkdir()
        crc, at, digests = 0, HEADER_BYTES, {}
        for name, length in zip(FILES, (head.st_len, head.skel_len, head.ctx_len, head.meta_len), strict=True):
            digest = hashlib.sha256()
            fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                end = at + length
                while at < end:
                    with view[at:min(at + CHUNK, end)] as chunk:
                        digest.update(chunk)
                        crc = zlib.crc32(chunk, crc)
                        done = 0
                        while done < len(chunk):
                            done += os.write(fd, chunk[done:])
                        at += len(chunk)
                os.fsync(fd)
            finally:
                os.close(fd)
            digests[name] = digest.hexdigest()
        manifest = json.dumps({"format": FORMAT, "step": head.step, "files": digests}, indent=1).encode()
        fd = os.open(tmp / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, manifest)
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(tmp)
        publish(tmp, final)
        _fsync_dir(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        view.release()
    return final, crc


def publish(tmp: Path, final: Path) -> None:
    """Rename the written checkpoint directory ``tmp`` to ``final``.

    A checkpoint of the same step already there (written again, or by another process at the same
    moment: a persister and the final checkpoint of one step) is swapped out, never deleted before
    its replacement is in place; whichever writer renames last wins, and both are whole.
    """
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    try:
        for _ in range(16):
            try:
                os.replace(tmp, final)
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            shutil.rmtree(old, ignore_errors=True)
            try:
                os.replace(final, old)
            except FileNotFoundError:  # the other writer moved it first
                pass
        raise OSError(errno.EBUSY, f"{final} kept being replaced by another writer")
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ the process
class Persister:
    def __init__(self, directory: Path, name: str, shm_dir: Path, slots: int, keep: int = 0) -> None:
        self.directory = directory
        self.name = name
        self.shm_dir = shm_dir
        self.slots = slots
        self.keep = keep  # checkpoints kept on disk, the newest by step (0: all)
        self.delay = float(os.environ.get("TIDAL_PERSIST_DELAY_S", "0") or 0)
        self._out_ok = True

    def emit(self, **event: Any) -> None:
        if not self._out_ok:
            return
        try:
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()
        except (OSError, ValueError):  # the saver is gone: nobody reads; carry on writing checkpoints
            self._out_ok = False
            with contextlib.suppress(OSError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)

    def pending(self) -> list[int]:
        """Slots holding a snapshot to persist, oldest save first."""
        found = []
        for index in range(self.slots):
            try:
                head, size = peek_header(slot_path(self.shm_dir, self.name, index))
            except OSError:
                continue
            if (head is not None and head.state in (READY, PERSISTING) and head.problem(size) is None
                    and head.directory == str(self.directory)):
                found.append((head.seq_end, index))
        return [index for _, index in sorted(found)]

    def persist_all(self) -> None:
        """Persist READY slots until none is left (the saver may fill one meanwhile)."""
        while True:
            progressed = False
            for index in self.pending():
                progressed |= self.persist(index)
            if not progressed:
                return

    def persist(self, index: int) -> bool:
        """Write slot ``index`` to disk if it holds a READY snapshot; whether it did (or failed).

        The slot's lock is released before the outcome is announced, so that a saver told
        "persisted" finds the slot free for its next snapshot."""
        path = slot_path(self.shm_dir, self.name, index)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return False
        written: Path | None = None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while the saver fills it
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                return False
            buf = mmap.mmap(fd, size)
            try:
                head = read_header(buf)
                if (head is None or head.state not in (READY, PERSISTING) or head.problem(size) is not None
                        or head.directory != str(self.directory)):
                    return False
                set_state(buf, PERSISTING)
                if self.delay:
                    time.sleep(self.delay)
                start = time.perf_counter()
                try:
                    written, crc = write_checkpoint(buf, head, self.directory)
                except OSError as exc:
                    with memoryview(buf)[HEADER_BYTES:HEADER_BYTES + head.payload_len] as payload:
                        crc = zlib.crc32(payload)
                    _CRC.pack_into(buf, CRC_AT, crc, 1)
                    set_state(buf, FAILED)
                    outcome = dict(event="problem", step=head.step, slot=index,
                                   error=f"cannot persist step {head.step} to {self.directory}: {exc}")
                else:
                    _CRC.pack_into(buf, CRC_AT, crc, 1)
                    set_state(buf, PERSISTED)
                    outcome = dict(event="persisted", step=head.step, slot=index, path=str(written),
                                   seconds=round(time.perf_counter() - start, 6), bytes=head.payload_len)
            finally:
                buf.close()
        finally:
            os.close(fd)  # releases the lock
        self.emit(**outcome)
        if written is not None and self.keep:
            pruned = prune(self.directory, self.keep, written, _keep_from(written))
            if pruned:
                self.emit(event="pruned", steps=pruned)
        return True

    def remove_slots(self) -> None:
        for index, step, path in remove_slots(self.shm_dir, self.name, self.slots):
            self.emit(event="kept", slot=index, step=step, path=str(path))


def prune(directory: Path, keep: int, written: Path, keep_from: int | None = None) -> list[int]:
    """Delete the checkpoints of ``directory`` past the ``keep`` newest (by step), never the one
    just ``written`` nor one of step ``keep_from`` or newer (the master's resume candidate, which
    may be older than the ``keep`` newest); the steps deleted. Another saver's persister may
    prune the same directory: a directory already gone is no error."""
    steps = sorted((int(p.name[5:]), p) for p in directory.glob("step-*") if p.name[5:].isdigit())
    doomed = [(step, path) for step, path in steps[:-keep]
              if path != written and (keep_from is None or step < keep_from)]
    for _, path in doomed:
        # renamed first, so that a reader never sees a half-deleted checkpoint under its step's name
        trash = directory / f".old-{path.name}-{os.getpid()}"
        try:
            os.replace(path, trash)
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
    return [step for step, _ in doomed]


def _keep_from(written: Path) -> int | None:
    """The bound the saver put in the snapshot's meta (``"keep_from"``), or None."""
    try:
        value = json.loads((written / "meta.json").read_text()).get("keep_from")
    except (OSError, ValueError, AttributeError):
        return None
    return value if type(value) is int else None


def remove_slots(shm_dir: Path, name: str, slots: int) -> list[tuple[int, int, Path]]:
    """Unlink the slot files whose snapshot is on disk or that hold none (the saver closed);
    returns (index, step, path) of those kept: a whole snapshot not on disk."""
    kept = []
    for index in range(slots):
        path = slot_path(shm_dir, name, index)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody reads or writes it
            head = read_header(os.pread(fd, HEADER_BYTES, 0))
            if (head is not None and head.state in (READY, PERSISTING, FAILED)
                    and head.problem(os.fstat(fd).st_size) is None):
                kept.append((index, head.step, path))
                continue
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tidal.worker.persister", description="Persist flash checkpoint slots.")
    parser.add_argument("--directory", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--shm-dir", required=True)
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--keep", type=int, default=0, help="checkpoints kept on disk, the newest (0: all)")
    parser.add_argument("--parent", type=int, required=True, help="the saver's pid")
    args = parser.parse_args(argv)
    persister = Persister(Path(args.directory), args.name, Path(args.shm_dir), args.slots, args.keep)

    inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def read() -> None:  # a thread, so the saver's pipe never fills while a checkpoint is written
        # os.read, not sys.stdin: a daemon thread blocked inside a buffered reader at exit is fatal
        pending = b""
        while True:
            try:
                chunk = os.read(0, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                if isinstance(message, dict):
                    inbox.put(message)
        inbox.put(None)

    threading.Thread(target=read, name="persister-inbox", daemon=True).start()
    closing = done = False
    while not done:
        try:
            message = inbox.get(timeout=0.5)
        except queue.Empty:
            done = os.getppid() != args.parent  # the saver died (a forked child may hold its pipe)
            message = {}
        while True:  # take every queued hint: one scan serves them all
            if message is None:
                done = True
            elif message.get("op") == "close":
                closing = done = True
            try:
                message = inbox.get_nowait()
            except queue.Empty:
                break
        persister.persist_all()
    persister.persist_all()
    if closing:
        persister.remove_slots()
    persister.emit(event="closed" if closing else "exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
