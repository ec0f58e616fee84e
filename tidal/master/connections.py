"""Connection limits and header timeouts for the master's HTTP server (DESIGN.md 5).

Without them a client that opens connections and sends nothing holds one file descriptor each
for ever (uvicorn arms its keep-alive timer only after a response): about a thousand such
connections used up a 1,024 descriptor limit, accept() failed, workers' reports were missed,
replacement workers could not start, and asyncio logged a traceback per failed accept (several
megabytes a second). ``ConnectionGuard`` bounds both how many connections are open and how long
one may sit without sending a request; ``raise_nofile_limit`` gives the master every descriptor
it is allowed; ``quiet_floods`` keeps what still goes wrong from flooding the log.

What a connection may do:

- *fresh* (accepted, no whole request head yet) or *idle* (between a response and the next
  request head): it must deliver a whole request head within ``HEADER_TIMEOUT_S`` of being
  opened or of its previous response, or it is closed. Legitimate clients send the head at once
  and workers report every 0.25-0.5 s; uvicorn's keep-alive timeout (``KEEP_ALIVE_S``) closes
  quiet keep-alive connections earlier, this bound catches the ones that dribble bytes, which
  cancel uvicorn's timer without ever finishing a request.
- *busy* (a request head was parsed and its response is not finished): never timed out or
  evicted here; long polls (rendezvous, store waits) live here. A client without the job's
  token gets its 401 before its body is read, so it cannot stay busy.

Over the cap a new connection first evicts the oldest fresh connection (nothing legitimate stays
fresh for more than a round trip), then the oldest idle one; only when every connection is busy
is the new one refused. Either way a descriptor is freed at once (an ``abort``, not a 503 as
uvicorn's ``limit_concurrency`` answers while keeping the descriptor), and a flood of silent
connections cannot lock new workers or ``tidal status`` out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import cast

from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0
# uvicorn's keep-alive timeout (was 30 s): workers send a request every 0.25-0.5 s, a client quiet
# for 5 s simply reconnects, and until then each quiet connection holds a descriptor.
KEEP_ALIVE_S = 5
LOG_EVERY_S = 10.0
# Loggers a client can make write a line per connection: asyncio's "socket.accept() out of system
# resource" (with a traceback, once per queued connection) and uvicorn's "Invalid HTTP request".
FLOOD_LOGGERS = ("asyncio", "uvicorn.error")
_UNLIMITED_NOFILE = 1 << 20


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft limit now in force.

    The default soft limit (often 1,024) is a guard for careless programs, not a budget: a server
    that keeps one descriptor per client, per worker log and per launch pipe should use what the
    administrator allows (the hard limit), and size its connection cap from it.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _UNLIMITED_NOFILE if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # e.g. macOS refuses more than kern.maxfilesperproc
            log.debug("cannot raise RLIMIT_NOFILE from %d to %d: %s", soft, target, exc)
        else:
            log.debug("raised RLIMIT_NOFILE from %d to %d", soft, target)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return _UNLIMITED_NOFILE if soft == resource.RLIM_INFINITY else soft


def connection_cap(nofile: int, max_workers: int) -> int:
    """The most connections the control plane keeps open: ``min(nofile / 2, 1024 + 8 * workers)``.

    Each worker holds at most two keep-alive connections plus one per concurrent long poll; eight
    each and 1,024 for ``tidal status``, dashboards and scripts leave room to spare. Half the
    descriptors at most, so that the other half stays for what the master itself opens (journal,
    log files it follows, the pipes of a worker launch) and for connections accepted but not yet
    evicted (see ``accept_batch``).
    """
    return max(16, min(nofile // 2, 1024 + 8 * max(1, max_workers)))


def accept_batch(nofile: int) -> int:
    """How many connections asyncio accepts per wake-up (the ``backlog`` given to uvicorn).

    Accepted connections hold descriptors before the guard sees them: asyncio accepts a batch in
    one loop iteration, builds its transports in the next, calls ``connection_made`` (where the
    guard evicts) in the one after, and closes the victims' sockets in a fourth, so at most about
    four batches are in flight beyond the cap. A batch of 1/16 of the descriptors (16 to 2,048)
    keeps cap + in-flight connections at three quarters of the limit at worst.
    """
    return max(16, min(2048, nofile // 16))


def listen_queue(nofile: int) -> int:
    """The kernel's queue of connections not yet accepted (1/8 of the descriptors, 64 to 2,048).

    asyncio passes one number to both ``listen()`` and its accept loop; a queue as small as the
    batch would make the kernel drop the SYNs of a burst (a 1 s retransmit each, workers and
    ``tidal status`` included), so the server widens the queue again after startup. uvloop
    accepts until the queue is empty, so there this queue is the batch: with two in flight, the
    same three quarters.
    """
    return max(64, min(2048, nofile // 8))


class _GuardedConnection(asyncio.Protocol):
    """Placed before uvicorn's HTTP protocol class in the method order (``protocol_class``)."""

    _guard: ConnectionGuard  # set on the subclass that protocol_class builds
    _guard_transport: asyncio.Transport | None = None
    _guard_admitted = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._guard_transport = transport
        if not self._guard.admit(self):
            transport.abort()  # uvicorn never sees it
            return
        self._guard_admitted = True
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._guard_admitted:
            return
        self._guard.forget(self)
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._guard.response_done(self)

    def close_now(self) -> None:
        if self._guard_transport is not None:
            self._guard_transport.abort()

    @property
    def busy(self) -> bool:
        """A request head was parsed and its response is not finished (uvicorn's request cycle)."""
        cycle = getattr(self, "cycle", None)
        return cycle is not None and not cycle.response_complete


