"""Reading a worker's stream partitions: which records a step takes, and reading them ahead.

``PartitionReader`` picks a step's records: up to a batch of them from the worker's partitions,
taken in turn (round-robin from where the previous step stopped), each after the position the
worker has read to and never into a range committed ahead of it (global shuffling,
``tidal.master.streams``). A step trains up to ``STEP_RANGES`` partitions' ranges: a worker that
reads k partitions and trains a partition a step would hold each record back for up to k steps
(bench/RESULTS.md: 3.1 s against 0.6 s at 8 partitions and 0.3 s a step).

While a step trains, the next batch is read and decoded ahead (``ReadAhead``), either by a thread
of the training process or by a reader process forked from it (``TIDAL_STREAM_READER=process``,
the default for a stream opened by URL). A thread takes turns with training on the GIL: its
socket read and reply parsing (about 0.8 ms for 512 records) add to every step
(bench/RESULTS.md, "Read path"). A process reads on another core; the training process only
copies the decoded tensors out of one message.

The reader process is a fork of the worker, so the script's ``decode`` runs there as it is,
closures included; it opens its own connection to the stream (``open_source(source.url)``),
never touches an accelerator (decode must return CPU tensors, as for the in-process reader),
and ends with its worker: a pipe that closes (the worker closed the loader or exited) or the
worker's death (``PR_SET_PDEATHSIG``, so a SIGKILLed worker leaves no reader behind). Requests
and answers cross a socket pair as JSON and the data-plane codec of ``tidal.api.frames``: no
pickle. A batch that is not tensors in dicts, lists and tuples cannot cross it; the loader then
reads ahead with a thread (logged once).

Memory. A fork shares the worker's pages copy-on-write; every page the worker writes afterwards
(its parameters and optimizer state, when they live in host memory) is copied, and the reader
keeps the old one: in the worst case the pair holds the worker's memory twice. Models on an
accelerator leave little of it in host memory. The reader process is forked only while the
worker's resident memory is at most a quarter of the memory available (``fits_a_copy``);
otherwise the loader reads ahead in a thread and says why.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from tidal.api.streams import STEP_RANGES, Span, pack_id, unpack_id
from tidal.data.api import StreamRecord, StreamSource

log = logging.getLogger(__name__)

Decode = Callable[[list[dict[str, bytes]]], tuple[Any, list[int]]]
Run = tuple[int, int, list[StreamRecord]]  # partition, the position read after, the records
Picked = list[Run]  # a step's records: at most STEP_RANGES runs, each of one partition

_PR_SET_PDEATHSIG = 1
READER_ENV = "TIDAL_STREAM_READER"  # "process" (default) or "thread"


@dataclass
class Taken:
    """A step's records, decoded: what the loader needs of them besides the batch."""

    spans: list[Span]  # per run: partition, the packed id it follows, its first and last, its records
    batch: Any
    bad_ids: list[str]  # ids of the malformed records (skipped by decode)

    @property
    def count(self) -> int:
        return sum(s[4] for s in self.spans)

    @classmethod
    def decoded(cls, picked: Picked, decode: Decode) -> Taken:
        records = [r for _, _, run in picked for r in run]
        batch, bad = decode([r.fields for r in records])
        spans = [(p, after, pack_id(run[0].id), pack_id(run[-1].id), len(run)) for p, after, run in picked]
        return cls(spans, batch, [records[i].id for i in bad])


