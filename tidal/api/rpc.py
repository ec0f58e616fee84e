"""One request, one reply, over ZeroMQ with the data-plane codec (``tidal.api.frames``).

The parameter servers answer requests whose ``meta`` holds ``op``, the job's ``token`` and a
request id ``req``; a reply's ``meta`` holds ``ok`` and, when not ok, ``error``. Workers talk to
them through ``tidal.ps.client``; the master, which moves virtual shards between them
(``tidal.master.servers``), uses this: one DEALER socket per server, one request at a time.
The codec (and torch with it) is imported on the first call, not with this module: the master
imports it, and needs torch only once it moves shards.
"""

from __future__ import annotations

import itertools
import os
import socket
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import zmq

from tidal.api.errors import PermanentError, RetryableError

if TYPE_CHECKING:
    import torch

    from tidal.api import frames

MAX_MESSAGE_BYTES = 1 << 30  # tidal.api.frames.MAX_MESSAGE_BYTES (checked in tests/api)


def node_address(master_url: str | None = None) -> str:
    """The address a node of a job listens on for its peers (its process group, data plane,
    shuffle): ``$TIDAL_NODE_HOST`` if set, else this machine's address on the route to the master
    (127.0.0.1 when the master is on 127.0.0.1, as on one machine). A node never listens on every
    interface, and on another machine than the master's it cannot listen on the master's address.
    A UDP socket's ``connect`` only picks the route: nothing is sent."""
    explicit = os.environ.get("TIDAL_NODE_HOST")
    if explicit:
        return explicit
    url = master_url if master_url is not None else os.environ.get("TIDAL_MASTER_URL", "")
    host = urlsplit(url).hostname or "127.0.0.1"
    if host == "localhost" or host.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def bind_router(host: str, max_bytes: int) -> tuple[zmq.Context[Any], zmq.Socket[Any], str]:
    """A ROUTER bound on ``host`` at a port the system chooses, refusing messages over
    ``max_bytes``: ``(context, socket, "tcp://HOST:PORT")``. The servers of the data plane
    (parameter servers, data workers) answer on one."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    port = sock.bind_to_random_port(f"tcp://{host}")
    return ctx, sock, f"tcp://{host}:{port}"


class RemoteRefusedError(PermanentError):
    """The other side answered the request with an error (the message is its own)."""


class RemoteTimeoutError(RetryableError):
    """The other side did not answer in time."""


class Caller:
    """Requests to one ZeroMQ ROUTER at ``address`` (``tcp://HOST:PORT``)."""

    def __init__(self, address: str, token: str, *, timeout_s: float = 30.0,
                 max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.address = address
        self.token = token
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self._sock.connect(address)
        self._req = itertools.count()

    def call(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> frames.Message:
        """Send ``meta`` (and ``tensors``) and wait for the answer to this request.

        Raises:
            RemoteRefusedError: the answer says ``ok: false``.
            RemoteTimeoutError: no answer within ``timeout_s``.
            tidal.api.errors.FrameError: an answer that breaks the codec's rules.
        """
        from tidal.api import frames

        req = next(self._req)
        self._sock.send_multipart(frames.encode(tensors or {}, meta={**meta, "token": self.token, "req": req}),
                                  copy=False)
        while True:  # answers to earlier requests that timed out are skipped
            if not self._sock.poll(int(self.timeout_s * 1000)):
                raise RemoteTimeoutError(f"{self.address} did not answer {meta.get('op')!r} within {self.timeout_s:g} s")
            msg = frames.decode(self._sock.recv_multipart(copy=False), max_bytes=self.max_bytes)
            reply = msg.meta or {}
            if reply.get("req") != req:
                continue
            if not reply.get("ok"):
                raise RemoteRefusedError(f"{self.address}: {reply.get('error', 'refused the request')}")
            return msg

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> Caller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
