"""HTTP client of the master's control plane (httpx), with retry and backoff.

Connection errors and 5xx are retried with exponential backoff (50 ms doubling to 2 s) for up
to ``patience_s``: a master being restarted from its journal is simply waited for. 4xx answers
are not retried: 409 is a stale round, 410 means this worker must exit.
"""

from __future__ import annotations

import logging
import time
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from tidal.api import PermanentError, StaleRoundError
from tidal.worker.api import MasterUnreachableError, WorkerGoneError

log = logging.getLogger(__name__)
T = TypeVar("T", bound=BaseModel)


class MasterClient:
    def __init__(self, url: str, token: str, patience_s: float = 120.0, timeout_s: float = 10.0) -> None:
        self.url = url
        self.token = token  # the job's bearer token (the rendezvous store speaks with it too)
        self.patience_s = patience_s
        self._http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s,
            limits=httpx.Limits(max_keepalive_connections=2),
        )

    def post(self, path: str, body: BaseModel, response: type[T], patience_s: float | None = None) -> T:
        return response.model_validate(self._call("POST", path, body.model_dump(mode="json"), patience_s))

    def post_raw(self, path: str, body: BaseModel, patience_s: float | None = None) -> Any:
        return self._call("POST", path, body.model_dump(mode="json"), patience_s)

    def get(self, path: str, patience_s: float | None = None) -> Any:
        return self._call("GET", path, None, patience_s)

    def _call(self, method: str, path: str, body: Any, patience_s: float | None) -> Any:
        deadline = time.monotonic() + (self.patience_s if patience_s is None else patience_s)
        delay = 0.05
        while True:
            try:
                resp = self._http.request(method, path, json=body)
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code < 400:
                    return resp.json()
                detail = _detail(resp)
                if resp.status_code == 409:
                    raise StaleRoundError(detail)
                if resp.status_code == 410:
                    raise WorkerGoneError(detail)
                if resp.status_code < 500:
                    raise PermanentError(f"master refused {path}: {resp.status_code} {detail}")
                problem = f"{resp.status_code} {detail}"
            if time.monotonic() + delay > deadline:
                raise MasterUnreachableError(f"master at {self.url} unreachable for {path}: {problem}")
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def close(self) -> None:
        self._http.close()


def _detail(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("detail", resp.text))
    except ValueError:
        return resp.text[:200]
