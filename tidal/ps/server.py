"""A parameter server process: embedding shards, their optimizer, the sync-mode step rule.

    python -m tidal.ps.server            # launched by the master in the role ``ps``

It binds a ZeroMQ ROUTER on its machine's address on the route to the master
(``tidal.api.rpc.node_address``: 127.0.0.1 on one machine; ``TIDAL_PS_HOST`` overrides it), port
chosen by the system, and tells the master its address (``POST /v1/ps/report``, then every
``REPORT_S`` with its rows, bytes and request latency). Without ``TIDAL_MASTER_URL`` it prints
``tidal-ps listening ADDRESS`` on stdout instead (tests, debugging).

**Sync mode, exactly once** (DESIGN.md 4, "Parameter servers"). A step's sparse gradients reach
the servers *before* the workers' dense all-reduce: each contribution (one worker's, or one
logical worker's) is pushed as ``(round, step, key)`` and acknowledged, and only then does the
worker enter the all-reduce. So once the all-reduce of step ``s`` in round ``r`` succeeded,
every contribution of ``(r, s)`` is on its servers, and each worker's next request carries the
watermark ``[r, s, total]`` (workers also send it to every server right after the step). On
the first watermark of a step the server applies it once: the contributions of ``(r, s)`` in
key order (logical-rank order with logical workers), summed per row and scaled by
``1 / total``, then the table's optimizer. Contributions of a round that broke before its
all-reduce are never named by a watermark and are dropped once a later step is applied; the
step is trained again in the next round. A row's update depends on the contributions alone,
never on which server holds it, so the model does not depend on the number of servers.

**Async mode** (``ServerEmbeddings(..., synchronous=False)``; Kale 3.3, Eq. 8): a push marked
``async`` is applied on arrival (an optimizer step with the contribution's own mean gradient),
so no worker's sparse update waits for the others'; the worker does not wait for the answer
before its dense all-reduce, only before committing the step. What that gives up is in
``tidal.ps.embedding``.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq

from tidal.api import PS_OUT_OF_MEMORY_EXIT, frames
from tidal.api.errors import FrameError
from tidal.api.rpc import bind_router, node_address
from tidal.ps.api import MAX_TABLES, PSError, TableSpec, virtual_shard
from tidal.ps.table import DynamicTable, sorted_positions

log = logging.getLogger(__name__)

REPORT_S = 1.0
MAX_REQUEST_BYTES = 1 << 30
EXPORT_ROWS = 1 << 18  # rows per export reply (a checkpoint of a large table comes in pieces)


@dataclass
class Contribution:
    """One worker's (or logical worker's) gradients of one step, per table."""

    tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class OutOfMemoryError(PSError):
    """The tables outgrew the server's memory limit (``tidal run --ps-memory``)."""


