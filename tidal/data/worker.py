"""A data worker: builds whole mini-batches for the step ids it is given (GoldMiner 3.3, 4).

A data worker is stateless. It runs the training script itself, launched by the backend in the
role ``data`` (``TIDAL_ROLE=data``): ``tidal.worker.init()`` then joins no round, and the
script's ``job.loader(dataset, batch_size=..., preprocess=fn)`` does not return: it serves
(``serve``) until the job ends. What the script does before its loader (building the model,
say) runs in the data worker too: keep it cheap, or guard it with ``job.is_data_worker``.

Wire (ZeroMQ, the codec of ``tidal.api.frames``; no pickle). The data worker binds a ROUTER on
the job's host, port chosen by the system, and tells the master its address with its reports
(``POST /v1/data/report``, every second; the master hands the addresses to the trainers).

- task, trainer -> data worker: a message without tensors, ``step`` the step id, ``meta``
  ``{"token": T, "loader": K, "start": a, "end": b}``: build the batch of samples ``[a, b)``.
  ``K`` names the loader (``loader_key``): a data worker serving another dataset refuses.
- batch, data worker -> trainer: ``step`` the same id, every tensor of the batch in the one
  multipart message (fused transfer), ``meta`` ``{"start": a, "end": b, "tree": skeleton}``
  (``tidal.data.batches.flatten``); or, when the batch cannot be built, ``meta``
  ``{"start": a, "end": b, "error": why}``, naming the step and the range; a task for another
  loader than the one it serves (a script's second ``job.loader``) gets ``{"refused": why}``.

Any number of trainers talk to one data worker (a ROUTER answers each on its own connection),
and a trainer spreads its tasks over every data worker (``tidal.data.dispatch``): there is no
fixed pairing.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tidal.api import frames
from tidal.api.errors import FrameError
from tidal.api.rpc import bind_router, node_address
from tidal.data.batches import BatchError, build_batch, flatten

__all__ = ["DataWorker", "loader_key", "serve", "serve_loader"]

log = logging.getLogger(__name__)

REPORT_S = 1.0
MAX_TASK_BYTES = 1 << 16  # a task is a header; anything bigger is not one


def loader_key(size: int, preprocess: Any) -> str:
    """What a task names its loader by: the dataset's size and the preprocess function's name."""
    if preprocess is None:
        return f"{size}:none"
    name = getattr(preprocess, "__qualname__", None) or type(preprocess).__qualname__
    return f"{size}:{name}"


class DataWorker:
    """The batch builder behind the socket: ``handle`` turns a task's frames into the reply's."""

    def __init__(self, dataset: Any, preprocess: Callable[[Any], Any] | None, token: str, *,
                 collate_fn: Callable[[list[Any]], Any] | None = None, data_worker_id: int = 0) -> None:
        self.dataset = dataset
        self.size = len(dataset)
        self.preprocess = preprocess
        self.collate_fn = collate_fn
        self.token = token
        self.key = loader_key(self.size, preprocess)
        self.data_worker_id = data_worker_id
        self.batches = 0
        self.samples = 0
        self.busy_s = 0.0

    def handle(self, body: list[Any]) -> list[Any]:
        """The reply to one task (an error reply for a batch that cannot be built).

        Raises:
            tidal.api.errors.FrameError, ValueError: not a task of this job (no reply is sent).
        """
        msg = frames.decode(body, max_bytes=MAX_TASK_BYTES)
        meta = msg.meta or {}
        if meta.get("token") != self.token:
            raise ValueError("a task without the job's token")
        start, end, step = meta.get("start"), meta.get("end"), msg.step
        if step is None or not isinstance(start, int) or not isinstance(end, int) or not 0 <= start < end <= self.size:
            raise ValueError(f"a task with step {step!r} and range {start!r}..{end!r} outside the dataset "
                             f"of {self.size} samples")
        where = {"start": start, "end": end}
        if meta.get("loader") != self.key:  # a script's second loader: its trainer builds those itself
            return frames.encode({}, step=step, meta={
                **where, "refused": f"data worker {self.data_worker_id} serves loader {self.key}, "
                                    f"not {meta.get('loader')!r}"})
        t0 = time.perf_counter()
        try:
            skeleton, tensors = flatten(build_batch(self.dataset, start, end, self.preprocess, self.collate_fn))
            reply = frames.encode(tensors, step=step, meta={**where, "tree": skeleton})
        except (BatchError, TypeError, FrameError) as exc:
            text = str(exc) if "samples [" in str(exc) else f"the batch of samples [{start}, {end}): {exc}"
            text += f" (in data worker {self.data_worker_id})"
            reply = frames.encode({}, step=step, meta={**where, "error": text[:4000]})
        self.busy_s += time.perf_counter() - t0
        self.batches += 1
        self.samples += end - start
        return reply


def serve(worker: DataWorker, host: str = "127.0.0.1", *, ready: Callable[[str], None] | None = None,
          stop: threading.Event | None = None) -> None:
    """Answer tasks until ``stop`` is set (or forever); ``ready(address)`` once bound."""
    ctx, sock, address = bind_router(host, MAX_TASK_BYTES)
    if ready is not None:
        ready(address)
    try:
        while stop is None or not stop.is_set():
            if not sock.poll(200):
                continue
            ident, *body = sock.recv_multipart(copy=False)
            try:
                reply = worker.handle(body)
            except (FrameError, ValueError) as exc:
                log.warning("data worker %d ignored a message: %s", worker.data_worker_id, exc)
                continue
            sock.send_multipart([ident, *reply], copy=False)
    finally:
        sock.close(0)
        ctx.term()


def _reporter(worker: DataWorker, url: str, token: str, address: str) -> None:
    """Tell the master where this data worker listens, then its load, every REPORT_S (a thread).
    The master answers 410 once the job is over (or this data worker is retired): it exits."""
    import httpx

    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10.0)
    last_t, last_busy, last_cpu, last_batches = time.monotonic(), 0.0, time.process_time(), 0
    patience = float(os.environ.get("TIDAL_MASTER_TIMEOUT", "120"))
    answered = time.monotonic()
    while True:
        now, cpu, busy, batches = time.monotonic(), time.process_time(), worker.busy_s, worker.batches
        span = max(now - last_t, 1e-9)
        body = {"data_worker_id": worker.data_worker_id, "address": address, "pid": os.getpid(),
                "batches": batches, "samples": worker.samples,
                "batches_per_s": round((batches - last_batches) / span, 2),
                "busy": round(min(1.0, (busy - last_busy) / span), 3), "cpu": round((cpu - last_cpu) / span, 3)}
        last_t, last_busy, last_cpu, last_batches = now, busy, cpu, batches
        try:
            resp = http.post("/v1/data/report", json=body)
            answered = time.monotonic()
            if resp.status_code == 410:
                os._exit(0)
        except httpx.TransportError as exc:
            log.info("data worker %d: master unreachable: %s", worker.data_worker_id, exc)
            if time.monotonic() - answered > patience:  # the job is gone with its master: do not linger
                print(f"tidal-data: the master has not answered for {patience:g} s; exiting", file=sys.stderr,
                      flush=True)
                os._exit(1)
        time.sleep(REPORT_S)


def serve_loader(dataset: Any, preprocess: Callable[[Any], Any] | None,
                 collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
    """The data role's ``job.loader(...)``: serve this dataset's batches until the job ends.

    Raises:
        SystemExit: always (0 when the job ended; 2 when the environment is not a data worker's).
    """
    token = os.environ.get("TIDAL_TOKEN", "")
    url = os.environ.get("TIDAL_MASTER_URL", "")
    if not token or not url:
        print("tidal-data: TIDAL_TOKEN and TIDAL_MASTER_URL must be set for a data worker", file=sys.stderr)
        raise SystemExit(2)
    worker = DataWorker(dataset, preprocess, token, collate_fn=collate_fn,
                        data_worker_id=int(os.environ.get("TIDAL_DATA_WORKER_ID", "0")))

    def ready(address: str) -> None:
        print(f"data worker {worker.data_worker_id} serves {worker.key} at {address}", flush=True)
        threading.Thread(target=_reporter, args=(worker, url, token, address), daemon=True,
                         name="tidal-data-report").start()

    serve(worker, os.environ.get("TIDAL_DATA_HOST") or node_address(url), ready=ready)
    raise SystemExit(0)
