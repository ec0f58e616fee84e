"""Global data shuffling for stream jobs (Kale 3.5): one Shuffle Unit per worker.

Partitions are uneven (Kale 2.3): a worker whose partitions carry most of the traffic falls
behind while the others idle. Each worker's ``ShuffleUnit`` keeps a *local queue* of batches
read from its own partitions; a reader thread fills it up to ``upper`` records: of a read that
would take it past them it keeps what fits, and the rest, like every read while it is full, is
*overflow* and goes to another worker that accepts it (Kale 3.5.2, the threshold-based
forwarding policy):

* A worker *accepts* while its queue is short: it stops accepting once its queue holds more than
  ``upper`` records and accepts again once it holds fewer than ``lower`` (hysteresis), unless
  its own partitions saturate it (over its last ``SATURATION_STEPS`` steps they brought
  ``SATURATION_SHARE`` of a step's batch or more a step). Such a worker's queue is short only
  for a moment after each take (with UPPER at a batch, empty); accepting then, it broadcast two
  changes a step and took others' records in place of its own, which it forwarded instead.
  Judged by each step alone (every one of the last four found a batch of its own records), a
  worker whose partitions bring 1.1 batches a step, give or take 12%, was short in about one
  step of five and so judged saturated only about a third of the time: the busiest workers
  forwarded to each other, and the records they exchanged waited behind full queues (RESULTS,
  Kale live, thirty-third and thirty-fourth runs: ``bench/shuffle.py`` at that load, the busiest
  workers held records of others' partitions). Each change is broadcast to the other workers
  (Kale's event-driven notification, no coordinator); each keeps the set of workers that accept.
* A word of "accepting" is good for the receiver's ``upper`` records from each sender (a
  *credit*, in the word): a sender that has forwarded that many to a receiver since its last word
  counts it as refusing until it hears again. A receiver that has received ``upper / 2`` records
  since its last word says "accepting" again once its queue is below ``lower``. Without a bound, a reader catching up on
  a backlog read faster than any notification travels: a receiver was sent 6,000 records past
  its upper threshold of 512 before its "not accepting" arrived, and trained them alone while
  the others idled (tests/test_stream_shuffle.py, a job 3-4 times as long as usual).
* A sender forwards a partition's overflow to one receiver for as long as it accepts, then
  to another picked at random from that set: the pieces it forwards then continue each other
  at the receiver, and a step takes them as one range (``take_runs``); picked at random for
  each piece, they continued each other nowhere (RESULTS, Kale live, thirty-first and
  thirty-second runs: a third fewer records forwarded, p99 lag 5% lower at rho 1.1). A
  forwarded batch is written to the receiver's local queue and is never forwarded again (no cascades, no cycles). With nobody
  accepting, the sender stops reading until its queue has room: the records wait in the stream.
* Each step takes the next batch of the local queue, then the queued batches after it up to the
  step's batch size, joining those that continue each other (``take_runs``: up to
  ``STEP_RANGES`` partitions a step): a worker that keeps up reads a few records at a time, so
  after such a read the reader reads its other partitions at once (a *sweep*) and, once a read
  finds nothing, waits for a step rather than read again at once. Waiting after each partition's
  short read left a worker's second partition unread for up to two waits (100 ms, 9.6 trace s at
  a 96x compression) whenever its queue held a batch, which near saturation it always does.
  A step that finds less than its batch queued while the reader so waits first has it sweep
  (a *top-up*, waiting at most ``TOPUP_WAIT_S``): a record that arrived during the reader's wait
  is trained by this step rather than the next. Without it a record waited in the stream for up
  to ``poll_s`` (50 ms) and, when a step began meanwhile, a whole step more; at a day compressed
  96x that is 4.8 trace s on every partition, and the live lag at rest read 4.1 trace s, four
  times what a step's own pipeline leaves (RESULTS, Kale live, twenty-fifth run).
* Messages go through a *forwarding unit* thread that owns the sending sockets (ZeroMQ PUSH to
  each peer's PULL socket); a batch it cannot hand to ZeroMQ within ``SEND_TIMEOUT_S``
  comes back to the sender's own queue, so no batch is stranded while its round lasts.
* Each round the units publish their addresses in the round's store (the master's, under the
  round's prefix, as ``torch.distributed`` does) and connect to each other's; once connected, a
  unit repeats its state to the others (a change made before that reached nobody). Units bind
  this machine's address on the route to the master (``tidal.api.rpc.node_address``): 127.0.0.1
  on one machine, the machine's own across several (the Ray backend).

Exactly once. A batch is a partition's records in ``(after, last]`` (``Batch``); the step that
trains it carries ``after``, ``first`` and ``last`` in its header whoever trains it, and the
master commits ranges of one partition in any order (``tidal.master.streams``: a range beyond a
gap waits until the gap is committed). Everything belongs to one round: a re-form drops the
queue, every message of an earlier round is dropped on arrival, and the next round reads again
from the committed positions, skipping the ranges committed ahead. A record forwarded to a
worker that dies before training it is therefore read again, and one it trained and committed
never is. The ledger names the worker that trained each range.

Wire (``tidal.api.frames``, no pickle): a state message is a header only, ``meta`` =
``{"kind": "state", "token", "round", "rank", "accepting"}``; a batch has the tensors ``ids``
(int64 packed ids), ``shape`` (int32, per record the index of its field names in ``meta.names``),
``lengths`` (int64, every field's byte length in order) and ``data`` (uint8, the field values back
to back), with ``meta`` = ``{"kind": "batch", "token", "round", "rank", "partition", "after",
"names"}``. The receiver checks the job's token, the round, every length against the data, and
that the ids rise after ``after``; a message that fails is logged and dropped.
"""

