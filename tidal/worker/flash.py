"""Flash checkpoint: copy the state into shared memory, persist it to disk in another process.

DLRover-RM 5.2 (DESIGN.md 4, 5). ``FlashCheckpoint.save`` blocks training only for a memory copy:
each tensor is ``copy_``-ed into a torch view of a shared-memory slot (``/dev/shm/tidal-<name>-<i>``)
laid out as a safetensors file; the small JSON parts (skeleton, contexts, meta) follow it. No
hashing, no serialization of tensors, no allocation of big buffers on that path: a slot is created
(and its pages reserved and mapped) on first use and reused while the layout (tensor paths,
dtypes, shapes) is the same. The persister (``tidal.worker.persister``, a process in a session of
its own) writes each ready slot to disk as a checkpoint of ``tidal.worker.checkpoint``'s format:
one sequential write of the safetensors part, hashed while written, the manifest last, fsync,
rename. It outlives a SIGKILL of the saver: it notices the saver's pipe close, writes what is
ready, and exits. Role-neutral: a worker and a parameter server save through the same API.

Slots (2 by default). A slot is free when it is empty, torn, persisted, or failed to persist; it
is pending when it holds a snapshot the persister has not started; it is busy while the
persister (or a loader) reads it (a shared ``flock``; the saver writes under an exclusive one).
A save takes the free slot holding the oldest snapshot; with none free it REPLACES the oldest
pending snapshot (``SaveResult.dropped_step``): only the newest snapshot matters for a resume,
and a disk that cannot keep up must not pile up snapshots nor block training. With every slot
busy (``slots=1`` while the persister writes it) the save is SKIPPED (``where="none"``, said in
``note``): training never waits on the disk. ``replace_pending=False`` skips instead of
replacing: a job's worker has told its master of the pending snapshot, and the master may
already have chosen it to resume from (``PeriodicCheckpoint``). With two slots, a save always
leaves the previous snapshot intact in the other slot, so a crash in the middle of a copy loses
only that copy.

Integrity. The saver marks a slot FILLING with the save's sequence number first and READY with it
again last; a slot left FILLING (the saver died during the copy) is torn and skipped. The CRC-32
of the payload is computed by the persister while it writes (never on the hot path) and stored
in the slot; ``load_latest`` recomputes it. A snapshot the persister has not reached yet has no
CRC: it is trusted on its READY mark (the memory of a process is not checksummed either).

Fallback. When the slots would not fit (``max_shm_bytes``, or ``/dev/shm`` full: the pages are
reserved with ``posix_fallocate`` so a full tmpfs is an error here, not a SIGBUS during the copy),
the save writes the checkpoint to disk synchronously (``where="disk"``) and logs a warning (once
per reason). ``max_shm_bytes`` bounds the shared memory of all slots together.

Disk errors (ENOSPC, EACCES, a directory that cannot be created) are reported by the persister
(``problems()``, ``wait_persisted`` raises); the previous checkpoint on disk stays, and the
snapshot stays in shared memory (state FAILED), where ``load_latest`` still finds it.

CUDA tensors are copied device-to-host straight into the slot: the slot's mapping is registered
as page-locked memory (``cudaHostRegister``) on the first save of CUDA tensors into it, so the
copies are DMA, issued asynchronously and synchronized once before the slot is marked READY. A
failed registration falls back to synchronous copies into pageable memory. (Written for the
issue's CUDA point; no session has had a GPU to run it yet.)

One thread saves: ``save`` is not meant to be called concurrently on one ``FlashCheckpoint``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import mmap
import os
import re
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tidal.api.frames import DTYPES
from tidal.api.shm import job_slot_pattern
from tidal.worker import persister as slotfmt
from tidal.worker.checkpoint import MANIFEST, CheckpointError, save_checkpoint, verify
from tidal.worker.state import join_tree, split_tree

__all__ = ["CheckpointInfo", "FlashCheckpoint", "FlashError", "Loaded", "PeriodicCheckpoint", "SaveResult",
           "list_checkpoints", "load_latest", "load_step", "remove_shm"]

log = logging.getLogger(__name__)

_WIRE = {dtype: name for name, dtype in DTYPES.items()}  # the skeleton's dtype names (state.split_tree)
_SAFETENSORS = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
                torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32",
                torch.int64: "I64", torch.bool: "BOOL"}
_FROM_SAFETENSORS = {v: k for k, v in _SAFETENSORS.items()}
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
_PAGE = 4096
_MIN_JSON_BYTES = 64 << 10


class FlashError(RuntimeError):
    """A snapshot that will not reach the disk (dropped, skipped, a disk error, no persister)."""


@dataclass(frozen=True)
class SaveResult:
    """What ``save`` did. ``where``: "shm" (persisted later), "disk" (written synchronously, the
    fallback), "none" (skipped: every slot busy, or the fallback's disk write failed)."""

    step: int
    blocked_s: float
    nbytes: int
    where: str
    dropped_step: int | None = None
    note: str = ""


@dataclass(frozen=True)
class Loaded:
    tree: Any
    contexts: list[dict[str, Any]]
    meta: dict[str, Any]
    step: int
    source: str  # "shm" | "disk"
    path: Path  # the slot file or the checkpoint directory


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    bytes: int
    mtime: float
    ok: bool
    problem: str | None


# ----------------------------------------------------------------------------- the tree
def _walk(tree: Any) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """(JSON skeleton, tensors in tree order) as ``state.split_tree``, without copying a tensor."""
    skeleton, tensors = split_tree(tree, copy=False)
    return skeleton, list(tensors.items())


class _Layout:
    """Where each tensor lies in a slot's safetensors part, for one set of (path, dtype, shape).

    Tensors are stored by decreasing item size (as safetensors does), so every one is aligned to
    its item size: the safetensors header is padded to 8 bytes and the payload is page-aligned.
    """

    def __init__(self, key: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]) -> None:
        self.key = key
        sizes = [math.prod(shape) * torch.empty(0, dtype=dtype).element_size() for _, dtype, shape in key]
        order = sorted(range(len(key)), key=lambda i: (-torch.empty(0, dtype=key[i][1]).element_size(), key[i][0]))
        spans: list[tuple[int, int]] = [(0, 0)] * len(key)
        header: dict[str, Any] = {}
        at = 0
        for i in order:
            path, dtype, shape = key[i]
            spans[i] = (at, at + sizes[i])
            header[path] = {"dtype": _SAFETENSORS[dtype], "shape": list(shape), "data_offsets": [at, at + sizes[i]]}
            at += sizes[i]
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 8)
        self.header = len(raw).to_bytes(8, "little") + raw
        self.data_at = len(self.header)  # where the tensors' bytes start in the safetensors part
        self.spans = spans  # per tensor in tree order, relative to data_at
        self.st_len = self.data_at + at
        self.nbytes = at