class PartitionReader:
    """A step's records from a worker's partitions (see the module docstring).

    ``order``: the partitions of this round, in turn order; ``skips``: per partition, the ranges
    ``[after, last]`` committed ahead of the round's positions.
    """

    def __init__(self, source: StreamSource, batch_size: int) -> None:
        self.source = source
        self.batch_size = batch_size
        self.order: list[int] = []
        self.skips: dict[int, list[list[int]]] = {}

    def next_records(self, positions: dict[int, int], turn: int, block_s: float = 0.0,
                     runs: int = STEP_RANGES) -> tuple[Picked | None, int]:
        """Up to a batch of records from the partitions, in turn from ``turn`` (round-robin), at
        most ``runs`` of them with records, each run with the position it follows; and the turn
        after the last partition read. Waits up to ``block_s`` on the partition of ``turn`` when
        none has any."""
        order = self.order
        picked: Picked = []
        want, next_turn = self.batch_size, turn
        for i in range(len(order)):
            p = order[(turn + i) % len(order)]
            after, records = self.read_partition(p, positions[p], limit=want)
            if records:
                picked.append((p, after, records))
                want -= len(records)
                next_turn = (turn + i + 1) % len(order)
                if want <= 0 or len(picked) >= runs:
                    break
        if picked:
            return picked, next_turn
        if block_s > 0:
            if not order:
                time.sleep(block_s)
                return None, turn
            p = order[turn % len(order)]
            after, records = self.read_partition(p, positions[p], block_s)
            if records:
                return [(p, after, records)], (turn + 1) % len(order)
        return None, turn

    def uncommitted(self, p: int, position: int) -> int:
        """Records of ``p`` after ``position`` that nobody committed: the stream's count less the
        ranges committed ahead of the position. Counted with them, a partition whose last records
        a receiver of forwarded records trained (committed ahead, the round's reader stopped
        before them) waited forever: its reader never reads past the range until a record
        arrives after it, so a drained job did not stop (``--stop-when-drained``)."""
        waiting = self.source.lag(p, unpack_id(position))
        for after, last in self.skips.get(p, ()):
            if last > position:
                waiting -= self.source.lag(p, unpack_id(max(after, position))) - self.source.lag(p, unpack_id(last))
        return max(0, waiting)

    def read_partition(self, p: int, position: int, block_s: float = 0.0,
                       limit: int | None = None) -> tuple[int, list[StreamRecord]]:
        """Up to a batch (or ``limit``) of ``p``'s records after ``position`` that nobody
        committed, and the position they follow: past the ranges committed ahead of the position,
        a batch never reaches into one."""
        count = self.batch_size if limit is None else min(limit, self.batch_size)
        for after, last in self.skips.get(p, ()):
            if last <= position:
                continue
            if position == after:  # everything up to the range was read: go on after it
                position = last
                continue
            records = self.source.read(p, unpack_id(position), count, block_s=block_s)
            cut = 0
            while cut < len(records) and pack_id(records[cut].id) <= after:
                cut += 1
            if cut or not records:
                return position, records[:cut]
            position = last  # no record left before the range
        return position, self.source.read(p, unpack_id(position), count, block_s=block_s)


class ReadAhead:
    """One batch read and decoded ahead, in a thread or a forked reader process.

    ``start(positions, turn)`` begins reading the batch that follows ``positions`` from partition
    turn ``turn`` on; ``take()`` returns it as ``(Taken or None, the turn after it)``, or None if
    the reading failed (the caller then reads in its own thread, where the error surfaces).
    One read is in flight at a time.
    """

    def __init__(self, reader: PartitionReader, decode: Decode, *, use_process: bool) -> None:
        self.reader = reader
        self.decode = decode
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[tuple[Taken | None, int]] | None = None
        self._process: _ReaderProcess | None = None
        self._use_process = use_process

    @property
    def in_process(self) -> bool:
        """Whether a reader process, not a thread, reads ahead (for logs and tests)."""
        return self._process is not None and self._process.alive

    def start(self, positions: dict[int, int], turn: int) -> None:
        if self._use_process and self._process is None:
            why_not = fits_a_copy()
            try:
                if why_not:
                    raise OSError(why_not)
                self._process = _ReaderProcess(self.reader, self.decode)
            except OSError as exc:
                log.warning("stream reader process not started (%s): reading ahead in a thread", exc)
                self._use_process = False
        if self._process is not None and self._process.alive:
            self._process.request(self.reader, positions, turn)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-stream")
        self._future = self._pool.submit(self._read, dict(positions), turn)

    def _read(self, positions: dict[int, int], turn: int) -> tuple[Taken | None, int]:
        picked, turn = self.reader.next_records(positions, turn)
        return (Taken.decoded(picked, self.decode) if picked is not None else None), turn

    def take(self) -> tuple[Taken | None, int] | None:
        if self._process is not None and self._process.waiting:
            return self._process.answer()  # a reader that gave up stays closed: a thread reads next
        future, self._future = self._future, None
        if future is None:
            return None
        try:
            return future.result()
        except Exception as exc:  # e.g. the stream unavailable: the caller reads again, and raises
            log.debug("read ahead failed: %s", exc)
            return None

    def discard(self) -> None:
        """Drop the read in flight (the positions moved: a re-form)."""
        if self._process is not None and self._process.waiting:
            self._process.answer()
        if self._future is not None:
            self._future.cancel()
            self._future = None

    def close(self) -> None:
        if self._process is not None:
            self._process.close()
            self._process = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._future = None