from __future__ import annotations

import datetime
import hmac
import itertools
import logging
import queue
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from tidal.api import frames
from tidal.api.errors import FrameError
from tidal.api.rpc import node_address
from tidal.api.streams import pack_id, parse_id, unpack_id
from tidal.data.api import MAX_FIELD_BYTES, MAX_FIELDS, StreamRecord

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 2.0
PEER_ADDRESS = re.compile(r"tcp://[0-9A-Za-z.\-]+:[0-9]{1,5}")  # what a unit publishes, checked before connecting
MAX_BATCH_RECORDS = 1 << 16
MAX_MESSAGE_BYTES = 256 << 20
PEERS_TIMEOUT_S = 30.0  # how long a round's unit waits for every peer's address
TOPUP_WAIT_S = 0.02  # how long a step waits for the reader's top-up (a non-blocking read of each partition)
READ_POLL_S = 0.05  # a caught-up reader reads again after this long, or when a step takes (at most)
INTAKE_WINDOW = 256  # the steps whose intakes intake_spread measures (a minute or so of steps)
INTAKE_MIN = 16  # fewer steps than this in a round: no spread reported
SATURATION_STEPS = 8  # the steps over which a worker's own intake says whether it has room for others'
SATURATION_SHARE = 0.9  # of a step's batch: a worker whose partitions bring this much a step accepts nothing


@dataclass
class Batch:
    """Records of one partition in ``(after, last]``, for one round; ``forwarded``: from another
    worker (never forwarded again)."""

    round: int
    partition: int
    after: int
    records: list[StreamRecord]
    forwarded: bool = False

    @property
    def last(self) -> int:
        return pack_id(self.records[-1].id)


Reader = Callable[[bool], tuple[int, int, list[StreamRecord]] | None]