class _Slot:
    def __init__(self, index: int, path: Path) -> None:
        self.index = index
        self.path = path
        self.fd: int | None = None
        self.mm: mmap.mmap | None = None
        self.size = 0
        self.layout: _Layout | None = None
        self.views: list[torch.Tensor | None] = []
        self.json_cap = 0
        self.pinned: torch.Tensor | None = None  # the mapping as a tensor, registered with CUDA

    def pin(self) -> bool:
        """Register the slot's mapping as page-locked memory with CUDA (``cudaHostRegister``), so
        that device-to-host copies into it are DMA at full bandwidth and can be asynchronous.
        Whether it is registered (a failure is logged: the copy is then a plain synchronous one).
        Not verified on a GPU yet: no session of this project had one."""
        if self.pinned is not None:
            return True
        assert self.mm is not None
        whole = torch.frombuffer(self.mm, dtype=torch.uint8)
        err = torch.cuda.cudart().cudaHostRegister(whole.data_ptr(), whole.numel(), 0)
        if int(err) != 0:
            log.warning("flash checkpoint slot %s: cudaHostRegister failed (%s); copying from the device "
                        "into pageable memory", self.path, err)
            return False
        self.pinned = whole
        return True

    def state(self) -> tuple[int, int, int]:
        """(state, seq, step) from the header, read without the lock."""
        assert self.mm is not None
        head = slotfmt.read_header(self.mm)
        assert head is not None
        return head.state, head.seq_end if head.state in slotfmt.INTACT else -1, head.step

    def release(self) -> None:
        if self.pinned is not None:
            torch.cuda.cudart().cudaHostUnregister(self.pinned.data_ptr())
            self.pinned = None
        self.views = []
        self.layout = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view still alive somewhere: the mapping goes with it
                log.debug("slot %s still has views; leaving its mapping to the garbage collector", self.path)
            self.mm = None
        if self.fd is not None:
            os.close(self.fd)  # releases its lock
            self.fd = None


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class _NoRoom(Exception):
    pass