def fits_a_copy() -> str:
    """Why a forked reader could not hold a copy of this process's memory ("" if it could: the
    resident memory is at most a quarter of what is available; see the module docstring)."""
    import psutil

    rss, available = psutil.Process().memory_info().rss, psutil.virtual_memory().available
    if 4 * rss > available:
        return (f"the worker holds {rss / 2**30:.1f} GiB, more than a quarter of the {available / 2**30:.1f} GiB "
                "available, and a fork may come to hold a copy of it")
    return ""


class _ReaderProcess:
    """The forked reader (see the module docstring): one request, one answer, in turn."""

    def __init__(self, reader: PartitionReader, decode: Decode) -> None:
        parent, child = socket.socketpair()
        parent_pid = os.getpid()
        pid = os.fork()
        if pid == 0:  # the reader: never returns
            code = 0
            try:
                parent.close()
                _serve(Connection(child.detach()), reader, decode, parent_pid)
            except BaseException:  # a reader that fails ends; the worker reads itself
                code = 1
            finally:
                os._exit(code)
        child.close()
        self.pid = pid
        self.conn = Connection(parent.detach())
        self.alive = True
        self.waiting = False

    def request(self, reader: PartitionReader, positions: dict[int, int], turn: int) -> None:
        msg = {"positions": [[p, v] for p, v in positions.items()], "turn": turn, "order": reader.order,
               "skips": [[p, r] for p, r in reader.skips.items()]}
        try:
            self.conn.send_bytes(json.dumps(msg).encode())
        except OSError as exc:
            self._died(f"the pipe to it broke ({exc})")
            return
        self.waiting = True

    def answer(self) -> tuple[Taken | None, int] | None:
        from tidal.api import frames
        from tidal.data.batches import unflatten

        self.waiting = False
        try:
            header, payload = self.conn.recv_bytes(), self.conn.recv_bytes()
            msg = frames.decode_joined(header, payload)
        except (OSError, EOFError, frames.FrameError) as exc:
            self._died(f"its answer was lost ({type(exc).__name__}: {exc})")
            return None
        meta = msg.meta or {}
        if "error" in meta:
            log.debug("read ahead failed: %s", meta["error"])
            return None
        if "unsupported" in meta:
            log.warning("the stream's batches cannot leave the reader process (%s): reading ahead in a thread",
                        meta["unsupported"])
            self.close()
            return None
        if meta.get("taken") is None:
            return None, int(meta["turn"])
        spans, bad_ids = meta["taken"]
        batch = unflatten(meta["tree"], msg.tensors)
        return Taken([(int(p), int(a), int(f), int(lst), int(n)) for p, a, f, lst, n in spans], batch,
                     [str(i) for i in bad_ids]), int(meta["turn"])

    def _died(self, why: str) -> None:
        log.warning("stream reader process %d stopped: %s; reading ahead in a thread", self.pid, why)
        self.close()

    def close(self) -> None:
        if not self.alive:
            return
        self.alive = self.waiting = False
        self.conn.close()  # the reader sees the pipe close and exits
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if os.waitpid(self.pid, os.WNOHANG)[0] == self.pid:
                return
            time.sleep(0.01)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def _serve(conn: Connection, reader: PartitionReader, decode: Decode, parent_pid: int) -> None:
    """The reader process's loop: answer each request with the next batch, until the pipe closes."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the pipe's close still ends it
        pass
    if os.getppid() != parent_pid:  # the worker died before the signal was armed
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the worker's to handle
    import torch

    from tidal.api import frames
    from tidal.data.batches import BatchError, flatten
    from tidal.data.streams import open_source

    torch.set_num_threads(1)
    own = PartitionReader(open_source(reader.source.url), reader.batch_size)
    while True:
        try:
            req = json.loads(conn.recv_bytes())
        except EOFError:
            return
        own.order = [int(p) for p in req["order"]]
        own.skips = {int(p): ranges for p, ranges in req["skips"]}
        positions = {int(p): int(v) for p, v in req["positions"]}
        tensors: dict[str, Any] = {}
        try:
            picked, turn = own.next_records(positions, int(req["turn"]))
            meta: dict[str, Any] = {"turn": turn, "taken": None}
            if picked is not None:
                t = Taken.decoded(picked, decode)
                try:
                    meta["tree"], tensors = flatten(t.batch)
                except BatchError as exc:
                    meta, tensors = {"unsupported": str(exc)}, {}
                else:
                    meta["taken"] = [[list(s) for s in t.spans], t.bad_ids]
            header, payload = frames.encode_joined(tensors, meta=meta)
        except Exception as exc:  # the worker sees any failure by reading itself
            header, payload = frames.encode_joined({}, meta={"error": f"{type(exc).__name__}: {exc}"})
        conn.send_bytes(header)
        conn.send_bytes(payload.numpy().data)