class ShuffleUnit:
    """A worker's local queue and its forwarding (module docstring). ``start_round`` for each
    round the worker enters; ``take`` for each step; ``close`` once."""

    def __init__(self, token: str, lower: int, upper: int, *, batch_size: int, poll_s: float = READ_POLL_S,
                 rng: random.Random | None = None) -> None:
        if not 0 <= lower <= upper:
            raise ValueError(f"shuffle thresholds need 0 <= lower <= upper, got {lower}:{upper}")
        self.token = token
        self.lower, self.upper = lower, upper
        self.batch_size = batch_size  # what one read asks for
        self.poll_s = poll_s
        self.rng = rng or random.Random()
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        host = node_address()  # 127.0.0.1 on one machine
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._cond = threading.Condition()
        self._queue: deque[Batch] = deque()
        self.queued = 0  # records in the local queue
        self.accepting = True
        self._round, self._rank = -1, -1
        self._connected: set[int] = set()  # ranks of this round the forwarding unit can send to
        self._refusing: set[int] = set()  # ranks of this round whose last word was "not accepting"
        self._credit: dict[int, int] = {}  # rank -> records its last "accepting" still lets be sent (upper if none)
        self._received = 0  # forwarded records received since this unit last said "accepting"
        self.forwarded_out = self.forwarded_in = 0  # records
        self._gathering = False  # the reader waits for a step after a short read (it has caught up)
        self._topups_asked = self._topups_done = 0  # steps that had the reader top up the queue first
        self._intake = 0  # records read from this worker's partitions since the last step took (kept or forwarded)
        self._intakes: deque[int] = deque(maxlen=INTAKE_WINDOW)  # the last steps' intakes (intake_spread)
        self._starved = False  # a step is waiting for records in an empty queue
        self._forward_to: dict[int, int] = {}  # partition -> the rank its overflow goes to while it accepts
        self._outbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._closed = threading.Event()
        self._feeder: threading.Thread | None = None
        self._threads = [threading.Thread(target=self._receive, name="tidal-shuffle-recv", daemon=True),
                         threading.Thread(target=self._forward, name="tidal-shuffle-send", daemon=True)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ rounds
    def start_round(self, round_: int, rank: int, world_size: int, store: Any, read: Reader) -> None:
        """Enter ``round_``: drop what is queued, publish this unit's address in the round's store
        (``tidal.worker.store.MasterStore``, the round's prefix), connect to the peers' in the
        background, and start reading with ``read(block) -> (partition, after, records) | None``."""
        self.stop_round()
        with self._cond:
            self._round, self._rank = round_, rank
            self._queue.clear()
            self.queued = 0
            self._intake = 0
            self._intakes.clear()  # another round, maybe other partitions: another intake
            self._starved = False
            self._forward_to = {}
            self.accepting = True
            self._connected, self._refusing = set(), set()  # everyone starts with an empty queue
            self._credit, self._received = {}, 0
            self._cond.notify_all()
        if store is not None and world_size > 1:
            threading.Thread(target=self._exchange, args=(round_, rank, world_size, store),
                             name="tidal-shuffle-peers", daemon=True).start()
        self._feeder = threading.Thread(target=self._feed, args=(round_, read), name="tidal-shuffle-read",
                                        daemon=True)
        self._feeder.start()

    def stop_round(self) -> None:
        """Stop reading (returns once the reader thread has stopped) and drop what is queued."""
        with self._cond:
            self._round = -1
            self._cond.notify_all()
        if self._feeder is not None:
            self._feeder.join()
            self._feeder = None

    def _exchange(self, round_: int, rank: int, world_size: int, store: Any) -> None:
        """Publish this unit's address and wait for the peers' (giving up once the round is over,
        or after ``PEERS_TIMEOUT_S``: a member that died before publishing ends the round anyway)."""
        deadline = time.monotonic() + PEERS_TIMEOUT_S
        peers: dict[int, str] = {}
        try:
            if hasattr(store, "set_timeout"):
                store.set_timeout(datetime.timedelta(seconds=1))
            store.set(f"shuffle/{rank}", self.address)
            for r in range(world_size):
                while r != rank and r not in peers:
                    try:
                        peers[r] = store.get(f"shuffle/{r}").decode()
                    except Exception as exc:  # a timeout of the wait, or the master unreachable
                        if self._round != round_ or time.monotonic() > deadline:
                            log.info("shuffle: round %d: the address of rank %d not received: %s", round_, r, exc)
                            return
        finally:
            close = getattr(store, "close", None)
            if close is not None:
                close()
        if any(not PEER_ADDRESS.fullmatch(a) for a in peers.values()):
            log.error("shuffle: round %d: a peer address is not tcp://HOST:PORT: %s", round_, peers)
            return
        self._outbox.put(("peers", round_, peers))

    # ------------------------------------------------------------------ the local queue
    def take(self, round_: int, timeout_s: float, max_records: int) -> Batch | None:
        """The next batch of ``round_`` in the local queue, waiting up to ``timeout_s``; with the
        queued batches that continue it (same partition, read right after it) up to
        ``max_records``: a worker that keeps up reads small batches, and a step should not train
        one of them at a time."""
        runs = self.take_runs(round_, timeout_s, max_records, 1)
        return runs[0] if runs else None

    def take_runs(self, round_: int, timeout_s: float, max_records: int, runs: int) -> list[Batch]:
        """A step's records: the next batch of ``round_`` in the local queue (waiting up to
        ``timeout_s``; [] if none came), then the queued batches after it in order up to
        ``max_records`` (the last one split if it does not fit), each joined to the run it
        continues (same partition, read right after it) or starting one of at most ``runs``
        runs. A step that took one partition's batches at a time would leave the others'
        waiting a step each."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._gathering and self.queued < max_records and self._round == round_:
                self._topups_asked += 1  # what reached the partitions since the reader's last read
                asked = self._topups_asked
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._topups_done >= asked or self._round != round_, TOPUP_WAIT_S)
            while True:
                while self._queue and self._queue[0].round != round_:
                    self.queued -= len(self._queue.popleft().records)
                if self._queue:
                    break
                if not self._starved:  # a step found nothing: this worker has room (_saturated)
                    self._starved = True
                    self._note_state()
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            self._intakes.append(self._intake)  # what this step's interval brought (intake_spread)
            self._intake = 0
            self._starved = False
            taken: list[Batch] = []
            total = 0
            kept: deque[Batch] = deque()
            # oldest records first, whoever read them: a batch forwarded here holds records that
            # waited at their reader, older than this worker's own reads queued before it arrived
            # (a partition's batches keep their order: its ids rise with their arrival)
            pending = deque(sorted(self._queue, key=_arrival_ms))
            while pending and total < max_records:
                batch = pending.popleft()
                room = max_records - total
                run = next((t for t in taken if t.partition == batch.partition and t.last == batch.after), None)
                if batch.round != round_ or (run is None and len(taken) >= runs):
                    kept.append(batch)
                    continue
                # a batch that does not fit is split: the step is filled, and the rest, (its last
                # record taken, last], stays first in the queue. Skipping it left steps of a few
                # records where a short read of a quiet partition came first: workers with records
                # waiting trained 92-94% of their capacity (RESULTS, Kale live, eighth run)
                part, rest = batch.records[:room], batch.records[room:]
                if run is not None:
                    run.records = run.records + part
                    run.forwarded = run.forwarded or batch.forwarded
                else:
                    taken.append(Batch(batch.round, batch.partition, batch.after, list(part), batch.forwarded))
                total += len(part)
                if rest:
                    kept.append(Batch(batch.round, batch.partition, pack_id(part[-1].id), rest, batch.forwarded))
            kept.extend(pending)  # the step is full: the rest stays as it is
            self._queue = kept
            self.queued -= total
            self._note_state()
            self._cond.notify_all()  # the reader may have room again
            return taken

    def intake_spread(self) -> float:
        """The coefficient of variation of the records this worker's partitions brought between
        its last steps' takes (``INTAKE_WINDOW`` of them; -1 before ``INTAKE_MIN`` steps or with
        nothing read): what makes records wait in its queue below saturation
        (``tidal.brain.kale.shuffle_wait_s``'s ``spread``)."""
        with self._cond:
            if len(self._intakes) < INTAKE_MIN:
                return -1.0
            n = np.fromiter(self._intakes, dtype=np.float64)
        mean = float(n.mean())
        return float(n.std()) / mean if mean > 0 else -1.0

    def waiting(self) -> tuple[dict[int, int], dict[int, int]]:
        """Records in the local queue per partition, and the arrival (ms) of each one's oldest."""
        with self._cond:
            counts: dict[int, int] = {}
            oldest: dict[int, int] = {}
            for b in self._queue:
                counts[b.partition] = counts.get(b.partition, 0) + len(b.records)
                ms = parse_id(b.records[0].id)[0]
                oldest[b.partition] = min(oldest.get(b.partition, ms), ms)
            return counts, oldest

    def _enqueue(self, batch: Batch) -> bool:
        """Into the local queue, if its round is still the current one (caller holds the lock)."""
        if batch.round != self._round:
            return False
        self._queue.append(batch)
        self.queued += len(batch.records)
        self._note_state()
        self._cond.notify_all()
        return True

    def _note_state(self) -> None:
        """Kale 3.5.2's receiver state, with hysteresis; a change is broadcast (lock held)."""
        accepting = self.accepting
        if accepting and (self.queued > self.upper or self._saturated()):
            accepting = False
        elif not accepting and self.queued < self.lower and not self._saturated():
            accepting = True
        renew = accepting and self.queued < self.lower and self._received >= max(1, self.upper // 2)
        if accepting != self.accepting or renew:  # a change, or the senders' credit renewed
            self.accepting = accepting
            if accepting:
                self._received = 0
            self._outbox.put(("all", self._round, self._state_frames()))

    def _saturated(self) -> bool:
        """This worker's partitions brought ``SATURATION_SHARE`` of a step's batch a step or more
        over its last ``SATURATION_STEPS`` steps, and no step waits for records now: it has no
        room for others' (lock held)."""
        if self._starved or len(self._intakes) < SATURATION_STEPS:
            return False
        brought = sum(itertools.islice(reversed(self._intakes), SATURATION_STEPS))
        return brought >= SATURATION_SHARE * self.batch_size * SATURATION_STEPS

    def _state_frames(self) -> list[Any]:
        meta = {"kind": "state", "token": self.token, "round": self._round, "rank": self._rank,
                "accepting": self.accepting, "credit": self.upper}
        return frames.encode({}, meta=meta)

    # ------------------------------------------------------------------ reading and forwarding
    def _feed(self, round_: int, read: Reader) -> None:
        """Fill the local queue from this worker's partitions; overflow goes to a receiver. After a
        short read it reads on without waiting (a *sweep*: one read is one partition's records)
        until a read finds nothing, then waits for a step (or ``poll_s``); a step that asks for a
        top-up while it waits has it sweep again first (``take_runs``)."""
        sweeping = False  # reading on without waiting until nothing more is there
        while not self._closed.is_set():
            with self._cond:
                if self._round != round_:
                    return
                full = self.queued >= self.upper
                if full and not self._receivers():
                    self._end_topups()  # the queue is full: the step has all it can take
                    sweeping = False
                    self._cond.wait(self.poll_s)  # nobody accepts: leave the records in the stream
                    continue
            try:
                got = read(not full and not sweeping)
            except Exception as exc:  # the stream unavailable: the training thread sees it too
                log.info("shuffle: reading failed: %s", exc)
                time.sleep(self.poll_s)
                continue
            if got is None:
                if sweeping:  # everything that had arrived is read: wait for a step
                    sweeping = self._gather()
                elif full:  # a read that did not wait: nothing there, do not spin; but a take
                    # makes room, and what waits in the stream then is read at once, not up to
                    # poll_s later (at 96x, 50 ms is 4.8 trace s of every partition's lag)
                    with self._cond:
                        self._cond.wait_for(lambda: self.queued < self.upper or self._round != round_, self.poll_s)
                continue
            partition, after, records = got
            with self._cond:
                if self._round != round_:
                    return
                self._intake += len(records)
                # what fits under the upper threshold stays; with somebody accepting, the rest is
                # overflow (keeping a whole read past the threshold held 42 records after a take
                # on average where the threshold leaves 32: RESULTS, Kale live, twenty-ninth run)
                keep, to = len(records), -1
                if self.queued + keep > self.upper:  # asked only when the read would overflow
                    receivers = self._receivers()
                    if receivers:
                        keep = max(0, self.upper - self.queued)
                        to = self._forward_to.get(partition, -1)
                        if to not in receivers:  # the partition's receiver refuses now: another at random
                            to = self._forward_to[partition] = self.rng.choice(receivers)
                        self._credit[to] = self._credit.get(to, self.upper) - (len(records) - keep)
                if keep and not self._enqueue(Batch(round_, partition, after, records[:keep])):
                    return
            if keep < len(records):
                rest, rest_after = records[keep:], after if not keep else pack_id(records[keep - 1].id)
                self._outbox.put(("to", round_, to, self._batch_frames(round_, partition, rest_after, rest),
                                  (partition, rest_after, rest)))
                continue
            # a short read: caught up on this partition, the others may hold records as old
            sweeping = sweeping or len(records) < self.batch_size

    def _gather(self) -> bool:
        """A sweep found nothing more: every top-up asked so far is done; let records gather until
        a step takes from the queue (no tight loop of reads of a few records each), or until a
        step asks for a top-up (then True: sweep again)."""
        with self._cond:
            self._end_topups()
            self._gathering = True
            self._cond.wait(self.poll_s)
            self._gathering = False
            return self._topups_asked > self._topups_done

    def _end_topups(self) -> None:
        """The reader read what had arrived: the steps that asked for a top-up take from the queue
        (lock held)."""
        if self._topups_done < self._topups_asked:
            self._topups_done = self._topups_asked
            self._cond.notify_all()

    def _receivers(self) -> list[int]:
        """Ranks to forward to: connected, accepting as far as their last word goes, with credit
        left (lock held)."""
        return sorted(r for r in self._connected - self._refusing if self._credit.get(r, self.upper) > 0)

    def _batch_frames(self, round_: int, partition: int, after: int, records: list[StreamRecord]) -> list[Any]:
        names: list[list[str]] = []
        index: dict[tuple[str, ...], int] = {}
        shape, lengths, data = [], [], []
        for r in records:
            key = tuple(r.fields)
            if key not in index:
                index[key] = len(names)
                names.append(list(key))
            shape.append(index[key])
            for value in r.fields.values():
                lengths.append(len(value))
                data.append(value)
        tensors = {
            "ids": torch.tensor([pack_id(r.id) for r in records], dtype=torch.int64),
            "shape": torch.tensor(shape, dtype=torch.int32),
            "lengths": torch.tensor(lengths, dtype=torch.int64),
            "data": torch.frombuffer(bytearray(b"".join(data)) or bytearray(1), dtype=torch.uint8)[:sum(lengths)],
        }
        meta = {"kind": "batch", "token": self.token, "round": round_, "rank": self._rank, "partition": partition,
                "after": after, "names": names}
        return frames.encode(tensors, meta=meta)

    def _forward(self) -> None:
        """The forwarding unit: owns the PUSH sockets, sends what the other threads put out."""
        sockets: dict[int, zmq.Socket[Any]] = {}
        current = -1
        while not self._closed.is_set():
            try:
                item = self._outbox.get(timeout=0.1)
            except queue.Empty:
                continue
            kind, round_ = item[0], item[1]
            if kind == "peers":
                with self._cond:
                    if round_ != self._round:  # an exchange that finished after its round ended
                        continue
                for s in sockets.values():
                    s.close(linger=0)
                sockets, current = {}, round_
                for rank, address in item[2].items():
                    s = self._ctx.socket(zmq.PUSH)
                    s.setsockopt(zmq.LINGER, 0)
                    s.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
                    s.connect(address)
                    sockets[rank] = s
                with self._cond:
                    if self._round == round_:
                        self._connected = set(sockets)
                        self._cond.notify_all()
                        # a change made before the sockets were up reached nobody: say where it stands
                        self._outbox.put(("all", round_, self._state_frames()))
                continue
            if kind == "all":
                for s in sockets.values() if round_ == current else ():
                    try:
                        s.send_multipart(item[2], copy=False)
                    except zmq.ZMQError as exc:
                        log.info("shuffle: state not sent: %s", exc)
                continue
            to, message, (partition, after, records) = item[2], item[3], item[4]
            sock = sockets.get(to) if round_ == current else None
            sent = False
            if sock is not None:
                try:
                    sock.send_multipart(message, copy=False)
                    sent = True
                except zmq.ZMQError as exc:
                    log.info("shuffle: batch for rank %d not sent (%s): kept here", to, exc)
            with self._cond:
                if sent:
                    self.forwarded_out += len(records)
                    continue
                # the receiver stopped taking (dead or hung: the round will end): train it here
                self._connected.discard(to)
                batch = Batch(round_, partition, after, records)
                self._enqueue(batch)
        for s in sockets.values():
            s.close(linger=0)

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                if not poller.poll(100):
                    continue
                parts = self._pull.recv_multipart(copy=False)
            except zmq.ZMQError:
                if self._closed.is_set():
                    return
                raise
            try:
                self._handle([p.buffer for p in parts])
            except (FrameError, ValueError, KeyError, TypeError) as exc:
                log.warning("shuffle: a message was dropped: %s", exc)

    def _handle(self, parts: list[Any]) -> None:
        message = frames.decode(parts, max_bytes=MAX_MESSAGE_BYTES)
        meta = message.meta or {}
        if not hmac.compare_digest(str(meta.get("token", "")), self.token):
            raise ValueError("a message without the job's token")
        round_, rank = meta.get("round"), meta.get("rank")
        if not isinstance(round_, int) or not isinstance(rank, int):
            raise ValueError("a message without its round and rank")
        with self._cond:
            if round_ != self._round:
                return  # an earlier (or later) round's: nothing of it may be trained now
        if meta.get("kind") == "state":
            credit = meta.get("credit")
            if not isinstance(credit, int) or isinstance(credit, bool) or credit < 1:
                raise ValueError(f"a state without its credit: {credit!r}")
            with self._cond:
                if round_ == self._round and rank != self._rank:
                    if meta.get("accepting") is True:
                        self._refusing.discard(rank)
                        self._credit[rank] = credit
                    else:
                        self._refusing.add(rank)
            return
        if meta.get("kind") != "batch":
            raise ValueError(f"unknown message kind {meta.get('kind')!r}")
        partition, after, records = _records(message.tensors, meta)
        batch = Batch(round_, partition, after, records, forwarded=True)
        with self._cond:
            self._received += len(records)  # before _enqueue notes the state: it may renew the credit
            if self._enqueue(batch):
                self.forwarded_in += len(records)

    def close(self) -> None:
        self.stop_round()
        self._closed.set()
        for t in self._threads:
            t.join(timeout=2.0)
        self._pull.close(linger=0)
        self._ctx.term()


def _arrival_ms(batch: Batch) -> int:
    """When a batch's first (oldest) record arrived in the stream: its id's time, ms."""
    return parse_id(batch.records[0].id)[0]


def _records(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> tuple[int, int, list[StreamRecord]]:
    """A received batch's partition, position and records, every length checked (``ValueError``
    names what is wrong)."""
    partition, after, names = meta.get("partition"), meta.get("after"), meta.get("names")
    if not isinstance(partition, int) or not isinstance(after, int) or partition < 0 or after < 0:
        raise ValueError("a batch without its partition and position")
    if set(tensors) != {"ids", "shape", "lengths", "data"}:
        raise ValueError(f"a batch with tensors {sorted(tensors)}")
    ids, shape, lengths, data = tensors["ids"], tensors["shape"], tensors["lengths"], tensors["data"]
    if (ids.dtype, shape.dtype, lengths.dtype, data.dtype) != (torch.int64, torch.int32, torch.int64, torch.uint8):
        raise ValueError("a batch of the wrong dtypes")
    if not (ids.dim() == shape.dim() == lengths.dim() == data.dim() == 1):
        raise ValueError("a batch of the wrong shapes")
    n = ids.numel()
    if not 0 < n <= MAX_BATCH_RECORDS or shape.numel() != n:
        raise ValueError(f"a batch of {n} records")
    if not isinstance(names, list) or not all(
            isinstance(k, list) and len(k) <= MAX_FIELDS and all(isinstance(x, str) and len(x) <= 256 for x in k)
            for k in names):
        raise ValueError("a batch without valid field names")
    id_list = ids.tolist()
    if id_list[0] <= after or any(b <= a for a, b in itertools.pairwise(id_list)):
        raise ValueError("a batch whose ids do not rise after its position")
    kinds = shape.tolist()
    if any(not 0 <= k < len(names) for k in kinds):
        raise ValueError("a batch naming unknown fields")
    sizes = lengths.tolist()
    if len(sizes) != sum(len(names[k]) for k in kinds) or any(not 0 <= s <= MAX_FIELD_BYTES for s in sizes):
        raise ValueError("a batch whose field lengths do not match its records")
    if sum(sizes) != data.numel():
        raise ValueError("a batch whose data does not match its field lengths")
    blob = data.numpy().tobytes()
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    out, at = [], 0
    for i, k in enumerate(kinds):
        fields = {}
        for name in names[k]:
            fields[name] = blob[offsets[at]:offsets[at + 1]]
            at += 1
        out.append(StreamRecord(partition, unpack_id(id_list[i]), fields))
    return partition, after, out
