"""The rendezvous store of the workers' process groups: a bounded key-value map, no I/O.

It replaces torch.distributed's TCPStore, which listened on every interface, took no credential
and kept whatever anyone wrote (a probe put 400 MiB in it). The master serves this map on its
own control plane (``/v1/store/*`` in tidal.master.service: bearer token, body-size limit, the
job's host) and workers reach it through tidal.worker.store.MasterStore, a c10d ``Store``.

Every key lives under a round's prefix ``tidal/{job_id}/round{R}/`` (the prefix the workers
give their ``PrefixStore``). Only rounds next to the master's current round are accepted: a
worker forms group R right after the master closed round R, and the peers of R - 1 may still
be finishing. Rounds that fall out of that window are dropped whole, so memory stays flat over
any number of rounds; within it, limits bound one key, one value, the total bytes and the key
count. Each refusal is a MasterError carrying its HTTP status.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tidal.api import MAX_STORE_KEY_CHARS, MAX_STORE_VALUE_BYTES, PermanentError, RetryableError
from tidal.master.api import MasterError, StaleRoundMasterError

# What one entry costs beyond its key and value bytes (dict slot, str and bytes headers);
# counted against ``max_total_bytes`` so a flood of tiny keys is bounded too.
ENTRY_OVERHEAD_BYTES = 128
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_INTEGER = re.compile(rb"-?[0-9]{1,19}")


class StoreKeyError(MasterError, PermanentError):
    """The key is too long, not ASCII, or outside this job's round prefixes."""

    status = 400


class StoreValueError(MasterError, PermanentError):
    """``add`` on a value that is not a decimal integer, or a sum beyond int64."""

    status = 400


class StoreValueTooLargeError(MasterError, PermanentError):
    status = 413


class StoreFullError(MasterError, RetryableError):
    """The store holds its maximum; space comes back when the master's round moves on."""

    status = 507


class StoreStaleRoundError(StaleRoundMasterError):
    """The key names a round outside the window around the master's current round (409)."""


@dataclass(frozen=True)
class StoreLimits:
    max_key_bytes: int = MAX_STORE_KEY_CHARS
    max_value_bytes: int = MAX_STORE_VALUE_BYTES
    max_total_bytes: int = 64 << 20  # keys + values + ENTRY_OVERHEAD_BYTES per key
    max_keys: int = 65536
    rounds_behind: int = 1  # rounds below the current one that are kept
    rounds_ahead: int = 1