class ConnectionGuard:
    """Caps open connections and closes those that send no request head in time.

    Runs entirely on the server's event loop thread. ``clock`` is injectable so the bookkeeping
    can be driven without waiting; timers use the running loop.
    """

    def __init__(self, max_connections: int, header_timeout_s: float = HEADER_TIMEOUT_S, *,
                 job_id: str = "-", clock: Callable[[], float] = time.monotonic) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.job_id = job_id
        self._clock = clock
        self._open: set[_GuardedConnection] = set()
        # waiting for a request head, oldest first: since connect / since the previous response
        self._fresh: OrderedDict[_GuardedConnection, float] = OrderedDict()
        self._idle: OrderedDict[_GuardedConnection, float] = OrderedDict()
        self._sweeper: asyncio.TimerHandle | None = None
        self.totals = {"refused": 0, "evicted": 0, "timed_out": 0}
        self._unlogged = dict.fromkeys(self.totals, 0)
        self._last_log = float("-inf")

    @property
    def open_count(self) -> int:
        return len(self._open)

    def protocol_class(self, base: type[asyncio.Protocol] = AutoHTTPProtocol) -> type[asyncio.Protocol]:
        """uvicorn's HTTP protocol (h11 or httptools, as uvicorn picks) behind this guard, for
        ``uvicorn.Config(http=...)``."""
        if not hasattr(base, "on_response_complete"):
            raise TypeError(f"{base.__name__} has no on_response_complete: not a uvicorn HTTP protocol")
        return cast(type[asyncio.Protocol],
                    type(f"Guarded{base.__name__}", (_GuardedConnection, base), {"_guard": self}))

    # ------------------------------------------------------------------ protocol callbacks
    def admit(self, conn: _GuardedConnection) -> bool:
        """A new connection: True to serve it, False to close it (every connection busy)."""
        if len(self._open) >= self.max_connections and not self._evict_one():
            self._count("refused")
            return False
        self._open.add(conn)
        self._fresh[conn] = self._clock()
        self._ensure_sweeper()
        return True

    def response_done(self, conn: _GuardedConnection) -> None:
        if conn not in self._open:
            return
        self._fresh.pop(conn, None)
        self._idle.pop(conn, None)
        self._idle[conn] = self._clock()
        self._ensure_sweeper()

    def forget(self, conn: _GuardedConnection) -> None:
        self._open.discard(conn)
        self._fresh.pop(conn, None)
        self._idle.pop(conn, None)

    # ------------------------------------------------------------------ decisions
    def _evict_one(self) -> bool:
        for waiting in (self._fresh, self._idle):
            while waiting:
                conn, _ = waiting.popitem(last=False)
                if conn.busy:
                    continue  # its head arrived since; response_done puts it back
                self._close(conn)
                self._count("evicted")
                return True
        return False

    def sweep(self) -> None:
        """Close every connection that has waited longer than the header timeout for a head."""
        deadline = self._clock() - self.header_timeout_s
        for waiting in (self._fresh, self._idle):
            while waiting:
                conn, since = next(iter(waiting.items()))
                if since > deadline:
                    break
                del waiting[conn]
                if not conn.busy:
                    self._close(conn)
                    self._count("timed_out")
        self._log_closes()

    def _close(self, conn: _GuardedConnection) -> None:
        self.forget(conn)
        conn.close_now()

    # ------------------------------------------------------------------ timers and logging
    def _ensure_sweeper(self) -> None:
        if self._sweeper is None:
            period = min(1.0, self.header_timeout_s / 4)
            self._sweeper = asyncio.get_running_loop().call_later(period, self._on_sweep)

    def _on_sweep(self) -> None:
        self._sweeper = None
        self.sweep()
        if self._fresh or self._idle or any(self._unlogged.values()):
            self._ensure_sweeper()

    def _count(self, what: str) -> None:
        self.totals[what] += 1
        self._unlogged[what] += 1
        self._log_closes()

    def _log_closes(self) -> None:
        """One line per LOG_EVERY_S at most, however many connections a flood brings."""
        now = self._clock()
        if not any(self._unlogged.values()) or now - self._last_log < LOG_EVERY_S:
            return
        u = self._unlogged
        log.warning("job %s: control plane: %d connections open (cap %d); closed %d that sent no "
                    "request head within %.0f s, evicted %d waiting ones over the cap, refused %d",
                    self.job_id, len(self._open), self.max_connections, u["timed_out"],
                    self.header_timeout_s, u["evicted"], u["refused"])
        self._unlogged = dict.fromkeys(self.totals, 0)
        self._last_log = now


