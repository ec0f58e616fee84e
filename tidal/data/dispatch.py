"""A training worker's dispatcher: its batches built by data workers, exactly once by step id.

GoldMiner 4 ("Data dispatching and fault tolerance") puts the dispatcher in the runtime beside
the training worker, and so does tidal: the index ranges still come from the master's shard
manager (the trainer's leases, or the logical workers' fixed order), so the master's commit
protocol and ledger do not change, and no batch costs a round trip to the master.

- The loader asks for the batch of one range (``take``) and says which ranges follow it
  (``upcoming``); the dispatcher gives each range it sends out a *step id*, increasing in the
  order the loader will consume them, and keeps up to ``prefetch`` of them in flight, spread over
  the data workers (the one with the fewest outstanding first): any number of data workers feed
  this trainer, and each data worker serves any number of trainers.
- A batch comes back labelled with its step id. The trainer consumes in step-id order and drops
  any batch with a step id at or below the last consumed one (a re-dispatched batch answered
  twice), so re-dispatching is exactly once: GoldMiner's rule.
- A data worker whose connection drops (its process died: ZeroMQ's socket monitor tells within
  milliseconds) or that disappears from the master's list has its outstanding steps
  re-dispatched at once; one that does not answer within ``timeout_s`` has them re-dispatched
  too. With no data worker at all (none started yet, or every one gone) the
  trainer builds its batches itself, as without data workers: it never stalls on them.
- A batch that breaks the codec, a reply for the wrong range or a step id never given is
  reported by name and the batch rebuilt; a batch its ``preprocess`` could not build
  (``tidal.data.batches.BatchError``) is raised to the loader: it fails the job with the step and
  the sample range, never a silent skip. Data workers serve the script's first ``job.loader``
  with data workers; a later loader (an evaluation set, say) is built by the trainer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from tidal.api import frames
from tidal.api.errors import FrameError
from tidal.data.batches import BatchError, unflatten

__all__ = ["Dispatcher"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0  # a data worker that keeps a batch this long has it re-dispatched


@dataclass
class _Task:
    step: int
    key: Hashable
    start: int
    end: int
    address: str | None  # the data worker building it; None: the trainer builds it
    sent_at: float


class Dispatcher:
    """Batches of index ranges, from data workers when there are any.

    Args:
        token: the job's token, in every task.
        loader: the loader's key (``tidal.data.worker.loader_key``).
        build_local: ``(step, start, end) -> batch``, the trainer's own way to build a batch.
        addresses: the data workers' addresses now (read on every call: the reporter updates it).
        prefetch: batches in flight at most (0: two per data worker, at least two).
    """

    def __init__(self, token: str, loader: str, build_local: Callable[[int, int, int], Any],
                 addresses: Callable[[], Sequence[str]], *, prefetch: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_bytes: int = frames.MAX_MESSAGE_BYTES) -> None:
        self.token = token
        self.loader = loader
        self.build_local = build_local
        self.addresses = addresses
        self.prefetch = prefetch
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._ctx = zmq.Context()
        self._socks: dict[str, zmq.Socket[Any]] = {}
        self._monitors: dict[str, zmq.Socket[Any]] = {}  # the DEALERs' connection events
        self._down: set[str] = set()  # disconnected: nothing is sent there until it reconnects
        self._other_loader: set[str] = set()  # serve another loader of the script: never asked again
        self._poller = zmq.Poller()
        self._known: tuple[str, ...] = ()
        self._next_step = 0
        self._last_consumed = -1
        self._tasks: dict[int, _Task] = {}
        self._by_key: dict[Hashable, _Task] = {}
        self._ready: dict[int, Any] = {}
        # counters (cumulative), for the reports: batches received from data workers, built here,
        # consumed, re-dispatched, dropped (duplicates, unknown ids), and seconds waited for one
        self.received = 0
        self.built_here = 0
        self.taken = 0
        self.redispatched = 0
        self.dropped = 0
        self.wait_s = 0.0

    # ------------------------------------------------------------------ the loader's side
    def take(self, key: Hashable, start: int, end: int, upcoming: Iterable[tuple[Hashable, int, int]] = ()) -> Any:
        """The batch of samples ``[start, end)`` (``key`` names the range in this generation);
        ``upcoming`` are the ranges the loader will ask for next, in order.

        Raises:
            tidal.data.batches.BatchError: the batch cannot be built (the message names the step
                and the range).
        """
        self._sync()
        task = self._by_key.get(key)
        if task is None:
            task = self._submit(key, start, end)
        for step in [s for s in self._tasks if s < task.step]:
            self._forget(step)  # skipped by the loader: a later id is consumed first
        self._fill(upcoming)
        t0 = time.perf_counter()
        batch = self._wait(task)
        self.wait_s += time.perf_counter() - t0
        self._last_consumed = task.step
        self._forget(task.step)
        self.taken += 1
        return batch

    def reset(self) -> None:
        """Forget every batch in flight (a re-form voided the leases): whatever arrives for them
        is dropped by its step id."""
        for step in list(self._tasks):
            self._forget(step)
        self._last_consumed = self._next_step - 1

    @property
    def queued(self) -> int:
        """Batches that arrived and wait to be consumed."""
        return len(self._ready)

    def close(self) -> None:
        for address in list(self._socks):
            self._disconnect(address)
        self._ctx.term()

    # ------------------------------------------------------------------ dispatching
    def window(self) -> int:
        return self.prefetch or max(2, 2 * len(self._socks))

    def _fill(self, upcoming: Iterable[tuple[Hashable, int, int]]) -> None:
        window = self.window()
        for key, start, end in upcoming:
            if len(self._tasks) >= window:
                return
            if key not in self._by_key:
                self._submit(key, start, end)

    def _submit(self, key: Hashable, start: int, end: int) -> _Task:
        task = _Task(self._next_step, key, start, end, None, time.monotonic())
        self._next_step += 1
        self._tasks[task.step] = self._by_key[key] = task
        self._send(task, self._pick())
        return task

    def _pick(self, avoid: str | None = None) -> str | None:
        """The data worker with the fewest batches in flight, ``avoid`` excepted (None: none
        there; the trainer builds the batch itself)."""
        choices = [a for a in self._socks if a != avoid and a not in self._down and a not in self._other_loader]
        if not choices:
            return None
        load = {a: 0 for a in choices}
        for t in self._tasks.values():
            if t.address in load and t.step not in self._ready:
                load[t.address] += 1
        return min(choices, key=lambda a: load[a])

    def _send(self, task: _Task, address: str | None) -> None:
        task.address, task.sent_at = address, time.monotonic()
        if address is None:
            return
        meta = {"token": self.token, "loader": self.loader, "start": task.start, "end": task.end}
        try:
            self._socks[address].send_multipart(frames.encode({}, step=task.step, meta=meta), flags=zmq.NOBLOCK)
        except zmq.Again:
            task.address = None  # its queue is full (a stuck peer): build it here

    def _redispatch(self, task: _Task, why: str) -> None:
        if task.step in self._ready:
            return
        address = self._pick(avoid=task.address)
        log.info("step %d (samples [%d, %d)) re-dispatched to %s: %s", task.step, task.start, task.end,
                 address or "this trainer", why)
        self.redispatched += 1
        self._send(task, address)

    def _forget(self, step: int) -> None:
        task = self._tasks.pop(step, None)
        if task is not None:
            self._by_key.pop(task.key, None)
        self._ready.pop(step, None)

    # ------------------------------------------------------------------ the data workers
    def _sync(self) -> None:
        """Connect to the data workers the master lists now; re-dispatch what the gone ones held."""
        now = tuple(self.addresses())
        if now == self._known:
            return
        self._known = now
        for address in now:
            if address not in self._socks:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
                sock.setsockopt(zmq.SNDHWM, 64)
                monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
                sock.connect(address)
                self._socks[address], self._monitors[address] = sock, monitor
                self._poller.register(sock, zmq.POLLIN)
                self._poller.register(monitor, zmq.POLLIN)
        for address in [a for a in self._socks if a not in now]:
            self._disconnect(address)
            self._lost(address, f"data worker at {address} is gone")

    def _disconnect(self, address: str) -> None:
        sock, monitor = self._socks.pop(address), self._monitors.pop(address)
        self._poller.unregister(sock)
        self._poller.unregister(monitor)
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        self._down.discard(address)

    def _lost(self, address: str, why: str) -> None:
        for task in [t for t in self._tasks.values() if t.address == address]:
            self._redispatch(task, why)

    def _wait(self, task: _Task) -> Any:
        while True:
            if task.step in self._ready:
                batch = self._ready[task.step]
                if isinstance(batch, BatchError):
                    raise batch
                return batch
            if task.address is None:
                self.built_here += 1
                return self.build_local(task.step, task.start, task.end)
            if time.monotonic() - task.sent_at > self.timeout_s:
                self._redispatch(task, f"no answer from {task.address} in {self.timeout_s:g} s")
                continue
            self._receive(50)
            self._sync()

    def _receive(self, timeout_ms: int) -> None:
        for sock, _ in self._poller.poll(timeout_ms):
            address = next((a for a, m in self._monitors.items() if m is sock), None)
            if address is not None:
                self._connection_event(address, sock)
                continue
            address = next(a for a, s in self._socks.items() if s is sock)
            while True:
                try:
                    parts = sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._accept(address, parts)

    def _connection_event(self, address: str, monitor: zmq.Socket[Any]) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(flags=zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED and address not in self._down:
                self._down.add(address)
                self._lost(address, f"the connection to data worker {address} dropped")
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._down.discard(address)

    def _accept(self, address: str, parts: list[Any]) -> None:
        try:
            msg = frames.decode(parts, max_bytes=self.max_bytes)
        except FrameError as exc:
            log.error("data worker at %s sent a malformed batch (%s); its batches are rebuilt", address, exc)
            for task in [t for t in self._tasks.values() if t.address == address]:
                self._redispatch(task, "its data worker sent a malformed batch")
            return
        step = msg.step
        if step is None or step <= self._last_consumed or step in self._ready:
            self.dropped += 1  # consumed already, or a second answer to a re-dispatched step
            return
        found = self._tasks.get(step)
        if found is None:
            if step >= self._next_step:
                log.error("data worker at %s sent step %d, which this trainer never gave out; dropped", address, step)
            self.dropped += 1
            return
        task = found
        meta = msg.meta or {}
        if meta.get("start") != task.start or meta.get("end") != task.end:
            log.error("data worker at %s sent step %d for samples [%s, %s), but the step is samples [%d, %d); "
                      "rebuilt", address, step, meta.get("start"), meta.get("end"), task.start, task.end)
            self._redispatch(task, "its batch was for other samples")
            return
        if "refused" in meta:
            if address not in self._other_loader:
                log.warning("%s; this loader's batches are built by the trainer", meta["refused"])
                self._other_loader.add(address)
            self._redispatch(task, "its data worker serves another loader")
            return
        if "error" in meta:
            # raised when the loader reaches this step, not now: the batches before it are good
            self._ready[step] = BatchError(str(meta["error"]))
            return
        try:
            batch = unflatten(meta.get("tree"), msg.tensors)
        except BatchError as exc:
            log.error("data worker at %s sent step %d (samples [%d, %d)) that cannot be read (%s); rebuilt",
                      address, step, task.start, task.end, exc)
            self._redispatch(task, "its batch could not be read")
            return
        self._ready[step] = batch
        self.received += 1
