"""The c10d ``Store`` the workers' process groups rendezvous through: the master's ``/v1/store``.

torch.distributed's TCPStore listened on every interface and took no credential; this store
speaks to the job master over its control plane instead (HTTP/JSON, the job's bearer token,
values in base64, no pickle), so a job has one listening socket, on its host, behind its
secret. ``MasterStore`` is a Python subclass of ``torch.distributed.Store``: gloo and nccl call
it like any c10d store (gloo: ``set``, ``wait``, ``get``; nccl: ``set``, blocking ``get``,
``check``).

Every key is sent under ``prefix`` (the round's ``tidal/{job_id}/round{R}/``, which the master
requires): keys the backends write to their "global" store (nccl's dump signal) stay inside
the round too. ``get`` and ``wait`` long-poll, up to a second per request, until the store's
timeout; a refusal (401, 409 for a round the master left, 413, 507) raises at once, connection
errors and other 5xx are retried for ``patience_s``.

Forming a group is a burst of small requests, each paid in Python on both ends, so two things
keep it short: gloo asks ``wait([key])`` then ``get(key)`` for every peer, and one long-polled
``get`` answers both (the value is kept for the ``get`` that follows, and forgotten at any other
call); and the HTTP client does not load the CA bundle for a plain-http master (65-120 ms, once
per round).

Keep a reference to the store for as long as a process group uses it: the C++ side holds only
the base object, and once the Python object is gone its methods are gone too.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import logging
import time
from typing import TypeVar

import httpx
import torch.distributed as dist
from pydantic import BaseModel, ValidationError

from tidal.api import (
    MAX_STORE_VALUE_BYTES,
    MAX_STORE_WAIT_S,
    StoreAddRequest,
    StoreAddResponse,
    StoreCompareSetRequest,
    StoreDeleteRequest,
    StoreDeleteResponse,
    StoreGetRequest,
    StoreKeysRequest,
    StoreKeysResponse,
    StoreNumKeysRequest,
    StoreNumKeysResponse,
    StoreSetRequest,
    StoreSetResponse,
    StoreValueResponse,
)

log = logging.getLogger(__name__)
T = TypeVar("T", bound=BaseModel)

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)  # c10d's default store timeout
HTTP_TIMEOUT_S = MAX_STORE_WAIT_S + 10.0  # a long-poll plus a busy master


class MasterStore(dist.Store):
    """A c10d store held by the job master, one round's keys (``prefix``) at a time."""

    def __init__(self, url: str, token: str, prefix: str, *, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                 patience_s: float = 5.0) -> None:
        super().__init__()
        self.url = url
        self.prefix = prefix
        self.patience_s = patience_s
        self._token = token
        self._http = httpx.Client(
            base_url=url, timeout=HTTP_TIMEOUT_S, limits=httpx.Limits(max_keepalive_connections=4),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            # certificates only matter for https; for http the bundle would be read for nothing
            verify=not url.startswith("http://"),
        )
        self._waited: tuple[str, bytes] | None = None  # the value a single-key wait() fetched
        self.set_timeout(timeout)

    def clone(self) -> MasterStore:
        """A store on the same keys (c10d's backends may ask one per thread)."""
        return MasterStore(self.url, self._token, self.prefix, timeout=self._timeout(), patience_s=self.patience_s)

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ c10d's Store
    def set(self, key: str, value: bytes | str) -> None:
        self._waited = None
        self._call("/v1/store/set", StoreSetRequest(key=self.prefix + key, value=_b64(_bytes(value))),
                   StoreSetResponse)

    def get(self, key: str) -> bytes:
        """The value at ``key``, waiting for it up to the store's timeout.

        Raises:
            torch.distributed.DistStoreError: timed out, or the master refused the key.
            torch.distributed.DistNetworkError: the master did not answer for ``patience_s``.
        """
        waited, self._waited = self._waited, None
        if waited is not None and waited[0] == key:
            return waited[1]
        return self._get(key, self._deadline(None))

    def _get(self, key: str, deadline: float | None) -> bytes:
        while True:
            resp = self._call("/v1/store/get", StoreGetRequest(key=self.prefix + key, wait_s=_poll(deadline)),
                              StoreValueResponse)
            if resp.found:
                return _unb64(resp.value)
            self._check_deadline(deadline, [key])

    def add(self, key: str, amount: int) -> int:
        self._waited = None
        return self._call("/v1/store/add", StoreAddRequest(key=self.prefix + key, amount=amount),
                          StoreAddResponse).value

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        self._waited = None
        req = StoreCompareSetRequest(key=self.prefix + key, expected=_b64(_bytes(expected_value)),
                                     desired=_b64(_bytes(desired_value)))
        return _unb64(self._call("/v1/store/compare_set", req, StoreValueResponse).value)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Block until every key exists.

        Raises:
            torch.distributed.DistStoreError: ``timeout`` (the store's own if None) passed first.
        """
        self._waited = None
        deadline = self._deadline(timeout)
        if len(keys) == 1:  # gloo's pattern: the get that follows needs the value anyway
            self._waited = (keys[0], self._get(keys[0], deadline))
            return
        full = [self.prefix + k for k in keys]
        while True:
            resp = self._call("/v1/store/wait", StoreKeysRequest(keys=full, wait_s=_poll(deadline)),
                              StoreKeysResponse)
            if resp.ready:
                return
            self._check_deadline(deadline, keys)

    def check(self, keys: list[str]) -> bool:
        self._waited = None
        return self._call("/v1/store/check", StoreKeysRequest(keys=[self.prefix + k for k in keys]),
                          StoreKeysResponse).ready

    def delete_key(self, key: str) -> bool:
        self._waited = None
        return self._call("/v1/store/delete", StoreDeleteRequest(key=self.prefix + key),
                          StoreDeleteResponse).deleted

    def num_keys(self) -> int:
        """Keys under this store's prefix (TCPStore counts the whole store; the round is what matters)."""
        self._waited = None
        return self._call("/v1/store/num_keys", StoreNumKeysRequest(prefix=self.prefix),
                          StoreNumKeysResponse).count

    # ------------------------------------------------------------------ transport
    def _deadline(self, timeout: datetime.timedelta | None) -> float | None:
        seconds = (self._timeout() if timeout is None else timeout).total_seconds()
        return None if seconds <= 0 else time.monotonic() + seconds  # 0 is c10d's kNoTimeout

    def _timeout(self) -> datetime.timedelta:
        """The store's timeout, which C++ callers may change (``StoreTimeoutGuard``)."""
        return self.timeout  # type: ignore[attr-defined,no-any-return]  # missing from torch's stubs

    def _check_deadline(self, deadline: float | None, keys: list[str]) -> None:
        if deadline is not None and time.monotonic() >= deadline:
            raise dist.DistStoreError(f"wait timeout: keys {keys} under {self.prefix} not set in the master's store")

    def _call(self, path: str, body: BaseModel, response: type[T]) -> T:
        give_up = time.monotonic() + self.patience_s
        delay = 0.05
        while True:
            try:
                resp = self._http.post(path, content=body.model_dump_json())
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code == 200:
                    try:
                        return response.model_validate_json(resp.content)
                    except ValidationError as exc:
                        raise dist.DistStoreError(f"the master's store answered {path} with a bad body: {exc}") from exc
                problem = f"{resp.status_code} {_detail(resp)}"
                if resp.status_code < 500 or resp.status_code == 507:
                    raise dist.DistStoreError(f"the master's store refused {path}: {problem}")
            if time.monotonic() + delay > give_up:
                raise dist.DistNetworkError(f"the master's store at {self.url} did not answer {path}: {problem}")
            log.debug("store %s: %s; retrying in %.2f s", path, problem, delay)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


def _poll(deadline: float | None) -> float:
    """How long the next long-poll may last: a second, or what is left of the deadline."""
    if deadline is None:
        return MAX_STORE_WAIT_S
    return min(MAX_STORE_WAIT_S, max(0.0, deadline - time.monotonic()))


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _b64(value: bytes) -> str:
    if len(value) > MAX_STORE_VALUE_BYTES:
        raise ValueError(f"store value of {len(value)} bytes is over the limit of {MAX_STORE_VALUE_BYTES}")
    return base64.b64encode(value).decode("ascii")


def _unb64(text: str) -> bytes:
    try:
        value = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise dist.DistStoreError(f"the master's store sent a value that is not base64: {exc}") from exc
    if len(value) > MAX_STORE_VALUE_BYTES:
        raise dist.DistStoreError(f"the master's store sent {len(value)} bytes, over {MAX_STORE_VALUE_BYTES}")
    return value


def _detail(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("detail", resp.text))[:300]
    except (ValueError, AttributeError):
        return resp.text[:300]
