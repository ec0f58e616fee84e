"""The master's HTTP control plane: FastAPI over a JobMaster, bearer token, size limits.

One router per caller: the workers (`_worker_router`), a user or tool (`_user_router`) and the
workers' process groups (`_store_router`); parameter servers and data workers get their own.

Every route requires ``Authorization: Bearer <job token>`` (401 otherwise, the OpenAPI document
included). Bodies over ``MAX_BODY_BYTES`` get 413 before they are parsed. Domain errors carry
their HTTP status (tidal.master.api); validation errors are FastAPI's 422. Nothing the master
raises on purpose becomes a 500; tests/test_control_plane.py runs schemathesis to keep it so.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import importlib.resources
import json
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from tidal.api import (
    MAX_BODY_BYTES,
    MAX_STORE_VALUE_BYTES,
    MAX_STORE_VALUE_CHARS,
    MAX_STORE_WAIT_S,
    DatasetRequest,
    DataWorkerReport,
    FinishRequest,
    JoinRequest,
    JoinResponse,
    LeaseRequest,
    LeaseResponse,
    RendezvousRequest,
    RendezvousResponse,
    ReportRequest,
    ReportResponse,
    ScaleRequest,
    ServerReport,
    StatusResponse,
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
    TidalError,
    TimelineResponse,
)
from tidal.master.api import MasterError
from tidal.master.job import JobMaster
from tidal.master.metrics import CONTENT_TYPE, job_registry, render
from tidal.master.shards import ShardConflictError
from tidal.master.store import RoundStore, StoreValueError, StoreValueTooLargeError

RENDEZVOUS_POLL_S = 1.0


class ChangeNotifier:
    """Wakes every coroutine waiting for the master's state to change (rendezvous long-polls)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            pass


DASHBOARD_PATH = "/dashboard"


def dashboard_cookie(job_id: str) -> str:
    """The name of the cookie that carries the token for the dashboard's browser: one per job,
    since a browser sends a 127.0.0.1 cookie to every port (two jobs' dashboards open at once
    would otherwise overwrite each other's token)."""
    return "tidal_token_" + "".join(c for c in job_id if c.isascii() and (c.isalnum() or c in "-_"))