class ParameterServer:
    """The state and request handling of one server (the socket loop is ``serve``).

    ``memory_limit``: the bytes its tables (rows and optimizer state) may hold; a step or a move
    that takes them past it ends the server with ``OutOfMemoryError`` (the out-of-memory kill a
    real limit would bring, with a message that says so). None: no limit.
    """

    def __init__(self, token: str, server_id: int = 0, memory_limit: int | None = None) -> None:
        self.token = token
        self.server_id = server_id
        self.memory_limit = memory_limit
        self.tables: dict[str, DynamicTable] = {}
        self.applied_step = -1
        # (round, step) -> key -> contribution; and the ids each (round, step, key) pulled
        self.pending: dict[tuple[int, int], dict[int, Contribution]] = {}
        self.pulled: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
        self.requests = 0
        self.busy_s = 0.0
        # rows pulled per virtual shard (the load the hot-PS planner reads: tidal.brain.hotps);
        # sized by the clients' hello, which names the number of virtual shards
        self.shard_hits = np.zeros(0, dtype=np.int64)
        self.row_cost_s = 0.0  # emulated service time per row (TIDAL_PS_EMULATE_SLOW, benchmarks)

    # ------------------------------------------------------------------ requests
    def handle(self, msg: frames.Message) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
        """Serve one decoded request; returns the reply's meta and tensors (None: no reply).

        Raises:
            PSError: the request is refused (the reply carries the message).
        """
        meta = msg.meta or {}
        if not hmac.compare_digest(str(meta.get("token", "")), self.token):
            raise PSError("a request without the job's token")
        op = meta.get("op")
        if op == "hello":
            self._configure(meta.get("tables"))
            num_shards = meta.get("num_shards")
            if num_shards is not None:
                if not isinstance(num_shards, int) or not 1 <= num_shards <= 1 << 16:
                    raise PSError(f"num_shards must be an integer in [1, 65536], got {num_shards!r}")
                if len(self.shard_hits) != num_shards:
                    self.shard_hits = np.zeros(num_shards, dtype=np.int64)
            return {"applied_step": self.applied_step, "server": self.server_id}, {}
        if not self.tables and op not in ("stats", "commit"):
            raise PSError(f"{op!r} before hello: the tables are not configured")
        if op == "reset":  # before the watermark: a reset goes back in steps
            return self._reset(meta)
        self._commit(meta.get("commit"))
        if op == "commit":
            return None
        if op == "load":
            return self._load(meta, msg.tensors)
        if op == "drop":
            return self._drop(meta)
        if op == "pull":
            return self._pull(meta, msg.tensors)
        if op == "push":
            return self._push(meta, msg.tensors)
        if op == "export":
            return self._export(meta)
        if op == "stats":
            return {"applied_step": self.applied_step, **self.stats()}, {}
        raise PSError(f"unknown op {op!r}")

    def stats(self) -> dict[str, Any]:
        return {"rows": sum(t.rows for t in self.tables.values()),
                "bytes": sum(t.nbytes for t in self.tables.values()),
                "tables": {name: t.stats() for name, t in self.tables.items()},
                "specs": [t.spec.to_json() for t in self.tables.values()]}

    def _configure(self, specs: Any) -> None:
        if not isinstance(specs, list) or not specs or len(specs) > MAX_TABLES:
            raise PSError(f"hello needs a list of 1 to {MAX_TABLES} table specs")
        wanted = {s.name: s for s in (TableSpec.from_json(v) for v in specs)}
        if len(wanted) != len(specs):
            raise PSError("hello names a table twice")
        if not self.tables:
            self.tables = {name: DynamicTable(spec) for name, spec in wanted.items()}
            return
        have = {name: t.spec for name, t in self.tables.items()}
        if have != wanted:
            raise PSError(f"the server holds tables {sorted(have)} with other settings than this client's "
                          f"{sorted(wanted)}: every worker must declare the same tables")

    def _key(self, meta: dict[str, Any], late_ok: bool = False) -> tuple[int, int, int]:
        """The request's (round, step, key), for the step after the applied one; ``late_ok``:
        or for the applied one (an async push may arrive after another worker committed its
        step: it does not wait for the answer before the all-reduce, only before its commit)."""
        try:
            r, s, k = (int(meta[n]) for n in ("round", "step", "key"))
        except (KeyError, TypeError, ValueError):
            raise PSError("pull and push need integer round, step and key") from None
        if s != self.applied_step + 1 and not (late_ok and s == self.applied_step):
            raise PSError(f"step {s} is not the next step: this server applied step {self.applied_step} "
                          "(a watermark was lost, or the worker is behind)")
        return r, s, k

    def _ids(self, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        table = self.tables.get(name)
        if table is None:
            raise PSError(f"unknown table {name!r} (the server holds {sorted(self.tables)})")
        ids = tensors[f"{name}.ids"]
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise PSError(f"table {name}: ids must be a 1-d int64 tensor, got {ids.dtype} {list(ids.shape)}")
        table.check_ids(ids)
        return ids

    def _tables_of(self, tensors: dict[str, torch.Tensor], suffixes: tuple[str, ...]) -> list[str]:
        names = sorted({k.rsplit(".", 1)[0] for k in tensors})
        want = {f"{n}.{s}" for n in names for s in suffixes}
        if set(tensors) != want:
            raise PSError(f"expected the tensors {sorted(want)}, got {sorted(tensors)}")
        return names

    def _pull(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any],
                                                                                       dict[str, torch.Tensor]]:
        # key None: a read outside a step (evaluation): the rows as of the applied step, not tracked
        pulled = self.pulled.setdefault(self._key(meta), {}) if meta.get("key") is not None else {}
        out: dict[str, torch.Tensor] = {}
        for name in self._tables_of(tensors, ("ids",)):
            ids = self._ids(tensors, name)
            if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
                raise PSError(f"table {name}: pulled ids must be sorted and unique")
            out[f"{name}.rows"] = self.tables[name].read(ids)
            pulled[name] = ids
            if meta.get("key") is not None and len(self.shard_hits):
                self.shard_hits += np.bincount(virtual_shard(name, ids, len(self.shard_hits)).numpy(),
                                               minlength=len(self.shard_hits))
            if self.row_cost_s:
                time.sleep(self.row_cost_s * ids.numel())
        return {}, out

    def _push(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any],
                                                                                       dict[str, torch.Tensor]]:
        r, s, k = self._key(meta, late_ok=bool(meta.get("async")))
        pulled = self.pulled.get((r, s, k), {})
        contribution = Contribution()
        for name in self._tables_of(tensors, ("ids", "grad")):
            ids = self._ids(tensors, name)
            grad = tensors[f"{name}.grad"]
            dim = self.tables[name].spec.dim
            if grad.dtype != torch.float32 or tuple(grad.shape) != (ids.numel(), dim):
                raise PSError(f"table {name}: grad must be float32 [{ids.numel()}, {dim}], "
                              f"got {grad.dtype} {list(grad.shape)}")
            if not bool(torch.isfinite(grad).all()):
                raise PSError(f"table {name}: the gradient holds NaN or infinity")
            seen = pulled.get(name)
            if seen is None or not (sorted_positions(seen.numpy(), ids.numpy()) >= 0).all():  # pulled: sorted
                raise PSError(f"table {name}: a push for rows not pulled at step {s} (round {r}, key {k})")
            contribution.tables[name] = (ids, grad)
        if meta.get("async"):
            # async mode (Kale Eq. 8): applied on arrival, the contribution's own mean gradient,
            # in whatever order pushes come; no watermark waits for it
            for name, (ids, grad) in contribution.tables.items():
                self.tables[name].apply(ids, grad)
            self._check_memory(f"an async push of step {s}")
            return {}, {}
        self.pending.setdefault((r, s), {})[k] = contribution
        return {}, {}

    def _commit(self, watermark: Any) -> None:
        """Apply the step the watermark names, once (see the module's docstring)."""
        if watermark is None:
            return
        try:
            r, s, total = (int(v) for v in watermark)
        except (TypeError, ValueError):
            raise PSError(f"a watermark is [round, step, total], got {watermark!r}") from None
        if s <= self.applied_step:
            return
        if total <= 0:
            raise PSError(f"watermark of step {s} with {total} samples")
        missed = [key for key in self.pending if self.applied_step < key[1] < s]
        if missed:
            raise PSError(f"the watermark of step {s} skips step {missed[0][1]}, whose contributions "
                          "this server holds: a watermark was lost")
        contributions = self.pending.pop((r, s), {})
        self._apply(contributions, total)
        self.applied_step = s
        self._check_memory(f"step {s}")
        self.pending = {key: v for key, v in self.pending.items() if key[1] > s}
        self.pulled = {key: v for key, v in self.pulled.items() if key[1] >= s}  # s: for late async pushes

    def _apply(self, contributions: dict[int, Contribution], total: int) -> None:
        scale = 1.0 / total
        for name, table in self.tables.items():
            parts = [contributions[k].tables[name] for k in sorted(contributions) if name in contributions[k].tables]
            if not parts:
                continue
            ids = torch.unique(torch.cat([p[0] for p in parts]))  # sorted
            acc = torch.zeros(ids.numel(), table.spec.dim)
            for part_ids, grad in parts:  # in key order; each index_add has unique rows
                acc.index_add_(0, torch.searchsorted(ids, part_ids), grad)
            table.apply(ids, acc.mul_(scale))

    def _export(self, meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        name = str(meta.get("table"))
        table = self.tables.get(name)
        if table is None:
            raise PSError(f"unknown table {name!r}")
        start = int(meta.get("start", 0))
        shards = _shards(meta) if meta.get("shards") is not None else None
        part, rows = table.export_page(start, EXPORT_ROWS, shards)
        return {"rows": rows, "next": start + len(part["ids"])}, part

    # ------------------------------------------------------------------ moving virtual shards
    # A restore from a checkpoint (a lost server replaced: tidal.ps.embedding) is ``reset`` to
    # the checkpoint's step on every server, then ``load`` of each server's rows.
    # The master moves a virtual shard (tidal.master.servers): ``drop`` it on the new holder
    # (rows a move that broke off left there), ``export`` it from the old one and ``load`` it
    # into the new one page by page, publish the new shard map, then ``drop`` it on the old one.
    # Each request is idempotent in that order, so a move that broke off is simply done again.
    def _load(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any],
                                                                                       dict[str, torch.Tensor]]:
        """Rows of one table (``meta.table``) exported by another server, with their state."""
        shards, num_shards = _shards(meta)
        name = str(meta.get("table"))
        table = self.tables.get(name)
        if table is None:
            raise PSError(f"unknown table {name!r} (the server holds {sorted(self.tables)})")
        want = {"ids", "weight", *table.state, *(["steps"] if table.steps is not None else [])}
        if set(tensors) != want:
            raise PSError(f"table {name}: rows to load need the tensors {sorted(want)}, got {sorted(tensors)}")
        ids = tensors["ids"]
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise PSError(f"table {name}: ids to load must be a 1-d int64 tensor")
        table.check_ids(ids)
        if ids.numel() and not np.isin(virtual_shard(name, ids, num_shards).numpy(), shards).all():
            raise PSError(f"table {name}: rows to load that hash outside the virtual shards named")
        for key, value in tensors.items():
            if key in ("ids", "steps"):
                continue
            if value.dtype != torch.float32 or not bool(torch.isfinite(value).all()):
                raise PSError(f"table {name}: {key} must be finite float32, got {value.dtype}")
        table.load(tensors)
        self._check_memory("a move of virtual shards")
        return {"loaded": ids.numel()}, {}

    def _reset(self, meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Forget every row and pending contribution and stand at ``step``: the first request of
        a restore from a checkpoint of that step (its rows follow with ``load``)."""
        step = meta.get("step")
        if not isinstance(step, int) or step < -1:
            raise PSError(f"reset needs the integer step of the checkpoint (>= -1), got {step!r}")
        self.tables = {name: DynamicTable(t.spec) for name, t in self.tables.items()}
        self.applied_step = step
        self.pending.clear()
        self.pulled.clear()
        return {"applied_step": step}, {}

    def _check_memory(self, what: str) -> None:
        if self.memory_limit is None:
            return
        held = sum(t.nbytes for t in self.tables.values())
        if held > self.memory_limit:
            raise OutOfMemoryError(
                f"parameter server {self.server_id} is out of memory: after {what} its tables hold "
                f"{held / 2**20:.2f} MiB, over its limit of {self.memory_limit / 2**20:.2f} MiB (--ps-memory)")

    def _drop(self, meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        shards, num_shards = _shards(meta)
        return {"dropped": sum(t.drop_shards(shards, num_shards) for t in self.tables.values())}, {}


def _shards(meta: dict[str, Any]) -> tuple[list[int], int]:
    """``shards`` and ``num_shards`` of a move's request, checked."""
    shards, num_shards = meta.get("shards"), meta.get("num_shards")
    if not isinstance(num_shards, int) or not 1 <= num_shards <= 1 << 16:
        raise PSError(f"num_shards must be an integer in [1, 65536], got {num_shards!r}")
    if not isinstance(shards, list) or not all(isinstance(v, int) and 0 <= v < num_shards for v in shards):
        raise PSError(f"shards must be a list of virtual shards in [0, {num_shards})")
    return shards, num_shards


# ---------------------------------------------------------------------------- the process
def serve(server: ParameterServer, host: str = "127.0.0.1", *, ready: Any = None,
          stop: threading.Event | None = None) -> None:
    """Serve requests until ``stop`` is set (or forever); ``ready(address)`` once bound."""
    ctx, sock, address = bind_router(host, MAX_REQUEST_BYTES)
    if ready is not None:
        ready(address)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    try:
        while stop is None or not stop.is_set():
            if not poller.poll(200):
                continue
            parts = sock.recv_multipart(copy=False)
            t0 = time.perf_counter()
            ident, body = parts[0], parts[1:]
            try:
                msg = frames.decode(body, max_bytes=MAX_REQUEST_BYTES)
                req = (msg.meta or {}).get("req")
                answer = server.handle(msg)
                if answer is None:
                    continue
                meta, tensors = answer
                reply = frames.encode(tensors, meta={"ok": True, "req": req, **meta})
            except OutOfMemoryError as exc:  # what a real limit's OOM kill would do, said clearly
                print(f"tidal-ps: {exc}", file=sys.stderr, flush=True)
                os._exit(PS_OUT_OF_MEMORY_EXIT)
            except (PSError, FrameError, KeyError, ValueError, TypeError) as exc:
                log.warning("ps %d refused a request: %s", server.server_id, exc)
                reply = frames.encode({}, meta={"ok": False, "req": _req_of(body), "error": str(exc)[:2000]})
            sock.send_multipart([ident, *reply], copy=False)
            server.requests += 1
            server.busy_s += time.perf_counter() - t0
    finally:
        sock.close(0)
        ctx.term()


def emulated_row_cost(value: str, server_id: int) -> float:
    """``TIDAL_PS_EMULATE_SLOW=ID:MICROSECONDS``: server ``ID`` takes that much longer per row
    pulled, as a server on a slower or shared machine would (benchmarks and tests of the
    hot-PS planner; on this 2-core machine a real hot spot cannot be made any other way).
    Seconds per row for this server (0: not it, or unset).

    Raises:
        SystemExit: a value that is not ID:MICROSECONDS.
    """
    if not value:
        return 0.0
    sid, _, micros = value.partition(":")
    try:
        return float(micros) * 1e-6 if int(sid) == server_id else 0.0
    except ValueError:
        print(f"tidal-ps: TIDAL_PS_EMULATE_SLOW={value!r}: expected ID:MICROSECONDS", file=sys.stderr)
        raise SystemExit(2) from None


def _req_of(body: list[Any]) -> Any:
    """The request id of a message that failed, when its header can be read (else None)."""
    try:
        meta = json.loads(bytes(body[0].buffer if hasattr(body[0], "buffer") else body[0])).get("meta")
        req = meta.get("req") if isinstance(meta, dict) else None
    except (ValueError, AttributeError, IndexError):
        return None  # a header that does not parse has no id to echo
    return req if isinstance(req, int) else None


def _rss_bytes() -> int:
    """This process's resident memory (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _reporter(server: ParameterServer, url: str, token: str, address: str) -> None:
    """Tell the master where this server listens, then its load, every REPORT_S (a thread)."""
    import httpx

    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10.0)
    last_requests, last_busy, last_t, last_cpu = 0, 0.0, time.monotonic(), time.process_time()
    while True:
        now, cpu = time.monotonic(), time.process_time()
        requests, busy = server.requests, server.busy_s
        stats = server.stats()
        served = requests - last_requests
        body = {"server_id": server.server_id, "address": address, "pid": os.getpid(),
                "rows": stats["rows"], "bytes": stats["bytes"], "applied_step": server.applied_step,
                "latency_ms": round(1e3 * (busy - last_busy) / served, 3) if served else 0.0,
                "requests_per_s": round((requests - last_requests) / max(now - last_t, 1e-9), 1),
                "busy": round(min(1.0, (busy - last_busy) / max(now - last_t, 1e-9)), 3),
                "cpu": round((cpu - last_cpu) / max(now - last_t, 1e-9), 3), "rss_bytes": _rss_bytes(),
                "shard_hits": server.shard_hits.tolist()}
        last_requests, last_busy, last_t, last_cpu = requests, busy, now, cpu
        try:
            resp = http.post("/v1/ps/report", json=body)
            if resp.status_code == 410:  # the job is over
                os._exit(0)
        except httpx.TransportError as exc:
            log.info("ps %d: master unreachable: %s", server.server_id, exc)
        time.sleep(REPORT_S)


def main() -> None:
    logging.basicConfig(level=os.environ.get("TIDAL_LOG_LEVEL", "WARNING"))
    torch.set_num_threads(int(os.environ.get("TIDAL_PS_THREADS", "1")))
    token = os.environ.get("TIDAL_TOKEN", "")
    if not token:
        print("tidal-ps: TIDAL_TOKEN is not set: a server answers only requests with the job's token",
              file=sys.stderr)
        raise SystemExit(2)
    limit = os.environ.get("TIDAL_PS_MEMORY_BYTES")
    server = ParameterServer(token, int(os.environ.get("TIDAL_PS_ID", "0")), int(limit) if limit else None)
    server.row_cost_s = emulated_row_cost(os.environ.get("TIDAL_PS_EMULATE_SLOW", ""), server.server_id)
    url = os.environ.get("TIDAL_MASTER_URL")
    host = os.environ.get("TIDAL_PS_HOST") or node_address(url)

    def ready(address: str) -> None:
        if url:
            threading.Thread(target=_reporter, args=(server, url, token, address), daemon=True,
                             name="tidal-ps-report").start()
        else:
            print(f"tidal-ps listening {address}", flush=True)

    serve(server, host, ready=ready)


if __name__ == "__main__":
    main()
