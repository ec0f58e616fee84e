"""The stream source interface (DESIGN.md 3): what online training reads, and what it commits.

A stream has partitions (Kale 2.2-2.3: a topic's partitions, uneven in traffic). Each partition
is an append-only sequence of records, each with an *id* that orders it within its partition
(Redis Streams' ``<ms>-<seq>``; the file source uses the same form). tidal never stores its
read position in the stream system (no consumer groups): a record counts as consumed only when
the step that trained it is committed, and the master journals the committed position of every
partition with the step (the exactly-once rule of DESIGN.md 4). So a source is stateless about
consumers: ``read`` takes the position to read after.

Ids compare as ``(ms, seq)`` integer pairs (``parse_id``), never as strings.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from tidal.api import RetryableError
from tidal.api.streams import format_id, parse_id

__all__ = ["FIRST", "MAX_FIELDS", "MAX_FIELD_BYTES", "StreamRecord", "StreamSource", "StreamUnavailableError",
           "format_id", "parse_id"]

FIRST = "0-0"  # the position before every record: read after it to start at the beginning
MAX_FIELDS = 64  # per record: a record over the limits is malformed (counted and skipped, never trained)
MAX_FIELD_BYTES = 1 << 20


class StreamUnavailableError(RetryableError):
    """The stream system did not answer (down, restarting) after the source's retries."""


class StreamRecord(NamedTuple):
    """One record (a tuple: a batch of 512 is built per step, and a frozen dataclass costs
    several times as much to create)."""

    partition: int
    id: str  # "<ms>-<seq>"
    fields: dict[str, bytes]


class StreamSource(Protocol):
    """One stream, ``url`` (``redis://HOST:PORT/NAME``: partition ``p`` is the key ``NAME:p``; or
    ``file:///ABS/DIR/NAME``: a recorded stream, one file per partition). Implementations:
    ``tidal.data.streams.redis``, ``tidal.data.streams.file``; ``tidal.data.streams.open_source``
    picks by the URL's scheme. One contract suite (tests/data/test_stream_sources.py) runs against
    every implementation.

    Every method may raise ``StreamUnavailableError`` once the source's own retries (with
    backoff) are spent.
    """

    url: str

    def partitions(self) -> list[int]:
        """The partitions that exist now, ascending (a partition appears with its first record)."""
        ...

    def read(self, partition: int, after: str, count: int, block_s: float = 0.0) -> list[StreamRecord]:
        """Up to ``count`` records of ``partition`` with ids above ``after``, in id order; waits up
        to ``block_s`` for the first one when there is none yet (0: do not wait)."""
        ...

    def range(self, partition: int, first: str, last: str) -> list[StreamRecord]:
        """Every record with ``first <= id <= last`` (audits: the ledger against the stream)."""
        ...

    def last_id(self, partition: int) -> str:
        """The id of the partition's newest record (``FIRST`` when it has none)."""
        ...

    def lag(self, partition: int, after: str) -> int:
        """How many records of ``partition`` have ids above ``after`` (the backlog of a reader
        that has committed up to ``after``)."""
        ...

    def appended(self, partition: int) -> int:
        """How many records were ever appended to ``partition`` (trimmed ones included): O(1), so
        that a reader can follow its backlog as ``lag`` once plus what arrived since, minus
        what it read (``lag`` itself may have to walk the stream)."""
        ...

    def append(self, partition: int, records: list[dict[str, bytes]]) -> list[str]:
        """Append records (a producer: ``tidal produce``); their new ids, in order."""
        ...

    def trim(self, partition: int, upto: str) -> int:
        """Delete the records with ids up to ``upto`` (``--trim-after-commit`` only: tidal never
        deletes records unless asked); how many were deleted."""
        ...

    def close(self) -> None: ...