class RoundStore:
    """The key-value map behind ``/v1/store``: c10d's operations, bounded, per round.

    The caller (the service) tells it the master's round with ``observe_round`` before each
    operation; nothing here reads a clock or does I/O. Values are bytes; ``add`` keeps its
    counter as decimal ASCII, as c10d's stores do, so ``get`` after ``add`` reads the number.

    Raises (every operation):
        StoreKeyError: a malformed key or one outside ``tidal/{job_id}/round{R}/``.
        StoreStaleRoundError: R is outside the window around the current round.
        StoreValueTooLargeError: a value over ``max_value_bytes``.
        StoreFullError: the write would pass ``max_total_bytes`` or ``max_keys``.
    """

    def __init__(self, job_id: str, limits: StoreLimits | None = None) -> None:
        self.limits = limits or StoreLimits()
        self._prefix = f"tidal/{job_id}/round"
        self._rounds: dict[int, dict[str, bytes]] = {}
        self._current = -1
        self.total_bytes = 0
        self.key_count = 0

    # ------------------------------------------------------------------ rounds
    def observe_round(self, current: int) -> None:
        """The master's current round: drop every round that left the window (garbage collection)."""
        if current == self._current:
            return
        self._current = current
        low, high = self._window()
        for r in [r for r in self._rounds if not low <= r <= high]:
            for key, value in self._rounds.pop(r).items():
                self.total_bytes -= _cost(key, value)
                self.key_count -= 1

    @property
    def rounds(self) -> list[int]:
        """Rounds that hold keys, oldest first."""
        return sorted(self._rounds)

    def _window(self) -> tuple[int, int]:
        return self._current - self.limits.rounds_behind, self._current + self.limits.rounds_ahead

    def _round_of(self, key: str) -> int:
        if len(key) > self.limits.max_key_bytes or not key.isascii():
            raise StoreKeyError(f"store keys are ASCII of at most {self.limits.max_key_bytes} bytes")
        if not key.startswith(self._prefix):
            raise StoreKeyError(f"key {key[:80]!r} is not under {self._prefix}<R>/")
        digits, slash, _ = key[len(self._prefix):].partition("/")
        if not slash or not digits.isdigit() or len(digits) > 18 or (len(digits) > 1 and digits[0] == "0"):
            raise StoreKeyError(f"key {key[:80]!r} is not under {self._prefix}<R>/")
        r = int(digits)
        low, high = self._window()
        if not low <= r <= high:
            raise StoreStaleRoundError(f"round {r} is not open in the store (the master is at round {self._current})")
        return r

    # ------------------------------------------------------------------ c10d operations
    def set(self, key: str, value: bytes) -> None:
        self._put(self._round_of(key), key, value)

    def get(self, key: str) -> bytes | None:
        """The value, or None while the key does not exist (the service long-polls on that)."""
        return self._rounds.get(self._round_of(key), {}).get(key)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter at ``key`` (0 if absent); returns the new value."""
        r = self._round_of(key)
        old = self._rounds.get(r, {}).get(key)
        base = 0
        if old is not None:
            if not _INTEGER.fullmatch(old):
                raise StoreValueError(f"add: the value at {key[:80]!r} is not a decimal integer")
            base = int(old)
        total = base + amount
        if not _I64_MIN <= total <= _I64_MAX:
            raise StoreValueError(f"add: {base} + {amount} is beyond int64")
        self._put(r, key, str(total).encode())
        return total

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """TCPStore's semantics: set ``desired`` if the value is ``expected`` (or the key is absent
        and ``expected`` empty); returns the value now held (``expected`` if absent and not set)."""
        r = self._round_of(key)
        self._check_value(expected)
        self._check_value(desired)
        old = self._rounds.get(r, {}).get(key)
        if old is None:
            if expected:
                return expected
            self._put(r, key, desired)
            return desired
        if old == expected:
            self._put(r, key, desired)
            return desired
        return old

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists (all are validated first)."""
        found = [self._rounds.get(self._round_of(k), {}).get(k) is not None for k in keys]
        return all(found)

    def delete(self, key: str) -> bool:
        r = self._round_of(key)
        entries = self._rounds.get(r)
        if entries is None or key not in entries:
            return False
        value = entries.pop(key)
        self.total_bytes -= _cost(key, value)
        self.key_count -= 1
        if not entries:
            del self._rounds[r]
        return True

    def num_keys(self, prefix: str) -> int:
        """Keys under ``prefix``, which must name a round (``tidal/{job_id}/round{R}/...``)."""
        r = self._round_of(prefix)
        return sum(1 for k in self._rounds.get(r, {}) if k.startswith(prefix))

    # ------------------------------------------------------------------ accounting
    def _check_value(self, value: bytes) -> None:
        if len(value) > self.limits.max_value_bytes:
            raise StoreValueTooLargeError(
                f"store value of {len(value)} bytes is over the limit of {self.limits.max_value_bytes}")

    def _put(self, r: int, key: str, value: bytes) -> None:
        self._check_value(value)
        entries = self._rounds.get(r)
        old = entries.get(key) if entries is not None else None
        added_keys = 0 if old is not None else 1
        grow = _cost(key, value) - (_cost(key, old) if old is not None else 0)
        if self.key_count + added_keys > self.limits.max_keys:
            raise StoreFullError(f"the store holds its maximum of {self.limits.max_keys} keys")
        if self.total_bytes + grow > self.limits.max_total_bytes:
            raise StoreFullError(f"the store holds its maximum of {self.limits.max_total_bytes} bytes")
        if entries is None:
            entries = self._rounds[r] = {}
        entries[key] = value
        self.total_bytes += grow
        self.key_count += added_keys


def _cost(key: str, value: bytes) -> int:
    return len(key) + len(value) + ENTRY_OVERHEAD_BYTES
