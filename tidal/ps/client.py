"""A worker's connection to the parameter servers: pulls and pushes batched per server per step.

``PSClient`` splits each table's ids by the shard map (``tidal.ps.api.virtual_shard``), sends
one request to every server concerned at once, and waits for all the replies; a request carries
the worker's watermark (the last step it applied: tidal.ps.server). Every reply is checked (its
request id, ``ok``, the codec's size and dtype checks, the rows' shape) before use.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from tidal.api import frames
from tidal.ps.api import PSAbortedError, PSError, PSUnavailableError, TableSpec, virtual_shard

MAX_REPLY_BYTES = 1 << 31
POLL_S = 0.1  # how often a wait for a server asks ``abort``
LOAD_ROWS = 1 << 18  # rows per load request of a restore


class PSClient:
    """Requests to the servers at ``addresses`` (server ``i`` at ``addresses[i]``) holding the
    virtual shards of ``shard_map`` (shard ``v`` on server ``shard_map[v]``).

    ``abort``: asked while a request waits for its answer; when it says so the request is
    given up (``PSAbortedError``): the job is re-forming, a server may never answer.

    Raises:
        PSError: a server refuses the tables (another worker declared them otherwise).
        PSUnavailableError: a server does not answer within ``timeout_s``.
    """

    def __init__(self, addresses: list[str], shard_map: list[int], token: str, tables: list[TableSpec],
                 *, timeout_s: float = 60.0, abort: Callable[[], bool] | None = None) -> None:
        if not addresses:
            raise PSError("no parameter servers to connect to")
        if not shard_map or min(shard_map) < 0 or max(shard_map) >= len(addresses):
            raise PSError(f"a shard map naming servers outside 0..{len(addresses) - 1}")
        self.addresses = list(addresses)
        self.shard_map = torch.tensor(shard_map, dtype=torch.int64)
        self.token = token
        self.tables = {t.name: t for t in tables}
        self.timeout_s = timeout_s
        self.abort = abort
        self.watermark: list[int] | None = None  # [round, step, total] of the last applied step
        # per table, the ids of the last split and their positions by server: a step's push
        # sends exactly the ids its pull fetched, so it reuses their split instead of hashing again
        self._splits: dict[str, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}
        self._ctx = zmq.Context()
        self._socks: list[zmq.Socket[Any]] = []
        for address in self.addresses:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
            s.connect(address)
            self._socks.append(s)
        self._req = itertools.count()
        self._unacked: dict[int, set[int]] = {}  # server -> ids of asynchronous pushes not yet answered
        specs = [t.to_json() for t in tables]
        try:
            hello = {"op": "hello", "tables": specs, "num_shards": len(shard_map)}
            self._call({i: (hello, {}) for i in range(len(self._socks))})
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        for s in self._socks:
            s.close(0)
        self._ctx.term()

    # ------------------------------------------------------------------ the step
    def split(self, table: str, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """``ids`` (sorted, unique) by server: the positions of those each server holds (in
        order, so each server's part stays sorted), for servers holding any.

        Raises:
            PSError: an unknown table, or ids that are not a 1-d int64 tensor.
        """
        if table not in self.tables:
            raise PSError(f"unknown table {table!r} (declared: {sorted(self.tables)})")
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise PSError(f"table {table}: ids must be a 1-d int64 tensor, got {ids.dtype} {list(ids.shape)}")
        cached = self._splits.get(table)
        if cached is not None and cached[0] is ids:
            return cached[1]
        if len(self.addresses) == 1:
            parts = {0: torch.arange(ids.numel())} if ids.numel() else {}
        else:
            server = self.shard_map.index_select(0, virtual_shard(table, ids.cpu(), len(self.shard_map)))
            parts = {int(i): (server == i).nonzero().squeeze(1) for i in torch.unique(server).tolist()}
        self._splits[table] = (ids, parts)
        return parts

    def pull(self, ids: dict[str, torch.Tensor], *, round_: int, step: int,
             key: int | None) -> dict[str, torch.Tensor]:
        """The rows of each table's ``ids`` (sorted and unique int64) as of the last applied step;
        ``key`` None: a read outside a step (evaluation), which a push cannot follow."""
        per_server: dict[int, dict[str, torch.Tensor]] = {}
        masks: dict[str, dict[int, torch.Tensor]] = {}
        for name, t_ids in ids.items():
            masks[name] = self.split(name, t_ids)
            for server, mask in masks[name].items():
                per_server.setdefault(server, {})[f"{name}.ids"] = t_ids.index_select(0, mask)
        meta = {"op": "pull", "round": round_, "step": step, "key": key}
        replies = self._call({s: (meta, tensors) for s, tensors in per_server.items()})
        out = {}
        for name, t_ids in ids.items():
            rows = torch.empty(t_ids.numel(), self.tables[name].dim)
            for server, mask in masks[name].items():
                got = replies[server].get(f"{name}.rows")
                want = (mask.numel(), self.tables[name].dim)
                if got is None or got.dtype != torch.float32 or tuple(got.shape) != want:
                    raise PSError(f"server {server} answered a pull of table {name} with "
                                  f"{None if got is None else (got.dtype, list(got.shape))}, expected float32 {list(want)}")
                rows.index_copy_(0, mask, got)
            out[name] = rows
        return out

    def push(self, grads: dict[str, tuple[torch.Tensor, torch.Tensor]], *, round_: int, step: int, key: int,
             asynchronous: bool = False) -> None:
        """Each table's ``(ids, grad)``: the contribution's gradient of the pulled rows.
        ``asynchronous``: the servers apply it on arrival, and this returns without waiting for
        their answers (``flush`` waits; any later request checks those it receives)."""
        per_server: dict[int, dict[str, torch.Tensor]] = {}
        for name, (t_ids, grad) in grads.items():
            for server, mask in self.split(name, t_ids).items():
                per_server.setdefault(server, {})[f"{name}.ids"] = t_ids.index_select(0, mask)
                per_server[server][f"{name}.grad"] = grad.index_select(0, mask)
        meta = {"op": "push", "round": round_, "step": step, "key": key, "async": asynchronous}
        requests = {s: (meta, tensors) for s, tensors in per_server.items()}
        if not asynchronous:
            self._call(requests)
            return
        for server, req in self._send(requests).items():
            self._unacked.setdefault(server, set()).add(req)

    def flush(self) -> None:
        """Wait for the answers to the asynchronous pushes sent so far (a refusal raises)."""
        self._wait({})

    def commit(self, round_: int, step: int, total: int) -> None:
        """The step is applied: tell every server (no reply awaited; every later request
        carries the same watermark, so a lost one is made up)."""
        self.watermark = [round_, step, total]
        header = {"op": "commit", "token": self.token, "commit": self.watermark}
        for s in self._socks:
            s.send_multipart(frames.encode({}, meta=header), copy=False)

    # ------------------------------------------------------------------ whole tables
    def export(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every table's rows over all servers, in id order (the canonical order of a
        checkpoint and the fingerprint, whatever the shard map)."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name in sorted(self.tables):
            parts: list[dict[str, torch.Tensor]] = []
            for server in range(len(self._socks)):
                start = 0
                while True:
                    reply = self._call({server: ({"op": "export", "table": name, "start": start}, {})},
                                       with_meta=True)[server]
                    meta = reply.pop("__meta__")
                    parts.append(reply)
                    start = int(meta["next"])
                    if start >= int(meta["rows"]) or not len(reply["ids"]):
                        break
            ids = torch.cat([p["ids"] for p in parts])
            order = torch.argsort(ids)
            out[name] = {field: torch.cat([p[field] for p in parts])[order] for field in parts[0]}
        return out

    def restore(self, tables: dict[str, dict[str, torch.Tensor]], step: int) -> int:
        """Put the servers back at a checkpoint of ``step``: each forgets everything
        (``reset``), then loads the rows of its virtual shards; ``tables`` as ``export`` gives
        them (an empty dict: the fresh tables of a job resumed from scratch). Returns the rows.

        Raises:
            PSError: a table the client does not declare, or a server refuses the rows.
        """
        unknown = sorted(set(tables) - set(self.tables))
        if unknown:
            raise PSError(f"the checkpoint holds tables {unknown} this script does not declare")
        self._call({i: ({"op": "reset", "step": step}, {}) for i in range(len(self._socks))})
        num_shards = len(self.shard_map)
        held = {i: (self.shard_map == i).nonzero().squeeze(1).tolist() for i in range(len(self._socks))}
        loaded = 0
        for name, part in sorted(tables.items()):
            ids = part["ids"]
            for server, mask in self.split(name, ids).items():
                for at in range(0, mask.numel(), LOAD_ROWS):
                    pick = mask[at:at + LOAD_ROWS]
                    rows = {field: value.index_select(0, pick) for field, value in part.items()}
                    self._call({server: ({"op": "load", "table": name, "shards": held[server],
                                          "num_shards": num_shards}, rows)})
                    loaded += pick.numel()
        return loaded

    def stats(self) -> list[dict[str, Any]]:
        replies = self._call({i: ({"op": "stats"}, {}) for i in range(len(self._socks))}, with_meta=True)
        return [replies[i]["__meta__"] for i in range(len(self._socks))]

    # ------------------------------------------------------------------ transport
    def _call(self, requests: dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]],
              with_meta: bool = False) -> dict[int, Any]:
        """Send every request at once, then wait for every reply."""
        return self._wait(self._send(requests), with_meta)

    def _send(self, requests: dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]]) -> dict[int, int]:
        """Send each server its request; returns the request id sent to each."""
        sent: dict[int, int] = {}
        for server, (meta, tensors) in requests.items():
            req = next(self._req)
            header = {**meta, "token": self.token, "req": req, "commit": self.watermark}
            self._socks[server].send_multipart(frames.encode(tensors, meta=header), copy=False)
            sent[server] = req
        return sent

    def _wait(self, waiting: dict[int, int], with_meta: bool = False) -> dict[int, Any]:
        """The reply to each server's request ``waiting[server]`` (matched by request id; late
        replies to requests that timed out are skipped), and every unacknowledged asynchronous
        push's on the way, all within ``timeout_s``."""
        waiting = dict(waiting)
        poller = zmq.Poller()
        for server in set(waiting) | {s for s, reqs in self._unacked.items() if reqs}:
            poller.register(self._socks[server], zmq.POLLIN)
        out: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s  # for the whole call, however many servers
        while waiting or any(self._unacked.values()):
            left = deadline - time.monotonic()
            ready = dict(poller.poll(max(0, int(min(left, POLL_S) * 1000))))
            if not ready:
                late = ", ".join(f"{s} ({self.addresses[s]})"
                                 for s in sorted(set(waiting) | {s for s, r in self._unacked.items() if r}))
                if self.abort is not None and self.abort():
                    self._unacked.clear()  # pushes of a step the re-form drops
                    raise PSAbortedError(f"gave up waiting for parameter server {late}: the job is re-forming")
                if left <= 0:
                    self._unacked.clear()
                    raise PSUnavailableError(f"parameter server {late} did not answer within {self.timeout_s:g} s")
                continue
            for sock in ready:
                server = self._socks.index(sock)
                msg = frames.decode(sock.recv_multipart(copy=False), max_bytes=MAX_REPLY_BYTES)
                meta = msg.meta or {}
                req = meta.get("req")
                unacked = self._unacked.get(server, set())
                if req != waiting.get(server) and req not in unacked:
                    continue  # the answer to a request that timed out earlier
                unacked.discard(req)
                if not meta.get("ok"):
                    raise PSError(f"parameter server {server}: {meta.get('error', 'refused the request')}")
                if req == waiting.get(server):
                    del waiting[server]
                    out[server] = {**msg.tensors, "__meta__": meta} if with_meta else msg.tensors
                if server not in waiting and not unacked:
                    poller.unregister(sock)
        return out
