"""Collectives of one membership round: the step header exchange, gradient reduction, state sync.

A round with one worker has no process group at all (every collective is the identity). Any
failure inside a collective (a peer killed, a peer that left) surfaces as ``CollectiveError``:
the worker then re-forms through the master instead of dying.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from tidal.api import FrameError
from tidal.api.frames import MAX_HEADER_BYTES
from tidal.api.rpc import node_address
from tidal.api.streams import STEP_RANGES
from tidal.worker.api import CollectiveError
from tidal.worker.logical import Grads, flatten, param_grads, set_grads, sum_and_scale, unflatten
from tidal.worker.state import MAX_STATE_BYTES, pack_state, unpack_state
from tidal.worker.store import MasterStore

log = logging.getLogger(__name__)

# Step header, one row per worker: samples, reform flag, epoch, start, end, worker id, and a
# stream job's first record (tidal.api.StepRecord: the range's fields in a stream job); then a
# stream step's further ranges (``STEP_RANGES - 1`` slots of partition, after, first, last,
# records; zeros where unused): the first range holds the samples the others do not.
N, REFORM, EPOCH, START, END, WORKER, FIRST = range(7)
EXTRA, RANGE_FIELDS = 7, 5
HEADER_FIELDS = EXTRA + RANGE_FIELDS * (STEP_RANGES - 1)
FORM_TIMEOUT_S = 10.0
_CHUNKS, _CHUNK_BITS = 3, 21  # a header value in float32: three exact 21-bit pieces (< 2**63)
_CHUNK_MASK = (1 << _CHUNK_BITS) - 1


def _encode_header(row: list[int]) -> torch.Tensor:
    """A header row as float32-exact 21-bit pieces (values below 2**63)."""
    values = torch.tensor(row, dtype=torch.int64)
    return torch.stack([(values >> (_CHUNK_BITS * c)) & _CHUNK_MASK for c in range(_CHUNKS)], dim=1).reshape(-1)


def _decode_header(pieces: torch.Tensor) -> torch.Tensor:
    """``[world_size, HEADER_FIELDS * _CHUNKS]`` pieces -> ``[world_size, HEADER_FIELDS]`` int64."""
    chunks = pieces.to(torch.int64).cpu().reshape(pieces.shape[0], HEADER_FIELDS, _CHUNKS)
    return chunks[:, :, 0] + (chunks[:, :, 1] << _CHUNK_BITS) + (chunks[:, :, 2] << (2 * _CHUNK_BITS))


class RoundComm:
    """The process group of one round.

    The group is a standalone backend object (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), not
    torch.distributed's global default group: a process lives through many rounds with
    different peers, and the global registry names groups by a per-process counter, so two
    processes with different histories would never find each other in the store.

    Members rendezvous through the master's own store (tidal.worker.store.MasterStore: its
    control plane, the job's token), under the round's prefix; the comm holds the store for as
    long as the group lives, since the group calls back into it (nccl initializes lazily).
    """

    def __init__(self, rank: int, world_size: int, backend: str, device: torch.device) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.group: Any = None
        self.store: MasterStore | None = None
        self._flat: torch.Tensor | None = None
        self._reduced: tuple[torch.Tensor, int] | None = None
        self._scale_grads = False
        self.busy_since: float | None = None  # monotonic time the collective in flight began

    @classmethod
    def connect(cls, *, url: str, token: str, prefix: str, rank: int, world_size: int, backend: str,
                device: torch.device, timeout_s: float) -> RoundComm:
        comm = cls(rank, world_size, backend, device)
        if world_size == 1:
            return comm
        # Every member is already waiting at the rendezvous when a round closes, so forming the
        # group takes well under a second; a short timeout bounds the stall when a member dies
        # in between. Collectives then get the job's (longer) timeout.
        connect = datetime.timedelta(seconds=min(FORM_TIMEOUT_S, timeout_s))
        try:
            store = comm.store = MasterStore(url, token, prefix, timeout=connect)
            if backend == "nccl":
                # a timed-out collective aborts the communicator and raises in this process
                # (2: clean up only) instead of torch's default, which kills the process
                os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = datetime.timedelta(seconds=timeout_s)
                comm.group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            else:
                opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                opts._timeout = connect
                # gloo's default device listens on whatever the machine's hostname resolves to
                # (an outside interface on many machines): listen on this machine's address on
                # the route to the master (127.0.0.1 on one machine; DESIGN.md 5)
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=node_address(url))]
                comm.group = dist.ProcessGroupGloo(store, rank, world_size, opts)
                comm.group._set_default_timeout(datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as exc:
            comm.close()
            raise CollectiveError(f"cannot form the process group: {exc}") from exc
        return comm

    # ------------------------------------------------------------------ stalls
    def _wait(self, work: Any) -> None:
        """Wait for a collective, noting since when (``stalled_for``): a watcher thread can then
        tell a collective that waits for a dead peer from one that is merely running."""
        self.busy_since = time.monotonic()
        try:
            work.wait()
        finally:
            self.busy_since = None

    def stalled_for(self) -> float:
        """Seconds the collective in flight has waited so far (0: none in flight)."""
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since

    def abort(self) -> bool:
        """Abort the collective in flight from another thread; True if the group can be aborted.

        NCCL: a peer that died mid-collective leaves the survivors blocked in the kernel until
        the watchdog's timeout (torchrun users report 30-minute hangs); ``abort`` tears the
        communicator down and the blocked ``wait`` raises, so the member goes to the rendezvous
        at once. Gloo needs none of this (and its ``abort`` does not wake a blocked wait, measured
        on torch 2.13): a dead peer's sockets close and the wait raises, and a hung peer is
        SIGKILLed by the master, which closes them.
        """
        group = self.group
        if group is None or self.backend != "nccl":
            return False
        try:
            group.abort()
        except (RuntimeError, AttributeError) as exc:
            log.warning("aborting the nccl group: %s", exc)
            return False
        return True

    def close(self) -> None:
        if self.group is not None:
            try:
                self.group.shutdown()
            except (RuntimeError, ValueError, AttributeError) as exc:
                log.debug("shutting down the process group: %s", exc)
            self.group = None
        if self.store is not None:
            self.store.close()
            self.store = None

    # -------------------------------------------------------------------- collectives
    def exchange_headers(self, row: list[int]) -> torch.Tensor:
        """All-gather one int64 row per worker; returns ``[world_size, HEADER_FIELDS]``."""
        mine = torch.tensor(row, dtype=torch.int64)
        if self.group is None:
            return mine.reshape(1, -1)
        mine = mine.to(self.device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            self._wait(self.group.allgather([out], [mine]))
        except (RuntimeError, ValueError) as exc:
            raise CollectiveError(f"step header exchange failed: {exc}") from exc
        return torch.stack(out).cpu()

    def _broadcast(self, tensor: torch.Tensor, source: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = source
        opts.rootTensor = 0
        on_device = tensor.to(self.device)  # a no-op for gloo; nccl needs device tensors
        self._wait(self.group.broadcast([on_device], opts))
        if on_device is not tensor:
            tensor.copy_(on_device.cpu())

    def reduce_with_header(self, params: list[torch.nn.Parameter], weight: float, row: list[int]) -> torch.Tensor:
        """One all-reduce for a whole step: ``weight * grad`` summed, plus every worker's header.

        The header rides in the same buffer: each worker writes its row, split into 21-bit
        chunks (exact in float32), into its own slot and zeros elsewhere, so the sum is every
        row. Saves a collective per step over a separate all-gather. Returns the headers
        ``[world_size, HEADER_FIELDS]``; ``apply_reduced`` then writes the gradients back.
        """
        self._reduced = None
        if self.group is None:
            self._scale_grads = False  # one worker: its gradient is the mean already
            return self.exchange_headers(row)
        grads = param_grads(params)
        length = sum(g.numel() for g in grads)
        dtype = grads[0].dtype if grads else torch.float32
        if dtype not in (torch.float32, torch.float64):
            headers = self.exchange_headers(row)  # a dtype too narrow to carry the header exactly
            self.reduce_gradients(params, weight)
            self._scale_grads = True
            return headers
        slots = self.world_size * HEADER_FIELDS * _CHUNKS
        flat = self._buffer(length + slots, dtype)
        if grads:
            flatten(grads, out=flat[:length])
        if weight != 1.0:
            flat[:length].mul_(weight)
        header = flat[length:]
        header.zero_()
        base = self.rank * HEADER_FIELDS * _CHUNKS
        header[base:base + HEADER_FIELDS * _CHUNKS].copy_(_encode_header(row))
        try:
            self._wait(self.group.allreduce([flat]))
        except (RuntimeError, ValueError) as exc:
            raise CollectiveError(f"gradient all-reduce failed: {exc}") from exc
        self._reduced = (flat, length)
        return _decode_header(header.view(self.world_size, -1))

    def apply_reduced(self, params: list[torch.nn.Parameter], scale: float) -> None:
        """Write the reduced gradients (times ``scale``) into ``.grad``."""
        if self._reduced is None:
            if self._scale_grads and scale != 1.0:  # reduce_gradients already wrote them
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(scale)
            return
        flat, length = self._reduced
        if scale != 1.0:
            flat[:length].mul_(scale)
        set_grads(params, flat)
        self._reduced = None

    def _buffer(self, total: int, dtype: torch.dtype) -> torch.Tensor:
        if self._flat is None or self._flat.numel() != total or self._flat.dtype != dtype:
            self._flat = torch.empty(total, dtype=dtype, device=self.device)
        return self._flat

    def reduce_gradients(self, params: list[torch.nn.Parameter], weight: float) -> None:
        """Sum ``weight * grad`` over the workers into every parameter's ``.grad``.

        With ``weight = samples_here / samples_in_step`` the result is the gradient of the mean
        loss over the global batch, whatever the split (uneven batches, idle workers) was.
        Parameters without a gradient count as zeros, so every worker ends with the same grads.
        """
        grads = param_grads(params)
        total = sum(g.numel() for g in grads)
        dtype = grads[0].dtype if grads else torch.float32
        flat = self._buffer(total, dtype)
        if grads:
            flatten(grads, out=flat)
        if weight != 1.0:
            flat.mul_(weight)
        if self.group is not None:
            try:
                self._wait(self.group.allreduce([flat]))
            except (RuntimeError, ValueError) as exc:
                raise CollectiveError(f"gradient all-reduce failed: {exc}") from exc
        set_grads(params, flat)

    def reduce_in_logical_order(self, local: list[Grads], counts: list[int], after: float,
                                row: list[int]) -> tuple[Grads, list[list[int]]]:
        """Sum every logical worker's contribution in logical rank order, then scale by ``after``.

        ``local`` are this process's contributions in logical order (tidal.worker.logical
        ``GradientStash``), ``counts[p]`` how many process ``p`` sends (contiguous blocks, so
        rank order is logical order; the first process sends its block folded, as one).
        Each process owns a slice of the gradient: an all-to-all brings it the N contributions
        to its slice, it adds them left to right, and an all-gather returns the whole result.
        Every element is the same sum in the same order for any number of processes. The step
        header ``row`` rides in the all-gather (as in ``reduce_with_header``). Returns the
        reduced gradient (tensors nobody else writes, shaped as the contributions; alone, the
        sum is made in ``local``'s own tensors) and the headers, one row per process.
        """
        if self.group is None:
            return sum_and_scale(local, after), [list(row)]
        like = local[0]
        flats = [flatten(c) for c in local]
        k, length = self.world_size, flats[0].numel()
        bounds = [p * length // k for p in range(k + 1)]
        sizes = [bounds[p + 1] - bounds[p] for p in range(k)]
        mine = sizes[self.rank]
        # one contribution per process: its slices are already in destination order
        send = flats[0] if len(flats) == 1 else torch.cat(
            [c[bounds[q]:bounds[q + 1]] for q in range(k) for c in flats])
        recv = torch.empty(sum(counts) * mine, dtype=send.dtype, device=send.device)
        width = max(sizes)
        stride = width + HEADER_FIELDS * _CHUNKS
        part = torch.zeros(stride, dtype=send.dtype, device=send.device)
        part[width:].copy_(_encode_header(row))
        gathered = torch.empty(k * stride, dtype=send.dtype, device=send.device)
        try:
            self._wait(self.group.alltoall_base(recv, send, [n * mine for n in counts], [len(local) * s for s in sizes]))
            if mine:  # sum_and_scale, on this slice
                rows = recv.view(sum(counts), mine)
                acc = part[:mine]
                acc.copy_(rows[0])
                for r in range(1, rows.shape[0]):
                    acc.add_(rows[r])  # left to right, as sum_in_order
                if after != 1.0:
                    acc.mul_(after)
            self._wait(self.group._allgather_base(gathered, part))
        except (RuntimeError, ValueError) as exc:
            raise CollectiveError(f"logical-order reduction failed: {exc}") from exc
        blocks = gathered.view(k, stride)
        reduced = torch.cat([blocks[p, :sizes[p]] for p in range(k)])
        return unflatten(reduced, like), _decode_header(blocks[:, width:]).tolist()

    def reduce_by_allreduce(self, local: list[Grads], after: float,
                            row: list[int]) -> tuple[Grads, list[list[int]]]:
        """The world-size-dependent way (``TIDAL_REDUCTION=allreduce``): not reproducible.

        Sums and scales this process's contributions (as ``reduce_in_logical_order`` does), then
        all-reduces the partial sums."""
        headers = self.exchange_headers(row).tolist()
        like = local[0]
        flat = flatten(sum_and_scale(local, after))
        if self.group is not None:
            try:
                self._wait(self.group.allreduce([flat]))
            except (RuntimeError, ValueError) as exc:
                raise CollectiveError(f"gradient all-reduce failed: {exc}") from exc
        return unflatten(flat, like), headers

    def broadcast_tensors(self, tensors: list[torch.Tensor], source: int) -> None:
        """In place: every member ends with the source's values (module buffers), in one message."""
        if self.group is None or not tensors:
            return
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
        try:
            self._broadcast(flat, source)
        except (RuntimeError, ValueError) as exc:
            raise CollectiveError(f"buffer broadcast failed: {exc}") from exc
        offset = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t).to(t.dtype))
                offset += n

    def broadcast_state(self, tree: object | None, source: int) -> object:
        """Send the source's state to every member; returns the state as received.

        Three broadcasts: the two sizes, the header, the flat buffer (``tidal.worker.state``'s
        ``pack_state``: a ``tidal.api.frames`` message joined into one buffer). A receiver checks
        the sizes before it allocates and the message before it builds a tensor. A source with no
        state to send (``tree`` None: it could not load the checkpoint the round resumes from)
        sends the sizes ``(-1, 0)``: every member raises ``CollectiveError`` and re-forms.

        Raises:
            CollectiveError: a broadcast failed (a peer died or left): re-form.
            TypeError: (on the source) the state holds something that cannot be sent.
            FrameError: the state is too large to send, or a receiver got sizes or a message
                that break the codec's rules (the source is not to be trusted with memory).
        """
        if self.group is None:
            if tree is None:
                raise CollectiveError("the round's source has no state to send")
            return tree
        if self.rank == source and tree is None:
            sizes = torch.tensor([-1, 0], dtype=torch.int64)
        elif self.rank == source:
            header, flat = pack_state(tree)
            sizes = torch.tensor([len(header), flat.numel()], dtype=torch.int64)
        else:
            sizes = torch.zeros(2, dtype=torch.int64)
        try:
            self._broadcast(sizes, source)
        except (RuntimeError, ValueError) as exc:
            raise CollectiveError(f"state broadcast failed: {exc}") from exc
        n_header, n_flat = int(sizes[0]), int(sizes[1])
        if n_header == -1:
            raise CollectiveError("the round's source has no state to send (it could not load the checkpoint "
                                  "the round resumes from)")
        if not (0 < n_header <= MAX_HEADER_BYTES and 0 <= n_flat <= MAX_STATE_BYTES):
            raise FrameError(f"state broadcast announces a header of {n_header} bytes and a buffer of "
                             f"{n_flat} (limits {MAX_HEADER_BYTES} and {MAX_STATE_BYTES})")
        try:
            header_t = (torch.frombuffer(bytearray(header), dtype=torch.uint8) if self.rank == source
                        else torch.empty(n_header, dtype=torch.uint8))
            self._broadcast(header_t, source)
            if self.rank != source:
                flat = torch.empty(n_flat, dtype=torch.uint8)
            if n_flat:
                self._broadcast(flat, source)
        except (RuntimeError, ValueError) as exc:
            raise CollectiveError(f"state broadcast failed: {exc}") from exc
        if self.rank == source:
            return tree
        return unpack_state(bytes(header_t.numpy()), flat)
