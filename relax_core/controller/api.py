"""The run's control API: a REST server in the driver, for `relax scale-rollout` and `relax status`.

    GET    /v1/status              the run: step, policy version, engines, the scale operation in progress
    GET    /v1/engines             every engine: id, url, node, origin, state, weight version, load
    GET    /v1/engines/{id}
    DELETE /v1/engines/{id}        scale in by that (added) engine
    POST   /v1/scale               {"delta": +N | -N} or {"target": N} or {"url": "http://host:port"},
                                   optional "request_id" (a retried request is carried out once)
    GET    /v1/scale               every scale operation; GET /v1/scale/{id}: one
    DELETE /v1/scale/{id}          cancel a pending operation
    GET    /v1/openapi.json        this API's OpenAPI schema

Who can use it: the server listens on the driver node's cluster-internal
address only (RELAX_NODE_IP: the configured interface on Slurm, loopback on a
local run), on a socket bound before it starts, and answers every request
without `Authorization: Bearer <token>` with 401, the schema included. The
token is the run's `secrets/api_token` (mode 0600, in a folder of mode 0700);
run.json records the URL (`api_url`) and the token's path (`api_token_file`),
which is how programs on the cluster's network find both. The CLI, often on a login
node that cannot reach the driver's node, asks through the run directory instead
(relax_core/run_requests.py): the driver relays each request its own user wrote there to
this API and writes the answer back. Every answer is JSON; an error is
`{"error": message}` with 400 (impossible), 401, 404 or 409 (an operation is
running; a non-pending one cannot be cancelled).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from relax_core.controller.elastic import Elastic
from relax_core.controller.scale_ops import ScaleError

log = logging.getLogger(__name__)
TOKEN_NAME = "api_token"
START_TIMEOUT_S = 30.0
PROBE_TIMEOUT_S = 2.0  # asking an engine for its weight version and load
RELAY_POLL_S = 0.2  # how often the driver looks for requests in the run directory
RELAY_METHODS = ("GET", "POST", "DELETE")


class ScaleRequest(BaseModel):
    """POST /v1/scale: one of `delta`, `target` or `url`; `request_id` makes a retry harmless."""

    model_config = ConfigDict(extra="forbid")
    delta: int | None = None
    target: int | None = None
    url: str | None = None
    request_id: str | None = None


def build_app(elastic: Elastic, token: str, status):
    """The FastAPI app (`status()`: the run's status as a dict)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="Relax run control API", version="1", openapi_url="/v1/openapi.json", docs_url=None,
                  redoc_url=None)
    expected = f"Bearer {token}".encode()

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            what = "a wrong token" if given else "no token"
            return JSONResponse({"error": f"unauthorized ({what}): send 'Authorization: Bearer TOKEN' with the "
                                          "run's secrets/api_token"}, 401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    @app.exception_handler(ScaleError)
    async def refused(_request, exc: ScaleError):
        return JSONResponse({"error": str(exc)}, exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"error": f"invalid request: {problems}"}, 400)

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        return JSONResponse({"error": str(exc.detail)}, exc.status_code)

    @app.get("/v1/status")
    def get_status() -> dict[str, Any]:
        return status() | elastic.snapshot()

    @app.get("/v1/engines")
    async def engines() -> dict[str, Any]:
        listed = elastic.engine_list()
        probed = await asyncio.gather(*(_probe(e.url, elastic.set.spec.api_key) if e.state == "active" else _none()
                                        for e in listed))
        return {"engines": [e.public() | p for e, p in zip(listed, probed)]}

    @app.get("/v1/engines/{engine_id}")
    async def engine(engine_id: str) -> dict[str, Any]:
        found = next((e for e in elastic.engine_list() if e.id == engine_id), None)
        if found is None:
            raise ScaleError(404, f"no engine '{engine_id}' (GET /v1/engines lists them)")
        return found.public() | (await _probe(found.url, elastic.set.spec.api_key) if found.state == "active" else {})

    @app.delete("/v1/engines/{engine_id}")
    def remove_engine(engine_id: str, request_id: str | None = None):
        code, body = elastic.remove_engine(engine_id, request_id)
        return JSONResponse(body, code)

    @app.post("/v1/scale")
    def scale(request: ScaleRequest):
        code, body = elastic.request(request.delta, request.target, request.url, request.request_id)
        return JSONResponse(body, code)

    @app.get("/v1/scale")
    def operations() -> dict[str, Any]:
        return {"operations": [op.public() for op in list(elastic.ops)]}

    @app.get("/v1/scale/{op_id}")
    def operation(op_id: str) -> dict[str, Any]:
        return elastic.op(op_id).public()

    @app.delete("/v1/scale/{op_id}")
    def cancel(op_id: str) -> dict[str, Any]:
        return elastic.cancel(op_id)

    return app


