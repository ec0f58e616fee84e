"""Stream record ids as 64-bit integers, for the step header and the journal (issue 18).

Record ids are ``"<ms>-<seq>"`` (Redis Streams' form; ``tidal.data.api``). tidal moves them
through the step header (int64 fields) and the journal's packed ledger rows, so an id is packed
as ``ms << SEQ_BITS | seq``: integer order is the ids' order. An id that does not fit (a
sequence of 2**20 or more within one millisecond, or a time past the year 2248) is refused.
"""

from __future__ import annotations

from tidal.api.errors import ConfigError

SEQ_BITS = 20
_MAX_MS = (1 << (63 - SEQ_BITS)) - 1
# A step of a stream job trains at most this many ranges per worker (each of one partition, its
# ids in ``(after, last]``): the step header has a slot for each (``tidal.worker.comm``).
STEP_RANGES = 8
# One such range as the step header carries it: partition, the packed id it was read after, its
# first and last packed ids (both included), and its records.
Span = tuple[int, int, int, int, int]


def parse_id(record_id: str) -> tuple[int, int]:
    """``"<ms>-<seq>"`` as an integer pair, the order of ids within a partition.

    Raises:
        ConfigError: not an id.
    """
    if not isinstance(record_id, str):
        raise ConfigError(f"{record_id!r} is not a stream record id (<ms>-<seq>)")
    ms, sep, seq = record_id.partition("-")
    if not sep or not (ms.isascii() and ms.isdigit()) or not (seq.isascii() and seq.isdigit()):
        raise ConfigError(f"{record_id!r} is not a stream record id (<ms>-<seq>)")
    return int(ms), int(seq)


def format_id(ms: int, seq: int) -> str:
    return f"{ms}-{seq}"


def pack_id(record_id: str) -> int:
    """``"<ms>-<seq>"`` as one non-negative int64 (``"0-0"`` is 0).

    Raises:
        ConfigError: not an id, or one that does not fit.
    """
    m, s = parse_id(record_id)
    if m > _MAX_MS or s >= 1 << SEQ_BITS:
        raise ConfigError(f"stream record id {record_id!r} does not fit tidal's 64-bit ids "
                          f"(a sequence number of at most {(1 << SEQ_BITS) - 1} within a millisecond)")
    return (m << SEQ_BITS) | s


def unpack_id(packed: int) -> str:
    return f"{packed >> SEQ_BITS}-{packed & ((1 << SEQ_BITS) - 1)}"