# ----------------------------------------------------------------------------- saving
class FlashCheckpoint:
    """Snapshots of a state tree in shared memory, persisted to ``directory`` asynchronously."""

    def __init__(self, directory: str | Path, *, name: str, slots: int = 2, shm_dir: str | Path = "/dev/shm",
                 max_shm_bytes: int | None = None, persist: bool = True, keep: int = 0,
                 replace_pending: bool = True) -> None:
        """``keep``: the persister deletes the checkpoints of ``directory`` past the ``keep`` newest
        (by step) after each it writes; 0 keeps every one. A snapshot's ``meta`` may bound that
        with ``"keep_from": s``: no checkpoint of step ``s`` or newer is deleted after it is
        written (``tidal.worker.persister.prune``). ``replace_pending``: whether a save with no
        free slot may overwrite a snapshot not yet persisted (else it is skipped)."""
        if not _NAME.fullmatch(name):
            raise ValueError(f"name {name!r}: use 1 to 100 of A-Z a-z 0-9 _ . -")
        if slots < 1:
            raise ValueError("slots must be at least 1")
        if keep < 0:
            raise ValueError("keep must be 0 (every checkpoint) or more")
        self.keep = keep
        self.directory = Path(directory).resolve()
        self.name = name
        self.shm_dir = Path(shm_dir)
        self.max_shm_bytes = max_shm_bytes
        self.persist = persist
        self.replace_pending = replace_pending
        self._slots = [_Slot(i, slotfmt.slot_path(self.shm_dir, name, i)) for i in range(slots)]
        self._layout: _Layout | None = None
        self._seq = self._last_seq() + 1
        self._cond = threading.Condition()
        self._creating = threading.Lock()  # held while slots are created (in save, or ahead in the background)
        self._status: dict[int, tuple[str, Any]] = {}  # step -> ("pending" | "persisted" | "failed" | ..., detail)
        self._problems: list[str] = []
        self._warned: set[str] = set()
        self._closed = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._to_persister: int | None = None  # the write end of the persister's stdin
        self._reader: threading.Thread | None = None
        if persist:
            self._start_persister()

    # -- the persister
    def _start_persister(self) -> None:
        script = Path(slotfmt.__file__)
        # raw pipes read with os.read: a daemon thread blocked in a buffered reader (Popen's
        # stdout) makes the interpreter abort at exit when the saver never calls close()
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-P", str(script), "--directory", str(self.directory), "--name", self.name,
                 "--shm-dir", str(self.shm_dir), "--slots", str(len(self._slots)), "--parent", str(os.getpid()),
                 "--keep", str(self.keep)],
                stdin=stdin_r, stdout=stdout_w, start_new_session=True, close_fds=True)
        except BaseException:
            for fd in (stdin_w, stdout_r):
                os.close(fd)
            raise
        finally:
            os.close(stdin_r)
            os.close(stdout_w)
        os.set_blocking(stdin_w, False)
        self._to_persister = stdin_w
        self._reader = threading.Thread(target=self._read_events, args=(stdout_r,), name=f"flash-{self.name}",
                                        daemon=True)
        self._reader.start()

    def _read_events(self, fd: int) -> None:
        try:
            for line in _lines(fd):
                self._on_event(line)
        finally:
            os.close(fd)
            with self._cond:
                self._cond.notify_all()

    def _on_event(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        if isinstance(event, dict):
            with self._cond:
                kind = event.get("event")
                if kind == "persisted":
                    self._status[int(event["step"])] = ("persisted", Path(event["path"]))
                elif kind == "problem":
                    self._status[int(event["step"])] = ("failed", event["error"])
                    self._problems.append(str(event["error"]))
                    log.warning("flash checkpoint %s: %s", self.name, event["error"])
                elif kind == "kept":
                    log.warning("flash checkpoint %s: step %s is not on disk; kept in %s", self.name,
                                event.get("step"), event.get("path"))
                self._cond.notify_all()

    def _notify(self, message: dict[str, Any]) -> None:
        if self._to_persister is None:
            return
        try:
            os.write(self._to_persister, json.dumps(message).encode() + b"\n")
        except BlockingIOError:  # a hint only: the persister scans every slot on the next one
            pass
        except OSError as exc:
            self._problem(f"the persister is gone ({exc.strerror}); snapshots stay in shared memory only")

    def _problem(self, text: str) -> None:
        with self._cond:
            if text not in self._problems:
                self._problems.append(text)
                log.warning("flash checkpoint %s: %s", self.name, text)

    def _last_seq(self) -> int:
        seq = 0
        for slot in self._slots:
            try:
                head, _ = slotfmt.peek_header(slot.path)
            except OSError:
                continue
            if head is not None and head.magic == slotfmt.MAGIC:
                seq = max(seq, head.seq_begin, head.seq_end)
        return seq

    # -- save
    def save(self, step: int, tree: Any, contexts: list[dict[str, Any]],
             meta: dict[str, Any] | None = None) -> SaveResult:
        """Snapshot ``tree`` (tensors and JSON values), the contexts and ``meta`` as ``step``.

        Blocks for the copy into shared memory (or, on the fallback, the disk write); never for
        the persister. Raises TypeError for a tree that cannot be checkpointed, ValueError for a
        negative step, FlashError after ``close``.
        """
        if self._closed:
            raise FlashError("save on a closed FlashCheckpoint")
        if type(step) is not int or step < 0:
            raise ValueError(f"step {step!r}: a checkpoint's step is an int >= 0")
        start = time.perf_counter()
        skeleton, tensors = _walk(tree)
        key = tuple((path, t.dtype, tuple(t.shape)) for path, t in tensors)
        blobs = (json.dumps(skeleton).encode(), json.dumps(contexts).encode(), json.dumps(meta or {}).encode())
        if self._layout is None or self._layout.key != key:
            self._layout = _Layout(key)
        layout = self._layout
        json_len = sum(len(b) for b in blobs)
        with self._creating:  # a slot the background is still creating is waited for, not raced
            slot, dropped = self._pick()
            if slot is None:
                note = (f"skipped: every shared-memory slot ({len(self._slots)}) is being persisted or read"
                        + ("" if self.replace_pending else " or holds a snapshot not yet persisted")
                        + "; training does not wait for the disk")
                self._set_status(step, ("skipped", note))
                return SaveResult(step, time.perf_counter() - start, layout.nbytes, "none", None, note)
            try:
                if slot.layout is not layout or slot.json_cap < json_len:
                    self._create(slot, layout, json_len)
                    self._precreate(layout, json_len)
            except (_NoRoom, OSError) as exc:
                self._unlock(slot)
                reason = str(exc) if isinstance(exc, _NoRoom) else f"cannot create {slot.path}: {exc.strerror or exc}"
                return self._save_to_disk(step, tree, contexts, meta, start, layout.nbytes, reason)
        assert slot.mm is not None
        buf = slot.mm
        seq = self._seq
        self._seq += 1
        try:
            slotfmt.begin_fill(buf, seq)  # a failure from here on leaves the slot FILLING: torn
            on_gpu = any(src.is_cuda for _, src in tensors)
            asynchronous = on_gpu and slot.pin()
            with torch.no_grad():
                for dst, (_, src) in zip(slot.views, tensors, strict=True):
                    if dst is not None:
                        dst.copy_(src, non_blocking=asynchronous and src.is_cuda)
            if asynchronous:
                torch.cuda.synchronize()  # every copy into the slot has landed before it is marked READY
            at = slotfmt.HEADER_BYTES + layout.st_len
            for blob in blobs:
                buf[at:at + len(blob)] = blob
                at += len(blob)
            slotfmt.end_fill(buf, seq, step, layout.st_len, *(len(b) for b in blobs))
        finally:
            self._unlock(slot)
        if dropped is not None:
            self._set_status(dropped, ("dropped", f"step {dropped} was replaced by step {step} before it was "
                                                  "persisted"))
        self._set_status(step, ("pending", None) if self.persist else ("in memory", None))
        self._notify({"slot": slot.index, "seq": seq, "step": step})
        note = f"replaced step {dropped}, not yet persisted" if dropped is not None else ""
        return SaveResult(step, time.perf_counter() - start, layout.nbytes, "shm", dropped, note)

    def _precreate(self, layout: _Layout, json_len: int) -> None:
        """Create the other slots for ``layout`` in a background thread, so that the next saves do
        not block for it (reserving and mapping the pages costs about 1 s per GB here). A save
        that comes before they are ready waits for them (``_creating``); a slot that cannot be
        created now is created on use, or the save falls back to disk, as without this."""
        others = [slot for slot in self._slots if slot.fd is None]
        if not others:
            return

        def run() -> None:
            with self._creating:
                for slot in others:
                    if slot.fd is not None or self._closed:
                        continue
                    try:
                        self._create(slot, layout, json_len)
                    except (_NoRoom, OSError) as exc:
                        log.debug("flash checkpoint %s: slot %d not created ahead: %s", self.name, slot.index, exc)
                        return
                    self._unlock(slot)

        threading.Thread(target=run, name=f"flash-create-{self.name}").start()

    def _pick(self) -> tuple[_Slot | None, int | None]:
        """The slot to write, locked exclusively, and the step of the pending snapshot it replaces."""
        free: list[tuple[int, _Slot]] = []
        pending: list[tuple[int, int, _Slot]] = []
        for slot in self._slots:
            if slot.fd is None:  # not used by this saver yet: created on use
                free.append((-2, slot))
                continue
            try:
                fcntl.flock(slot.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            state, seq, step = slot.state()
            if state in (slotfmt.READY, slotfmt.PERSISTING) and self.persist:
                pending.append((seq, step, slot))
            else:
                free.append((seq, slot))
        chosen: _Slot | None = None
        dropped: int | None = None
        if free:
            chosen = min(free, key=lambda f: f[0])[1]
        elif pending and self.replace_pending:
            _, dropped, chosen = min(pending, key=lambda p: p[0])
        for slot in self._slots:
            if slot is not chosen:
                self._unlock(slot)
        return chosen, dropped

    @staticmethod
    def _unlock(slot: _Slot) -> None:
        if slot.fd is not None:
            fcntl.flock(slot.fd, fcntl.LOCK_UN)

    def _create(self, slot: _Slot, layout: _Layout, json_len: int) -> None:
        """(Re)create ``slot`` for ``layout``: a new file, its pages reserved and mapped, locked,
        renamed over the old one (whose readers keep their copy)."""
        json_cap = _round_up(max(_MIN_JSON_BYTES, 2 * json_len), _PAGE)
        size = slotfmt.HEADER_BYTES + _round_up(layout.st_len, _PAGE) + json_cap
        if self.max_shm_bytes is not None and size * len(self._slots) > self.max_shm_bytes:
            raise _NoRoom(f"{len(self._slots)} slots of {size} bytes are over max_shm_bytes={self.max_shm_bytes}")
        tmp = slot.path.with_name(f".{slot.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        buf: mmap.mmap | None = None
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # a full tmpfs fails here, not with SIGBUS in the copy
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                os.ftruncate(fd, size)
            buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            slotfmt.init_header(buf, str(self.directory))
            buf[slotfmt.HEADER_BYTES:slotfmt.HEADER_BYTES + len(layout.header)] = layout.header
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.replace(tmp, slot.path)
        except BaseException:
            if buf is not None:
                buf.close()
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        slot.release()
        slot.fd, slot.mm, slot.size, slot.layout, slot.json_cap = fd, buf, size, layout, json_cap
        base = slotfmt.HEADER_BYTES + layout.data_at
        views: list[torch.Tensor | None] = []
        for (_, dtype, shape), (lo, hi) in zip(layout.key, layout.spans, strict=True):
            count = math.prod(shape)
            views.append(torch.frombuffer(buf, dtype=dtype, count=count, offset=base + lo).reshape(shape)
                         if hi > lo else None)
        slot.views = views

    def _save_to_disk(self, step: int, tree: Any, contexts: list[dict[str, Any]], meta: dict[str, Any] | None,
                      start: float, nbytes: int, reason: str) -> SaveResult:
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("flash checkpoint %s: no room in shared memory (%s); writing step %d to %s "
                        "synchronously", self.name, reason, step, self.directory)
        try:
            path = save_checkpoint(self.directory, step, tree, contexts, meta)
        except OSError as exc:
            text = f"cannot write step {step} to {self.directory}: {exc}"
            self._problem(text)
            self._set_status(step, ("failed", text))
            return SaveResult(step, time.perf_counter() - start, nbytes, "none", None, f"{reason}; {text}")
        self._set_status(step, ("persisted", path))
        return SaveResult(step, time.perf_counter() - start, nbytes, "disk", None, reason)

    def _set_status(self, step: int, status: tuple[str, Any]) -> None:
        with self._cond:
            self._status[step] = status
            self._cond.notify_all()

    # -- the rest of the API
    def wait_persisted(self, step: int, timeout: float = 60.0) -> Path:
        """The checkpoint directory of ``step`` once it is on disk.

        Raises:
            FlashError: ``step`` will not reach the disk (dropped, skipped, a disk error, never
                saved here, or the persister is gone).
            TimeoutError: not on disk after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                kind, detail = self._status.get(step, ("unknown", None))
                if kind == "persisted":
                    return Path(detail)
                if kind == "unknown":
                    raise FlashError(f"step {step} was not saved by this FlashCheckpoint")
                if kind != "pending":
                    raise FlashError(f"step {step} is not on disk: {detail or kind}")
                if self._reader is None or not self._reader.is_alive():
                    raise FlashError(f"step {step} is not on disk: the persister exited")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"step {step} not on disk after {timeout} s")
                self._cond.wait(min(left, 0.5))

    def problems(self) -> list[str]:
        """The persister's errors so far (disk full, unwritable directory, ...), newest last."""
        with self._cond:
            problems = list(self._problems)
        proc = self._proc
        if proc is not None and not self._closed and proc.poll() is not None:
            problems.append(f"the persister exited with status {proc.returncode}")
        return problems

    def slot_states(self) -> list[dict[str, Any]]:
        """Each slot's file, state and step (for diagnostics)."""
        out = []
        for slot in self._slots:
            try:
                head, size = slotfmt.peek_header(slot.path)
            except OSError:
                head, size = None, 0
            out.append({"slot": slot.index, "path": str(slot.path), "bytes": size,
                        "state": slotfmt.STATE_NAMES.get(head.state, str(head.state)) if head else "absent",
                        "step": head.step if head else None})
        return out

    def close(self, timeout: float = 600.0) -> None:
        """Let the persister write what is pending, stop it, and remove the slot files whose
        snapshot is on disk. Snapshots not on disk (persist=False, a disk error) stay in shared
        memory for a resume (``remove_shm`` deletes them). Waits at most ``timeout`` seconds; a
        persister still writing then finishes (and cleans up) on its own."""
        if self._closed:
            return
        self._closed = True
        proc = self._proc
        if proc is not None and self._to_persister is not None:
            os.set_blocking(self._to_persister, True)
            self._notify({"op": "close"})
            os.close(self._to_persister)
            self._to_persister = None
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("flash checkpoint %s: the persister is still writing after %s s; it finishes on its "
                            "own", self.name, timeout)
            if self._reader is not None:
                self._reader.join(timeout=5)
        with self._creating:  # not while the background creates a slot
            for slot in self._slots:
                slot.release()
        if proc is None or proc.poll() is not None:  # the persister's cleanup, should it have died
            for index, step, path in slotfmt.remove_slots(self.shm_dir, self.name, len(self._slots)):
                if self.persist:
                    log.warning("flash checkpoint %s: step %d of slot %d is not on disk; kept in %s",
                                self.name, step, index, path)

    def __enter__(self) -> FlashCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PeriodicCheckpoint:
    """``--checkpoint-every``: a flash save every ``n`` applied steps or ``s`` seconds.

    The caller asks ``due(step)`` at each step boundary and saves when it says so. A failure is
    kept (``problem``) and logged, never raised: a checkpoint that cannot be written must not stop
    training (the previous one stays). ``step`` is the newest snapshot in shared memory or on disk.
    """

    def __init__(self, directory: str | Path, name: str, every: tuple[str, float],
                 clock: Any = time.monotonic, keep: int = 0) -> None:
        self.directory, self.name, self.every, self.clock, self.keep = str(directory), name, every, clock, keep
        self.flash: FlashCheckpoint | None = None
        self.step = -1
        self.problem = ""
        self._last_at = clock()

    def due(self, step: int) -> bool:
        kind, value = self.every
        if kind == "steps":
            return (step + 1) % int(value) == 0
        return self.clock() - self._last_at >= value

    def save(self, step: int, tree: Any, contexts: list[dict[str, Any]], meta: dict[str, Any]) -> SaveResult | None:
        self._last_at = self.clock()
        try:
            if self.flash is None:
                # the snapshot not yet persisted is the one this worker last reported: its master
                # may resume from it, so a newer save waits for a free slot (is skipped) instead
                self.flash = FlashCheckpoint(self.directory, name=self.name, keep=self.keep, replace_pending=False)
            result = self.flash.save(step, tree, contexts, meta)
        except (FlashError, OSError, ValueError) as exc:
            self._note(f"checkpoint of step {step} not taken: {exc}")
            return None
        if result.where != "none":
            self.step = step
        problems = self.flash.problems()
        if problems:
            self._note(problems[-1])
        return result

    def _note(self, problem: str) -> None:
        if problem != self.problem:
            log.warning("%s", problem)
        self.problem = problem

    def close(self, timeout: float = 60.0) -> None:
        """Let the persister write what is pending (it would anyway: it outlives this process)."""
        if self.flash is not None:
            self.flash.close(timeout)
            self.flash = None

    def prune_to(self, final: Path) -> None:
        """``keep`` for the job's final checkpoint ``final``, written after ``close``: the one a
        resume would now load, so without the bound of the snapshots' ``keep_from``."""
        if self.keep:
            slotfmt.prune(Path(self.directory), self.keep, final, _dir_step(final))


def remove_shm(name: str, shm_dir: str | Path = "/dev/shm") -> list[Path]:
    """Delete every slot file of ``name`` (a job's cleanup once it no longer needs them)."""
    removed = []
    for path in _slot_files(Path(shm_dir), name):
        path.unlink(missing_ok=True)
        removed.append(path)
    for tmp in Path(shm_dir).glob(f".tidal-{name}-*.tmp"):
        tmp.unlink(missing_ok=True)
    return removed


def _lines(fd: int) -> Iterator[bytes]:
    pending = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            return
        if not chunk:
            return
        *lines, pending = (pending + chunk).split(b"\n")
        yield from lines


def _slot_files(shm_dir: Path, name: str) -> list[Path]:
    prefix = f"tidal-{name}-"
    if not shm_dir.is_dir():
        return []
    return sorted(p for p in shm_dir.glob(prefix + "*") if p.name[len(prefix):].isdigit())


def _job_slot_files(shm_dir: Path, job: str) -> list[Path]:
    """The slots of every worker of ``job`` (``FlashCheckpoint`` names ``<job>-w<worker id>``)."""
    if not shm_dir.is_dir():
        return []
    pattern = job_slot_pattern(job)
    return sorted(p for p in shm_dir.glob(f"tidal-{job}-w*") if pattern.fullmatch(p.name))


# ----------------------------------------------------------------------------- loading
def load_latest(directory: str | Path, *, name: str | None = None, shm_dir: str | Path = "/dev/shm",
                job: str | None = None) -> Loaded:
    """The newest intact snapshot: a shared-memory slot of ``name`` (or of any worker of ``job``:
    the slots ``tidal-<job>-w<id>-<i>``) or a checkpoint in ``directory`` that verifies, whichever
    has the higher step (shared memory on a tie).

    A torn or corrupt slot, or a checkpoint that does not verify, is skipped with a warning.

    Raises:
        CheckpointError: none is intact.
    """
    return _load_first(_candidates(directory, name, shm_dir, job), directory, name or job)


def load_step(directory: str | Path, step: int, *, job: str | None = None, name: str | None = None,
              lineage: int | None = None, shm_dir: str | Path = "/dev/shm") -> Loaded:
    """The snapshot of exactly ``step``: from a slot of ``name`` or of any worker of ``job`` when one
    holds it intact, else from ``directory``'s ``step-<step>`` checkpoint if it verifies (a resume
    must load the step whose data position the master rolls back to, not merely the newest).
    ``lineage``: the snapshot's meta must name it (``tidal.master.checkpoints``: a worker of a
    lineage the job rolled back from may have left a snapshot of the same step).

    Raises:
        CheckpointError: no intact snapshot of ``step`` (of ``lineage``).
    """
    found = [c for c in _candidates(directory, name, shm_dir, job) if c[0] == step]
    return _load_first(found, directory, name or job, f" of step {step}", lineage)


def _candidates(directory: str | Path, name: str | None, shm_dir: str | Path,
                job: str | None) -> list[tuple[int, int, str, Path]]:
    """(step, preference, source, path) of every slot that looks intact and every ``step-*`` dir."""
    root = Path(directory).resolve()
    out: list[tuple[int, int, str, Path]] = []
    slots = _slot_files(Path(shm_dir), name) if name is not None else []
    if job is not None:
        slots += _job_slot_files(Path(shm_dir), job)
    for path in sorted(set(slots)):
        try:
            head, size = slotfmt.peek_header(path)
        except OSError as exc:
            log.warning("skipping flash checkpoint slot %s: %s", path, exc)
            continue
        if head is None or head.magic != slotfmt.MAGIC:
            log.warning("skipping %s: not a flash checkpoint slot", path)
            continue
        if head.directory != str(root) or head.state == slotfmt.EMPTY:
            continue  # another job's, or never written
        problem = head.problem(size)
        if problem is not None:
            log.warning("skipping flash checkpoint slot %s: %s", path, problem)
            continue
        out.append((head.step, 1, "shm", path))
    out.extend((_dir_step(path), 0, "disk", path) for path in _step_dirs(root))
    return sorted(out, reverse=True)


def _load_first(candidates: list[tuple[int, int, str, Path]], directory: str | Path, shm_name: str | None,
                what: str = "", lineage: int | None = None) -> Loaded:
    root = Path(directory).resolve()
    problems = []
    for step, _, source, path in candidates:
        try:
            loaded = _load_slot(path, root) if source == "shm" else _load_dir(path)
            if lineage is not None and loaded.meta.get("lineage", 0) != lineage:
                raise CheckpointError(f"of lineage {loaded.meta.get('lineage', 0)}, not {lineage} (a step the job "
                                      "rolled back from)")
            return loaded
        except (CheckpointError, ValueError, OSError) as exc:
            log.warning("skipping %s checkpoint of step %d at %s: %s", source, step, path, exc)
            problems.append(f"{path}: {exc}")
    raise CheckpointError(f"no valid checkpoint{what} in {root}"
                          + (f" or in the shared memory of {shm_name!r}" if shm_name else "")
                          + (f" ({'; '.join(problems)})" if problems else ""))


def _step_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step-*") if p.name[5:].isdigit() and p.is_dir()), key=_dir_step,
                  reverse=True)


def _dir_step(path: Path) -> int:
    return int(path.name[5:])


def _load_dir(path: Path) -> Loaded:
    from safetensors.torch import load_file

    manifest = verify(path)
    tensors = load_file(str(path / "tensors.safetensors"))
    skeleton = json.loads((path / "skeleton.json").read_text())
    contexts = json.loads((path / "contexts.json").read_text())
    meta = json.loads((path / "meta.json").read_text()) if manifest["format"] >= 2 else {}
    if not isinstance(meta, dict):
        raise CheckpointError("meta.json is not a JSON object")
    return Loaded(join_tree(skeleton, tensors), contexts, meta, int(manifest["step"]), "disk", path)


def _load_slot(path: Path, root: Path, lock_timeout: float = 30.0) -> Loaded:
    fd = os.open(path, os.O_RDONLY)
    try:
        deadline = time.monotonic() + lock_timeout
        while True:  # shared: the persister reads along; the saver holds it exclusively only for a copy
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CheckpointError(f"slot locked by its saver for over {lock_timeout} s") from None
                time.sleep(0.01)
        size = os.fstat(fd).st_size
        buf = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # private: tensors are cloned out of it
        try:
            return _read_slot(buf, size, path, root)
        finally:
            buf.close()
    finally:
        os.close(fd)


def _read_slot(buf: mmap.mmap, size: int, path: Path, root: Path) -> Loaded:
    head = slotfmt.read_header(buf)
    if head is None:
        raise CheckpointError("slot shorter than its header")
    problem = head.problem(size)
    if problem is not None or head.directory != str(root):
        raise CheckpointError(problem or "slot of another checkpoint directory")
    start = slotfmt.HEADER_BYTES
    with memoryview(buf)[start:start + head.payload_len] as payload:
        if head.crc_ok:
            if zlib.crc32(payload) != head.crc:
                raise CheckpointError("payload does not match its CRC-32 (corrupt shared memory)")
        else:
            log.info("flash checkpoint slot %s (step %d) not checksummed yet; trusting its ready mark",
                     path, head.step)
        skel_at = head.st_len
        ctx_at = skel_at + head.skel_len
        meta_at = ctx_at + head.ctx_len
        skeleton = json.loads(bytes(payload[skel_at:ctx_at]))
        contexts = json.loads(bytes(payload[ctx_at:meta_at]))
        meta = json.loads(bytes(payload[meta_at:meta_at + head.meta_len]))
        if head.st_len < 8:
            raise CheckpointError("safetensors part shorter than its header length")
        header_len = int.from_bytes(payload[:8], "little")
        if 8 + header_len > head.st_len:
            raise CheckpointError("safetensors header runs past its part")
        header = json.loads(bytes(payload[8:8 + header_len]))
    if not isinstance(header, dict) or not isinstance(meta, dict) or not isinstance(contexts, list):
        raise CheckpointError("malformed slot: header, contexts or meta of the wrong type")
    data_at = start + 8 + header_len
    data_len = head.st_len - 8 - header_len
    tensors: dict[str, torch.Tensor] = {}
    ends = []
    for tname, entry in header.items():
        if tname == "__metadata__":
            continue
        dtype = _FROM_SAFETENSORS.get(str(entry.get("dtype"))) if isinstance(entry, dict) else None
        if dtype is None:
            raise CheckpointError(f"tensor {tname!r}: dtype not allowed")
        shape = [int(s) for s in entry["shape"]]
        lo, hi = (int(x) for x in entry["data_offsets"])
        count = math.prod(shape)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if min(shape, default=0) < 0 or not 0 <= lo <= hi <= data_len or hi - lo != count * itemsize:
            raise CheckpointError(f"tensor {tname!r}: offsets do not match its shape")
        ends.append((lo, hi))
        if count == 0:
            tensors[tname] = torch.empty(shape, dtype=dtype)
        else:
            view = torch.frombuffer(buf, dtype=dtype, count=count, offset=data_at + lo)
            tensors[tname] = view.reshape(shape).clone()
            del view
    at = 0
    for lo, hi in sorted(ends):
        if lo != at:
            raise CheckpointError("safetensors part has holes or overlapping tensors")
        at = hi
    if at != data_len:
        raise CheckpointError("safetensors part longer than its tensors")
    try:
        tree = join_tree(skeleton, tensors)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    return Loaded(tree, contexts, meta, head.step, "shm", path)


# ----------------------------------------------------------------------------- listing
def list_checkpoints(directory: str | Path) -> list[CheckpointInfo]:
    """Every ``step-*`` checkpoint of ``directory``, newest first, verified (``tidal checkpoints``)."""
    infos = []
    for path in _step_dirs(Path(directory)):
        try:
            files = [p for p in path.iterdir() if p.is_file()]
            nbytes = sum(p.stat().st_size for p in files)
            mtime = (path / MANIFEST).stat().st_mtime if (path / MANIFEST).exists() else path.stat().st_mtime
        except OSError as exc:
            infos.append(CheckpointInfo(_dir_step(path), path, 0, 0.0, False, str(exc)))
            continue
        try:
            verify(path)
            ok, problem = True, None
        except CheckpointError as exc:
            ok, problem = False, str(exc)
        infos.append(CheckpointInfo(_dir_step(path), path, nbytes, mtime, ok, problem))
    return infos
