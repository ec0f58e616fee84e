"""The master's HTTP control plane: FastAPI over a JobMaster, bearer token, size limits.

Every route requires ``Authorization: Bearer <job token>`` (401 otherwise, the OpenAPI document
included). Bodies over ``MAX_BODY_BYTES`` get 413 before they are parsed. Domain errors carry
their HTTP status (tidal.master.api); validation errors are FastAPI's 422. Nothing the master
raises on purpose becomes a 500; tests/test_control_plane.py runs schemathesis to keep it so.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from tidal.api import (
    MAX_BODY_BYTES,
    DatasetRequest,
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
    StatusResponse,
    TidalError,
)
from tidal.master.api import MasterError
from tidal.master.job import JobMaster
from tidal.master.shards import ShardConflictError

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


class GuardMiddleware:
    """Bearer token and body-size checks, before routing (plain ASGI, so it also guards /docs)."""

    def __init__(self, app: Any, token: str, max_body: int = MAX_BODY_BYTES,
                 fast_routes: dict[str, tuple[type[BaseModel], Callable[[Any], BaseModel]]] | None = None) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.max_body = max_body
        self.fast_routes = fast_routes or {}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            await _reply(send, 401, "missing or wrong bearer token", [(b"www-authenticate", b"Bearer")])
            return
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
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
                  for e in exc.errors()]
        await _send_json(send, 422, json.dumps({"detail": errors}).encode())
        return
    except MasterError as exc:
        await _reply(send, exc.status, str(exc))
        return
    except ShardConflictError as exc:
        await _reply(send, 409, str(exc))
        return
    except TidalError as exc:
        await _reply(send, 400, str(exc))
        return
    await _send_json(send, 200, result.model_dump_json().encode())


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
        # FastAPI echoes the offending input, which cannot be JSON when it is NaN or Infinity
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
                  for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(MasterError)
    async def _master_error(_: Request, exc: MasterError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    @app.exception_handler(ShardConflictError)
    async def _conflict(_: Request, exc: ShardConflictError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(TidalError)
    async def _tidal_error(_: Request, exc: TidalError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.post("/v1/workers/join", response_model=JoinResponse, responses={404: {}, 410: {}})
    async def join(req: JoinRequest) -> Response:
        """A launched worker registers itself."""
        return _json(master.join(req))

    @app.post("/v1/rendezvous", response_model=RendezvousResponse, responses={404: {}, 409: {}, 410: {}})
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

    @app.post("/v1/report", response_model=ReportResponse, responses={400: {}, 404: {}, 409: {}, 410: {}})
    async def report(req: ReportRequest) -> Response:
        """Heartbeat, progress and the worker's step records."""
        return _json(master.report(req))

    @app.post("/v1/shards/lease", response_model=LeaseResponse, responses={400: {}, 404: {}, 409: {}, 410: {}})
    async def lease(req: LeaseRequest) -> Response:
        """Lease the next TODO shard of an epoch."""
        return _json(master.lease(req))

    @app.post("/v1/dataset", responses={400: {}, 404: {}, 409: {}, 410: {}})
    async def dataset(req: DatasetRequest) -> dict[str, str]:
        """Declare the dataset (logical workers read it in a fixed order instead of leasing)."""
        master.configure_dataset(req)
        return {"status": "ok"}

    @app.post("/v1/finish", responses={404: {}, 410: {}})
    async def finish(req: FinishRequest) -> dict[str, str]:
        """The training loop is done; ``metrics`` (e.g. the final AUC) go into the job summary."""
        master.finish(req)
        return {"state": master.state.value}

    @app.post("/v1/scale", responses={400: {}})
    async def scale(req: ScaleRequest) -> dict[str, int]:
        """Set the target number of workers (within the job's MIN:MAX)."""
        return {"target_workers": master.scale(req.workers)}

    @app.get("/v1/status", response_model=StatusResponse)
    async def status() -> StatusResponse:
        return master.status()

    @app.get("/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"state": master.state.value}

    fast: dict[str, tuple[type[BaseModel], Callable[[Any], BaseModel]]] = {
        "/v1/report": (ReportRequest, master.report),
        "/v1/shards/lease": (LeaseRequest, master.lease),
    }
    return GuardMiddleware(app, token, fast_routes=fast)