async def _none() -> dict[str, Any]:
    return {}


async def _probe(url: str | None, api_key: str) -> dict[str, Any]:
    """The engine's own view: its weight version and load (None where it does not answer in time), from
    SGLang's /model_info and /v1/loads (rollout/client.py's `engine_view`; never /health)."""
    from relax_core.rollout.client import engine_view

    if not url:
        return {"weight_version": None, "load": None}
    view = await engine_view(url, api_key, PROBE_TIMEOUT_S)
    return {"weight_version": view["weight_version"], "load": view["load"]}


class ControlApi:
    """The API server of one job: a uvicorn server in a thread of the driver, on a socket of its own."""

    def __init__(self, run, elastic: Elastic, host: str, status):
        self.run, self.elastic, self.host, self._status = run, elastic, host, status
        self._server = None
        self._thread: threading.Thread | None = None
        self._relay_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.url: str | None = None

    @classmethod
    def start(cls, run, elastic: Elastic, host: str, status) -> ControlApi:
        api = cls(run, elastic, host, status)
        api._start()
        return api

    def _start(self) -> None:
        import uvicorn

        from relax_core.cluster.ports import listening_socket

        token_file = self.run.write_secret(TOKEN_NAME)
        sock = listening_socket(self.host)
        port = sock.getsockname()[1]
        app = build_app(self.elastic, self.run.secret(TOKEN_NAME), self._status)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="relax-api",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the control API did not start on {self.host}:{port}")
            time.sleep(0.01)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}"
        self._relay_thread = threading.Thread(target=self._relay, name="relax-api-files", daemon=True)
        self._relay_thread.start()
        self.run.update_state(api_url=self.url, api_token_file=str(token_file))
        log.info("control API on %s (token: %s); requests also through %s", self.url, token_file,
                 self.run.path / "control")

    def _relay(self) -> None:
        """Carry out the requests the CLI leaves in the run directory (relax_core/run_requests.py) by asking this API,
        and write each answer back; what this user did not write alone is removed unread."""
        from relax_core.run_requests import control_folder

        folder = control_folder(self.run)
        headers = {"Authorization": f"Bearer {self.run.secret(TOKEN_NAME)}"}
        while not self._stopping.wait(RELAY_POLL_S):
            for request in sorted(folder.glob("*.request.json")):
                try:
                    self._answer(request, headers)
                except OSError:
                    log.exception("control request %s: no answer written", request.name)

    def _answer(self, request, headers: dict[str, str]) -> None:
        import httpx

        from relax_core.run_requests import read_trusted, write_private

        try:
            asked = read_trusted(request)
        except PermissionError as exc:
            log.warning("control request not obeyed: %s", exc)
            asked = None
        request.unlink(missing_ok=True)
        if not asked or asked.get("method") not in RELAY_METHODS or not str(asked.get("path")).startswith("/v1/"):
            return
        try:
            response = httpx.request(asked["method"], f"{self.url}{asked['path']}", json=asked.get("json"),
                                     headers=headers, timeout=60)
            status, body = response.status_code, response.json()
        except (httpx.HTTPError, ValueError) as exc:
            status, body = 500, {"error": f"the control API failed the request: {exc}"}
        answer = request.with_name(request.name.removesuffix(".request.json") + ".answer.json")
        write_private(answer, {"status": status, "body": body})

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.should_exit = True
        for thread in (self._thread, self._relay_thread):
            if thread is not None:
                thread.join(timeout=10)
        self.run.update_state(api_url=None)