class GuardMiddleware:
    """Bearer token and body-size checks, before routing (plain ASGI, so it also guards /docs).

    The dashboard's browser cannot send a bearer header when the user opens the page, so
    ``GET /dashboard`` also takes the token as a ``token`` query parameter (the answer then sets
    it as an HttpOnly, SameSite=Strict cookie, ``cookie_name``), and every ``GET`` also takes
    that cookie (the page's own fetches). Everything else, every POST included, is bearer only.
    """

    def __init__(self, app: Any, token: str, max_body: int = MAX_BODY_BYTES,
                 fast_routes: dict[str, tuple[type[BaseModel], Callable[[Any], BaseModel]]] | None = None,
                 cookie_name: str = "tidal_token") -> None:
        self.app = app
        self.token = token.encode()
        self.expected = f"Bearer {token}".encode()
        self.max_body = max_body
        self.fast_routes = fast_routes or {}
        self.cookie_name = cookie_name.encode()
        self.set_cookie = (self.cookie_name + b"=" + self.token + b"; HttpOnly; SameSite=Strict; Path=/")

    def _authorized(self, scope: dict) -> tuple[bool, bool]:
        """Whether the request carries the token, and whether it came in the dashboard's query."""
        raw = scope.get("headers") or []
        if hmac.compare_digest(dict(raw).get(b"authorization", b""), self.expected):
            return True, False
        if scope["method"] != "GET":
            return False, False
        if scope["path"] == DASHBOARD_PATH:
            query = scope.get("query_string", b"").decode("latin-1")
            for value in parse_qs(query, encoding="latin-1").get("token", []):
                if hmac.compare_digest(value.encode("latin-1"), self.token):
                    return True, True
        for name, value in raw:
            if name != b"cookie":
                continue
            for part in value.split(b";"):
                key, eq, val = part.strip().partition(b"=")
                if eq and key == self.cookie_name and hmac.compare_digest(val.strip(b'"'), self.token):
                    return True, False
        return False, False

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        allowed, from_query = self._authorized(scope)
        if not allowed:
            await _reply(send, 401, "missing or wrong bearer token", [(b"www-authenticate", b"Bearer")])
            return
        if from_query:
            send = self._setting_cookie(send)
        length = headers.get(b"content-length")
        if length is not None:
            try:
                if int(length) > self.max_body:
                    await _reply(send, 413, f"body over {self.max_body} bytes")
                    return
            except ValueError:
                await _reply(send, 400, "bad content-length")
                return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body:
                await _reply(send, 413, f"body over {self.max_body} bytes")
                return
            more = message.get("more_body", False)
        route = self.fast_routes.get(scope["path"]) if scope["method"] == "POST" else None
        if route is not None:
            await _fast(send, bytes(body), *route)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _setting_cookie(self, send: Any) -> Any:
        async def send_with_cookie(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", self.set_cookie)]}
            await send(message)

        return send_with_cookie


async def _fast(send: Any, body: bytes, model: type[BaseModel], handler: Callable[[Any], BaseModel]) -> None:
    """The hot routes (report, lease: every worker, every second) without the FastAPI stack.

    The same models validate the body and the same handlers answer, with the statuses the
    FastAPI routes would give (422, the domain errors' own, 400); routing, dependency solving
    and six middleware layers were most of a request's CPU (bench/master_load.py). FastAPI
    still declares these routes, so the OpenAPI document and schemathesis cover them.
    """
    try:
        result = handler(model.model_validate_json(body))
    except ValidationError as exc:
        await _send_json(send, 422, json.dumps({"detail": validation_errors(exc)}).encode())
        return
    except TidalError as exc:
        await _reply(send, http_status(exc), str(exc))
        return
    await _send_json(send, 200, result.model_dump_json().encode())


def http_status(exc: TidalError) -> int:
    """The one error-to-status table of the control plane: a master error carries its own status
    (tidal.master.api), a shard conflict is 409, any other refusal on purpose 400; never a 500."""
    if isinstance(exc, MasterError):
        return exc.status
    if isinstance(exc, ShardConflictError):
        return 409
    return 400


def validation_errors(exc: ValidationError | RequestValidationError) -> list[dict[str, Any]]:
    """Pydantic's errors without the offending input (FastAPI echoes it, and NaN or Infinity is
    no JSON)."""
    return [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()]


async def _send_json(send: Any, status: int, payload: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": payload})


def _json(model: BaseModel) -> Response:
    """Serialize a response model directly: the hot routes skip FastAPI's response re-validation
    (the models are built by the master itself), which is a large part of a request's CPU."""
    return Response(content=model.model_dump_json(), media_type="application/json")


async def _reply(send: Any, status: int, detail: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    await _send_json(send, status, json.dumps({"detail": detail}).encode(), extra)


def create_app(master: JobMaster, token: str, notifier: ChangeNotifier) -> Any:
    """The ASGI application: FastAPI routes behind the guard middleware."""
    app = FastAPI(
        title="tidal job master",
        version="1",
        description="Control plane of one elastic training job. Every request needs the job's bearer token.",
    )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": validation_errors(exc)}, status_code=422)

    @app.exception_handler(TidalError)
    async def _tidal_error(_: Request, exc: TidalError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=http_status(exc))

    app.include_router(_worker_router(master, notifier))
    app.include_router(_user_router(master))
    app.include_router(_ps_router(master))
    app.include_router(_data_router(master))

    fast: dict[str, tuple[type[BaseModel], Callable[[Any], BaseModel]]] = {
        "/v1/report": (ReportRequest, master.report),
        "/v1/shards/lease": (LeaseRequest, master.lease),
    }
    store_router, store_fast = _store_router(master)
    app.include_router(store_router)
    fast.update(store_fast)
    return GuardMiddleware(app, token, fast_routes=fast, cookie_name=dashboard_cookie(master.spec.job_id))


def _worker_router(master: JobMaster, notifier: ChangeNotifier) -> APIRouter:
    """What a job's worker processes call: join, rendezvous, report, lease, dataset, finish.
    (Parameter servers and data workers get routers of their own.)"""
    router = APIRouter(tags=["workers"])

    @router.post("/v1/workers/join", response_model=JoinResponse, responses={404: {}, 410: {}})
    async def join(req: JoinRequest) -> Response:
        """A launched worker registers itself."""
        return _json(master.join(req))

    @router.post("/v1/rendezvous", response_model=RendezvousResponse, responses={404: {}, 409: {}, 410: {}})
    async def rendezvous(req: RendezvousRequest) -> Response:
        """Ask for a place in the next round; long-polls up to a second while the round forms."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RENDEZVOUS_POLL_S
        while True:
            resp = master.rendezvous(req)
            remaining = deadline - loop.time()
            if resp.status != "waiting" or remaining <= 0:
                return _json(resp)
            await notifier.wait(remaining)

    @router.post("/v1/report", response_model=ReportResponse, responses={400: {}, 404: {}, 409: {}, 410: {}})
    async def report(req: ReportRequest) -> Response:
        """Heartbeat, progress and the worker's step records."""
        return _json(master.report(req))

    @router.post("/v1/shards/lease", response_model=LeaseResponse, responses={400: {}, 404: {}, 409: {}, 410: {}})
    async def lease(req: LeaseRequest) -> Response:
        """Lease the next TODO shard of an epoch."""
        return _json(master.lease(req))

    @router.post("/v1/dataset", responses={400: {}, 404: {}, 409: {}, 410: {}})
    async def dataset(req: DatasetRequest) -> dict[str, str]:
        """Declare the dataset (logical workers read it in a fixed order instead of leasing)."""
        master.configure_dataset(req)
        return {"status": "ok"}

    @router.post("/v1/finish", responses={404: {}, 410: {}})
    async def finish(req: FinishRequest) -> dict[str, str]:
        """The training loop is done; ``metrics`` (e.g. the final AUC) go into the job summary."""
        master.finish(req)
        return {"state": master.state.value}

    return router


def _ps_router(master: JobMaster) -> APIRouter:
    """What a job's parameter servers call."""
    router = APIRouter(tags=["parameter servers"])

    @router.post("/v1/ps/report", responses={400: {}, 410: {}})
    async def ps_report(req: ServerReport) -> dict[str, str]:
        """A server's address (its first report registers it) and load, every second."""
        master.server_report(req)
        return {"state": master.state.value}

    return router


def _data_router(master: JobMaster) -> APIRouter:
    """What a job's data workers call."""
    router = APIRouter(tags=["data workers"])

    @router.post("/v1/data/report", responses={400: {}, 410: {}})
    async def data_report(req: DataWorkerReport) -> dict[str, str]:
        """A data worker's address (its first report registers it) and load, every second."""
        master.data_report(req)
        return {"state": master.state.value}

    return router


class PrometheusResponse(PlainTextResponse):
    """The Prometheus text format (its media type names the format's version)."""

    media_type = CONTENT_TYPE


def _user_router(master: JobMaster) -> APIRouter:
    """What a user or a tool calls: scale, status, timeline, health, metrics, and the dashboard
    (a browser's page: see GuardMiddleware for how it authenticates)."""
    router = APIRouter(tags=["job"])
    metrics_registry = job_registry(master)
    page, page_headers = dashboard_page()

    @router.post("/v1/scale", responses={400: {}})
    async def scale(req: ScaleRequest) -> dict[str, int]:
        """Set the target number of workers (within the job's MIN:MAX), or hand it back to the
        planner with ``auto``; or set the number of parameter servers (``ps``, within the job's
        ``--ps MIN:MAX``)."""
        if req.auto:
            return {"target_workers": master.scale_auto()}
        if req.ps is not None:
            return {"target_ps": master.scale_ps(req.ps)}
        if req.data_workers is not None:
            return {"target_data_workers": master.scale_data(req.data_workers)}
        assert req.workers is not None  # the model requires one of them
        return {"target_workers": master.scale(req.workers)}

    @router.post("/v1/stop", responses={400: {}})
    async def stop() -> dict[str, str]:
        """End a stream job: its workers finish at the next step boundary, what they trained
        committed (400 for a dataset job, which ends when its data are trained)."""
        return {"stream_stop": master.stop()}

    @router.get("/v1/status", response_model=StatusResponse)
    async def status() -> StatusResponse:
        return master.status()

    @router.get("/v1/timeline", response_model=TimelineResponse)
    async def timeline() -> TimelineResponse:
        """Throughput, workers and target over time, pauses, the planner's decisions and each
        worker's step-time split: what the dashboard draws."""
        return master.timeline()

    @router.get(DASHBOARD_PATH, response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        """The job's dashboard: one static page that polls /v1/status and /v1/timeline."""
        return HTMLResponse(page, headers=page_headers)

    @router.get("/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"state": master.state.value}

    # async: the scrape reads the master's state on its event loop, between two handlers
    @router.get("/metrics", response_class=PrometheusResponse)
    async def metrics() -> PrometheusResponse:
        """The job's metrics in the Prometheus text format (see tidal.master.metrics)."""
        return PrometheusResponse(render(metrics_registry))

    return router


def dashboard_page() -> tuple[str, dict[str, str]]:
    """The dashboard's HTML (package data, read once) and the headers it is served with.

    The page is static: nothing of the job goes into it on the server (its script fetches the
    JSON and writes it as text). The content security policy allows its own inline scripts
    (by hash) and styles, fetches to the same origin, and nothing else: no other site, no frames.
    """
    page = importlib.resources.files("tidal.master").joinpath("dashboard.html").read_text(encoding="utf-8")
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"
        for body in re.findall(r"<script>(.*?)</script>", page, flags=re.DOTALL)
    ) or "'none'"
    csp = (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
           "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return page, {
        "content-security-policy": csp,
        "cache-control": "no-store",
        "referrer-policy": "no-referrer",
        "x-content-type-options": "nosniff",
    }


def _store_router(master: JobMaster) -> tuple[APIRouter, dict[str, tuple[type[BaseModel], Callable[[Any], BaseModel]]]]:
    """``/v1/store/*``: the rendezvous store of the workers' process groups (tidal.master.store).

    Behind the same guard as every route (token, body size), on the master's own socket: no
    second listener. ``get`` and ``wait`` long-poll up to ``wait_s`` (at most a second) and
    wake when a write lands; the client loops until its own timeout. The others answer at
    once and go by the guard's fast path only (forming a round is a burst of them). None of
    them is in the OpenAPI document yet: tests/test_control_plane.py counts its operations.
    """
    kv = RoundStore(master.spec.job_id)
    changed = ChangeNotifier()
    router = APIRouter(tags=["store"])

    def store() -> RoundStore:
        kv.observe_round(master.round)
        return kv

    def set_(req: StoreSetRequest) -> StoreSetResponse:
        store().set(req.key, _unb64(req.value))
        changed.notify()
        return StoreSetResponse()

    def add(req: StoreAddRequest) -> StoreAddResponse:
        value = store().add(req.key, req.amount)
        changed.notify()
        return StoreAddResponse(value=value)

    def compare_set(req: StoreCompareSetRequest) -> StoreValueResponse:
        value = store().compare_set(req.key, _unb64(req.expected), _unb64(req.desired))
        changed.notify()
        return StoreValueResponse(found=True, value=_b64(value))

    def check(req: StoreKeysRequest) -> StoreKeysResponse:
        return StoreKeysResponse(ready=store().check(req.keys))

    def delete(req: StoreDeleteRequest) -> StoreDeleteResponse:
        return StoreDeleteResponse(deleted=store().delete(req.key))

    def num_keys(req: StoreNumKeysRequest) -> StoreNumKeysResponse:
        return StoreNumKeysResponse(count=store().num_keys(req.prefix))

    async def long_poll(wait_s: float, probe: Callable[[], BaseModel | None]) -> BaseModel | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait_s, MAX_STORE_WAIT_S)
        while True:
            found = probe()
            remaining = deadline - loop.time()
            if found is not None or remaining <= 0:
                return found
            await changed.wait(remaining)

    @router.post("/v1/store/get", response_model=StoreValueResponse, include_in_schema=False)
    async def store_get(req: StoreGetRequest) -> Response:
        """The value at ``key``; waits up to ``wait_s`` for it to be set."""

        def probe() -> StoreValueResponse | None:
            value = store().get(req.key)
            return None if value is None else StoreValueResponse(found=True, value=_b64(value))

        return _json(await long_poll(req.wait_s, probe) or StoreValueResponse(found=False))

    @router.post("/v1/store/wait", response_model=StoreKeysResponse, include_in_schema=False)
    async def store_wait(req: StoreKeysRequest) -> Response:
        """Whether all ``keys`` exist; waits up to ``wait_s`` for them."""

        def probe() -> StoreKeysResponse | None:
            return StoreKeysResponse(ready=True) if store().check(req.keys) else None

        return _json(await long_poll(req.wait_s, probe) or StoreKeysResponse(ready=False))

    fast: dict[str, tuple[type[BaseModel], Callable[[Any], BaseModel]]] = {
        "/v1/store/set": (StoreSetRequest, set_),
        "/v1/store/add": (StoreAddRequest, add),
        "/v1/store/compare_set": (StoreCompareSetRequest, compare_set),
        "/v1/store/check": (StoreKeysRequest, check),
        "/v1/store/delete": (StoreDeleteRequest, delete),
        "/v1/store/num_keys": (StoreNumKeysRequest, num_keys),
    }
    return router, fast


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def _unb64(text: str) -> bytes:
    if len(text) > MAX_STORE_VALUE_CHARS:  # before decoding it
        raise StoreValueTooLargeError(f"store value over {MAX_STORE_VALUE_BYTES} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise StoreValueError(f"store value is not base64: {exc}") from exc
