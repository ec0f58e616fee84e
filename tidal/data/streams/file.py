"""A recorded stream in files, a ``StreamSource`` (DESIGN.md 3) for tests, demos and replays.

``file:///DIR/NAME``: partition ``p`` is ``DIR/NAME.p.jsonl``, one record a line::

    {"id": "1732268400123-0", "fields": {"x": "<base64>", "label": "<base64>"}}

Ids have Redis' form and order: ``<ms>-<seq>``, ``ms`` from the wall clock (never below the
last id's, so a clock stepping back cannot reorder records), ``seq`` counting records within
one millisecond. They must increase down the file; a file that breaks that, or a complete line
that is not a record, raises ``ConfigError`` naming the file.

One writer process at a time per partition (``append`` and ``trim`` hold an ``flock`` on the
hidden ``DIR/.NAME.p.lock``); readers in any process take no lock. A batch is appended with one
``write`` at the end of the file, so a reader may see a partial last line; it is ignored until
its newline arrives. A partial tail found under the writer lock was left by a writer that died
mid-line, and is cut off before the next append. ``trim`` writes what is kept to a temporary
file and renames it over the partition, first line ``{"trimmed": "<id>"}``: the last deleted id,
so that ids keep increasing after everything was trimmed (as Redis' do).

A reader indexes the complete lines it has seen (ids and byte offsets) and reads only the new
tail on each call; it keeps the file open, so the inode number cannot be reused while it looks,
and a different inode at the path means a trim replaced the file. ``read`` with ``block_s`` polls
every ``poll_s``.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import json
import os
import re
import tempfile
import threading
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from tidal.api import ConfigError
from tidal.data.api import FIRST, StreamRecord, format_id, parse_id
from tidal.data.streams import parse_stream_url

__all__ = ["FileStreamSource"]

_ID_PREFIX = re.compile(rb'\{"id": ?"(\d+)-(\d+)"')  # the lines this module writes: no full parse to index
_CHUNK = 1 << 22


@dataclass
class _Index:
    """What this source knows of one partition file: its complete lines up to ``offset``."""

    file: BinaryIO
    inode: tuple[int, int]
    offset: int = 0  # end of the last complete line
    ids: list[tuple[int, int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # byte offset of each record's line
    floor: tuple[int, int] = (0, 0)  # the last id a trim deleted (the marker line)
    trimmed: int = 0  # records trims deleted (the marker line)

    def newest(self) -> tuple[int, int]:
        return max(self.ids[-1], self.floor) if self.ids else self.floor


class FileStreamSource:
    """The recorded stream ``file:///DIR/NAME``; ``clock`` gives the wall time for new ids.

    Raises:
        ConfigError: a bad URL; later, a corrupt partition file or an unwritable directory.
    """

    def __init__(self, url: str, *, clock: Callable[[], float] = time.time, poll_s: float = 0.01) -> None:
        where = parse_stream_url(url)
        if where.scheme != "file" or where.directory is None:
            raise ConfigError(f"{url!r} is not a file:// stream URL")
        self.url = url
        self.name = where.name
        self.directory = Path(where.directory)
        self._clock = clock
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._indexes: dict[int, _Index] = {}

    # ------------------------------------------------------------------ StreamSource
    def partitions(self) -> list[int]:
        try:
            names = os.listdir(self.directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
        prefix, suffix = f"{self.name}.", ".jsonl"
        found = []
        for n in names:
            middle = n[len(prefix):-len(suffix)] if n.startswith(prefix) and n.endswith(suffix) else ""
            if middle.isdigit() and middle.isascii() and str(int(middle)) == middle:
                found.append(int(middle))
        return sorted(found)

    def read(self, partition: int, after: str, count: int, block_s: float = 0.0) -> list[StreamRecord]:
        path = self._path(partition)
        position = parse_id(after)
        if count < 1:
            return []
        deadline = time.monotonic() + block_s
        while True:
            with self._lock:
                index = self._refresh(partition, path)
                if index is not None:
                    i = bisect_right(index.ids, position)
                    if i < len(index.ids):
                        return self._load(index, partition, path, i, min(len(index.ids), i + count))
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            time.sleep(min(self._poll_s, left))

    def range(self, partition: int, first: str, last: str) -> list[StreamRecord]:
        path = self._path(partition)
        lo, hi = parse_id(first), parse_id(last)
        with self._lock:
            index = self._refresh(partition, path)
            if index is None:
                return []
            i, j = bisect_left(index.ids, lo), bisect_right(index.ids, hi)
            return self._load(index, partition, path, i, j) if i < j else []

    def last_id(self, partition: int) -> str:
        path = self._path(partition)
        with self._lock:
            index = self._refresh(partition, path)
            return format_id(*index.ids[-1]) if index is not None and index.ids else FIRST

    def lag(self, partition: int, after: str) -> int:
        path = self._path(partition)
        position = parse_id(after)
        with self._lock:
            index = self._refresh(partition, path)
            return 0 if index is None else len(index.ids) - bisect_right(index.ids, position)

    def appended(self, partition: int) -> int:
        with self._lock:
            index = self._refresh(partition, self._path(partition))
            return 0 if index is None else index.trimmed + len(index.ids)

    def append(self, partition: int, records: list[dict[str, bytes]]) -> list[str]:
        path = self._path(partition)
        if not records:
            return []
        if not all(records):
            raise ConfigError("a stream record needs at least one field")
        with self._lock, self._writer_lock(partition):
            index = self._refresh(partition, path)
            last = index.newest() if index is not None else (0, 0)
            ids, lines = [], []
            for fields in records:
                ms = max(int(self._clock() * 1000), last[0])
                last = (ms, last[1] + 1) if ms == last[0] else (ms, 0)
                ids.append(format_id(*last))
                encoded = {name: base64.b64encode(value).decode("ascii") for name, value in fields.items()}
                lines.append(json.dumps({"id": ids[-1], "fields": encoded}) + "\n")
            blob = "".join(lines).encode()
            try:
                if index is None:  # a new partition appears with its first records, never empty
                    self._replace(path, [blob])
                else:
                    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
                    try:
                        os.ftruncate(fd, index.offset)  # a dead writer's partial line, if any
                        view = memoryview(blob)
                        while view:
                            view = view[os.write(fd, view):]
                    finally:
                        os.close(fd)
            except OSError as exc:
                raise ConfigError(f"cannot append to {path}: {exc.strerror}") from exc
            return ids

    def trim(self, partition: int, upto: str) -> int:
        path = self._path(partition)
        position = parse_id(upto)
        with self._lock, self._writer_lock(partition):
            index = self._refresh(partition, path)
            if index is None:
                return 0
            n = bisect_right(index.ids, position)
            if n == 0:
                return 0
            floor = max(index.floor, index.ids[n - 1])
            keep_from = index.starts[n] if n < len(index.ids) else index.offset
            marker = (json.dumps({"trimmed": format_id(*floor), "count": index.trimmed + n}) + "\n").encode()
            try:
                self._replace(path, [marker], index.file, keep_from, index.offset)
            except OSError as exc:
                raise ConfigError(f"cannot trim {path}: {exc.strerror}") from exc
            return n

    def close(self) -> None:
        with self._lock:
            for index in self._indexes.values():
                index.file.close()
            self._indexes.clear()

    # ------------------------------------------------------------------ files
    def _path(self, partition: int) -> Path:
        if isinstance(partition, bool) or not isinstance(partition, int) or partition < 0:
            raise ConfigError(f"stream partition {partition!r} is not a non-negative integer")
        return self.directory / f"{self.name}.{partition}.jsonl"

    @contextmanager
    def _writer_lock(self, partition: int) -> Iterator[None]:
        """The partition's writer lock, on a file of its own: trim replaces the data file's inode."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.directory / f".{self.name}.{partition}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(f"cannot write stream {self.url}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock

    def _replace(self, path: Path, head: list[bytes], source: BinaryIO | None = None, start: int = 0,
                 end: int = 0) -> None:
        """Write ``head`` then ``source[start:end]`` to a temporary file and rename it over ``path``."""
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                for part in head:
                    out.write(part)
                if source is not None:
                    source.seek(start)
                    while start < end:
                        chunk = source.read(min(_CHUNK, end - start))
                        if not chunk:
                            break
                        out.write(chunk)
                        start += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    def _refresh(self, partition: int, path: Path) -> _Index | None:
        """The partition's index, brought up to the file's last complete line (None: no file)."""
        index = self._indexes.get(partition)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        if index is not None and (st is None or (st.st_dev, st.st_ino) != index.inode or st.st_size < index.offset):
            index.file.close()  # replaced by a trim (or gone): index the new file from the start
            del self._indexes[partition]
            index = None
        if st is None:
            return None
        if index is None:
            try:
                f = open(path, "rb")  # held open by the index until close()
            except FileNotFoundError:
                return None
            fst = os.fstat(f.fileno())
            index = self._indexes[partition] = _Index(f, (fst.st_dev, fst.st_ino))
        index.file.seek(index.offset)
        pending = b""
        while chunk := index.file.read(_CHUNK):
            pending += chunk
            end = pending.rfind(b"\n")
            if end < 0:
                continue
            complete, pending = pending[:end], pending[end + 1:]
            for line in complete.split(b"\n"):
                self._index_line(index, path, line)
                index.offset += len(line) + 1
        return index

    @staticmethod
    def _index_line(index: _Index, path: Path, line: bytes) -> None:
        if not line.strip():
            return
        match = _ID_PREFIX.match(line)
        if match:
            record_id = (int(match[1]), int(match[2]))
        else:
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{path} at byte {index.offset}: not a stream record ({exc})") from exc
            if isinstance(obj, dict) and "trimmed" in obj and set(obj) <= {"trimmed", "count"} and index.offset == 0:
                index.floor = parse_id(str(obj["trimmed"]))
                index.trimmed = int(obj.get("count", 0))
                return
            if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
                raise ConfigError(f"{path} at byte {index.offset}: not a stream record (no string \"id\")")
            record_id = parse_id(obj["id"])
        if record_id <= index.newest():
            raise ConfigError(f"{path} at byte {index.offset}: id {format_id(*record_id)} is not above "
                              f"the one before ({format_id(*index.newest())})")
        index.ids.append(record_id)
        index.starts.append(index.offset)

    @staticmethod
    def _load(index: _Index, partition: int, path: Path, i: int, j: int) -> list[StreamRecord]:
        """Records ``i`` to ``j - 1`` of the index, read and decoded."""
        start = index.starts[i]
        end = index.starts[j] if j < len(index.ids) else index.offset
        index.file.seek(start)
        blob = index.file.read(end - start)
        out: list[StreamRecord] = []
        for line in blob.split(b"\n"):
            at, start = start, start + len(line) + 1
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                fields = {str(name): base64.b64decode(value, validate=True) for name, value in obj["fields"].items()}
            except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as exc:
                raise ConfigError(f"{path} at byte {at}: not a stream record ({exc!r})") from exc
            out.append(StreamRecord(partition, format_id(*index.ids[i + len(out)]), fields))
        return out
