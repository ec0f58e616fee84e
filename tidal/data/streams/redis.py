"""Redis Streams as a ``StreamSource`` (DESIGN.md 3), on redis-py.

Partition ``p`` of ``redis://HOST:PORT/NAME`` is the stream key ``NAME:p``; partitions are
found with ``SCAN MATCH NAME:* TYPE stream``. The source keeps no consumer state in Redis (no
consumer groups, see ``tidal.data.api``): reads are ``XRANGE`` from an exclusive start, or
``XREAD BLOCK`` when the caller waits; ids are the ones Redis gives on ``XADD``.

Failures: the constructor pings the server once and raises ``ConfigError`` when it does not
answer (a wrong host or port is a configuration problem, not worth half a minute of retries).
After that, every call retries connection errors and timeouts (Redis restarting, or still
loading its data) with exponential backoff for up to ``retry_s`` seconds, then raises
``StreamUnavailableError``. redis-py's own retries are off so that this loop is the only one.
Replies of XRANGE, XREVRANGE and XREAD are taken as hiredis parses them (``[id, [name, value,
...]]``), without redis-py's conversion to dicts: records are built from them in one pass.
Reads are naturally idempotent. An ``append`` whose reply was lost may or may not have been
applied; its records go in one ``MULTI``/``EXEC`` (all or none), and before sending them again
the source looks for them after the partition's last id of before the attempt, so a retry does
not duplicate them (only a second producer appending an identical batch in that window could
fool it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tidal.api import ConfigError
from tidal.data.api import FIRST, StreamRecord, StreamUnavailableError, parse_id
from tidal.data.streams import parse_stream_url

__all__ = ["RedisStreamSource"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT = (redis.ConnectionError, redis.TimeoutError)  # BusyLoadingError (LOADING) is a ConnectionError
_FIRST_DELAY_S = 0.05
_MAX_DELAY_S = 2.0
_SOCKET_TIMEOUT_S = 10.0  # a server that holds a connection silent this long counts as down
_BLOCK_SLICE_S = 5.0  # XREAD BLOCK in slices shorter than the socket timeout
_PAGE = 1000  # records per XRANGE when a call must walk many


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class _Backoff:
    """Sleeps between tries of one call; raises ``StreamUnavailableError`` once ``retry_s`` is spent."""

    def __init__(self, url: str, what: str, retry_s: float) -> None:
        self.url, self.what, self.retry_s = url, what, retry_s
        self.deadline: float | None = None
        self.delay = _FIRST_DELAY_S

    def wait(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.retry_s
            log.warning("redis at %s: %s failed (%s); retrying for up to %g s", self.url, self.what,
                        _one_line(exc), self.retry_s)
        if now >= self.deadline:
            raise StreamUnavailableError(
                f"redis at {self.url} did not answer {self.what} for {self.retry_s:g} s: {_one_line(exc)}"
            ) from exc
        time.sleep(min(self.delay, self.deadline - now))
        self.delay = min(self.delay * 2, _MAX_DELAY_S)


class RedisStreamSource:
    """The stream ``redis://HOST:PORT/NAME``; see the module docstring for its failure handling.

    Raises:
        ConfigError: a bad URL, or a server that does not answer (from the constructor).
    """

    def __init__(self, url: str, *, retry_s: float = 30.0, connect_timeout_s: float = 2.0) -> None:
        where = parse_stream_url(url)
        if where.scheme != "redis" or where.host is None or where.port is None:
            raise ConfigError(f"{url!r} is not a redis:// stream URL")
        self.url = url
        self.name = where.name
        self.retry_s = retry_s
        self._redis = redis.Redis(
            host=where.host, port=where.port, protocol=2, decode_responses=False,
            socket_timeout=_SOCKET_TIMEOUT_S, socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0), client_name="tidal-stream",
        )
        for command in ("XRANGE", "XREVRANGE", "XREAD"):  # this client's own table, not redis-py's
            self._redis.set_response_callback(command, _raw_reply)
        self.check()

    def check(self) -> None:
        """One ``PING``, no retries.

        Raises:
            ConfigError: the server does not answer, or refuses the connection.
        """
        try:
            self._redis.ping()
        except redis.RedisError as exc:
            self._redis.close()
            raise ConfigError(f"cannot reach redis at {self.url}: {_one_line(exc)}") from exc

    # ------------------------------------------------------------------ StreamSource
    def partitions(self) -> list[int]:
        prefix = f"{self.name}:"
        keys = self._call("SCAN", self._scan, prefix + "*")
        found = set()
        for key in keys:
            suffix = key.decode("utf-8", "replace")[len(prefix):]
            if suffix.isdigit() and suffix.isascii() and str(int(suffix)) == suffix:
                found.add(int(suffix))
        return sorted(found)

    def read(self, partition: int, after: str, count: int, block_s: float = 0.0) -> list[StreamRecord]:
        key = self._key(partition)
        parse_id(after)
        if count < 1:
            return []
        if block_s <= 0:
            return self._records(partition, self._call(
                "XRANGE", self._redis.xrange, key, f"({after}", "+", count=count))
        deadline = time.monotonic() + block_s
        while True:
            wait_ms = max(1, int(min(deadline - time.monotonic(), _BLOCK_SLICE_S) * 1000))
            reply = self._call("XREAD", self._redis.xread, {key: after}, count=count, block=wait_ms)
            if reply:
                return self._records(partition, reply[0][1])
            if time.monotonic() >= deadline:
                return []

    def range(self, partition: int, first: str, last: str) -> list[StreamRecord]:
        key = self._key(partition)
        if parse_id(first) > parse_id(last):
            return []
        out: list[StreamRecord] = []
        start = first
        while True:
            page = self._call("XRANGE", self._redis.xrange, key, start, last, count=_PAGE)
            out.extend(self._records(partition, page))
            if len(page) < _PAGE:
                return out
            start = "(" + out[-1].id

    def last_id(self, partition: int) -> str:
        key = self._key(partition)
        newest = self._call("XREVRANGE", self._redis.xrevrange, key, "+", "-", count=1)
        return newest[0][0].decode() if newest else FIRST

    def lag(self, partition: int, after: str) -> int:
        """Counts from both ends at once, a page at a time: ``XRANGE`` forward from ``after``
        and ``XREVRANGE`` back from it, against ``XLEN``; whichever side ends first gives the
        answer. Redis has no O(1) rank of an id, so this reads min(lag, length - lag) records,
        rounded up to a page of 1,000. A snapshot: records appended while it counts may be
        left out."""
        key = self._key(partition)
        parse_id(after)

        def first_pages() -> list[Any]:
            pipe = self._redis.pipeline(transaction=True)
            pipe.xlen(key)
            pipe.xrange(key, f"({after}", "+", count=_PAGE)
            pipe.xrevrange(key, after, "-", count=_PAGE)
            return pipe.execute()

        length, forward, backward = self._call("XLEN", first_pages)
        ahead, behind = len(forward), len(backward)
        while True:
            if len(forward) < _PAGE:
                return ahead
            if len(backward) < _PAGE:
                return max(0, length - behind)
            fstart, bend = "(" + forward[-1][0].decode(), "(" + backward[-1][0].decode()
            forward = self._call("XRANGE", self._redis.xrange, key, fstart, "+", count=_PAGE)
            ahead += len(forward)
            if len(forward) < _PAGE:
                return ahead
            backward = self._call("XREVRANGE", self._redis.xrevrange, key, bend, "-", count=_PAGE)
            behind += len(backward)

    def appended(self, partition: int) -> int:
        """``XINFO STREAM``'s entries-added (Redis 7); XLEN on an older server (then trimmed
        records are not counted)."""
        key = self._key(partition)
        try:
            info = self._call("XINFO STREAM", self._redis.xinfo_stream, key)
        except ConfigError:  # no such key: nothing appended yet
            return 0
        added = info.get("entries-added")
        return int(added) if added is not None else int(info.get("length", 0))

    def append(self, partition: int, records: list[dict[str, bytes]]) -> list[str]:
        key = self._key(partition)
        if not records:
            return []
        if not all(records):
            raise ConfigError("a stream record needs at least one field")
        before = self.last_id(partition)
        backoff = _Backoff(self.url, "XADD", self.retry_s)
        unsure = False  # an attempt may have been applied without its reply reaching us
        while True:
            try:
                if unsure:
                    landed = self._find_batch(key, before, records)
                    if landed is not None:
                        return landed
                    unsure = False
                return self._translate("XADD", self._xadd_batch, key, records)
            except _TRANSIENT as exc:
                unsure = True
                backoff.wait(exc)

    def trim(self, partition: int, upto: str) -> int:
        key = self._key(partition)
        ms, seq = parse_id(upto)
        # XTRIM MINID keeps ids >= MINID: the id just above ``upto`` deletes ``upto`` itself too
        minid = f"{ms}-{seq + 1}" if seq < 2**64 - 1 else f"{ms + 1}-0"
        return int(self._call("XTRIM", self._redis.xtrim, key, minid=minid, approximate=False))

    def close(self) -> None:
        self._redis.close()

    # ------------------------------------------------------------------ helpers
    def _key(self, partition: int) -> str:
        if isinstance(partition, bool) or not isinstance(partition, int) or partition < 0:
            raise ConfigError(f"stream partition {partition!r} is not a non-negative integer")
        return f"{self.name}:{partition}"

    def _call(self, what: str, op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``op(*args, **kwargs)``, retried on connection errors; Redis' refusals become ``ConfigError``."""
        backoff = _Backoff(self.url, what, self.retry_s)
        while True:
            try:
                return self._translate(what, op, *args, **kwargs)
            except _TRANSIENT as exc:
                backoff.wait(exc)

    def _translate(self, what: str, op: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return op(*args, **kwargs)
        except redis.ResponseError as exc:  # e.g. WRONGTYPE: NAME:p is not a stream
            raise ConfigError(f"redis at {self.url} refused {what}: {_one_line(exc)}") from exc

    def _scan(self, pattern: str) -> list[bytes]:
        return list(self._redis.scan_iter(match=pattern, count=_PAGE, _type="stream"))

    def _xadd_batch(self, key: str, records: list[dict[str, bytes]]) -> list[str]:
        pipe = self._redis.pipeline(transaction=True)  # MULTI/EXEC: the batch lands whole or not at all
        for fields in records:
            pipe.xadd(key, fields)  # type: ignore[arg-type]
        return [raw.decode() for raw in pipe.execute()]

    def _find_batch(self, key: str, before: str, records: list[dict[str, bytes]]) -> list[str] | None:
        """The ids of ``records`` if a run of them follows ``before`` (an append whose reply was lost)."""
        entries: list[Any] = []
        start = f"({before}"
        while True:
            page: Any = self._redis.xrange(key, start, "+", count=_PAGE)
            entries.extend(page)
            if len(page) < _PAGE:
                break
            start = "(" + page[-1][0].decode()
        # XADD keeps a record's fields in the order given: the reply lists them the same way
        wanted = [[part for name, value in fields.items() for part in (name.encode(), bytes(value))]
                  for fields in records]
        n = len(wanted)
        for i in range(len(entries) - n + 1):
            if all(entries[i + j][1] == wanted[j] for j in range(n)):
                return [entries[i + j][0].decode() for j in range(n)]
        return None

    @staticmethod
    def _records(partition: int, entries: Any) -> list[StreamRecord]:
        """Redis' raw entries as records. Ids are Redis' own (well-formed by construction): the first
        and last of a reply are checked, which bounds the others (a reply is in id order). A
        stream's records usually have the same one field: a record whose only field is named as
        the first record's takes the short path; the others go through ``_fields``."""
        if not entries:
            return []
        parse_id(entries[0][0].decode())
        parse_id(entries[-1][0].decode())
        names: dict[bytes, str] = {}
        head = entries[0][1]
        name = head[0] if head and len(head) == 2 else None
        text = _field_name(names, name) if name is not None else ""
        new = tuple.__new__  # StreamRecord(...) runs a Python __new__: a quarter of this loop
        return [new(StreamRecord, (partition, raw_id.decode(),
                                   {text: raw[1]} if raw and len(raw) == 2 and raw[0] == name else _fields(names, raw)))
                for raw_id, raw in entries]


def _raw_reply(response: Any, **options: Any) -> Any:
    """A response callback that keeps hiredis' lists (redis-py's would build a dict per record)."""
    return response


def _field_name(names: dict[bytes, str], name: bytes) -> str:
    """A field name as text, decoded once per reply (names repeat from record to record)."""
    text = names.get(name)
    if text is None:
        text = names[name] = name.decode("utf-8", "backslashreplace")
    return text


def _fields(names: dict[bytes, str], raw: list[bytes] | None) -> dict[str, bytes]:
    """``[name, value, ...]`` as a dict (None or empty: a record without fields)."""
    it = iter(raw or ())
    return {_field_name(names, name): value for name, value in zip(it, it, strict=False)}