class RateLimitFilter(logging.Filter):
    """Lets each distinct message (its first line) through at most once per ``every_s``; the
    next one let through says how many were dropped."""

    def __init__(self, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int]] = {}  # key -> (last let through, dropped since)

    def filter(self, record: logging.LogRecord) -> bool:
        key = str(record.msg).split("\n", 1)[0][:200]
        now = self._clock()
        with self._lock:
            last, dropped = self._seen.get(key, (float("-inf"), 0))
            if now - last < self.every_s:
                self._seen[key] = (last, dropped + 1)
                return False
            if len(self._seen) > 1000:
                self._seen.clear()
            self._seen[key] = (now, 0)
        if dropped:
            record.msg = f"{record.msg}\n({dropped} more like this in the last {now - last:.0f} s not shown)"
        return True


@contextlib.contextmanager
def quiet_floods(loggers: tuple[str, ...] = FLOOD_LOGGERS) -> Iterator[RateLimitFilter]:
    """Rate-limit the loggers a flood of connections can make write per connection, while the
    server runs. asyncio (3.11) logs a traceback for *each* accept() that fails with EMFILE, and
    retries every second: at a descriptor shortage that was most of 87 MB of stderr in 10 s."""
    limiter = RateLimitFilter()
    targets = [logging.getLogger(name) for name in loggers]
    for logger in targets:
        logger.addFilter(limiter)
    try:
        yield limiter
    finally:
        for logger in targets:
            logger.removeFilter(limiter)

