"""One `sglang-router` process in front of the rollout engines.

Data flow: the rollout manager sends `/generate` to the router's URL; the
router (the Rust `sglang-router` package, what SGLang clusters use) picks an
engine per request and proxies it. `EngineSet` (relax_core/controller) starts
the router once the first engines are healthy and adds or removes engines at
runtime through the router's worker API (`POST /workers`,
`DELETE /workers/{id}`).

Security, on a shared cluster:
- the router binds only the given host (metrics too, on their own port);
  sglang-router cannot be handed a bound socket, so its ports are picked free
  just before it starts, and picked again when another process took one first;
- the router dies with the process that started it (`lifetime.Child` with
  `die_with_parent`), even when that one is killed with SIGKILL; it runs in a
  session of its own, stopped as a process group;
- one key guards both hops: the router's own `--api-key` makes it answer 401
  to any request without `Authorization: Bearer KEY` (health probes aside),
  and the router sends the same bearer key to the engines (SGLang's and the
  CPU engine's `--api-key`). The key reaches the router process through its
  environment (`ROUTER_KEY_ENV`), never its command line, which other users
  can read in `ps`; `python -m relax_core.rollout.router` is that launcher.

What the router keeps together, and where a new group goes: the `manual`
policy with a routing key. The rollout manager sends each sample as its own
request (each has its own sampling seed, and sglang-router 0.3.2 refuses a
batch with a list of per-item `sampling_params`: HTTP 422) and names its
prompt group in the `x-smg-routing-key` header (`client.ROUTING_KEY_HEADER`). The router sends every
request of a key to the engine it first chose for it, so a group's n samples
share one engine's prefix cache; a key it has not seen goes to the engine
with the fewest requests in flight (`--assignment-mode min_load`), so an
engine added to a running job takes its share of the next groups at once. A
request without a key goes to a random engine. (The `cache_aware` policy,
the router's default, did neither: measured on two CPU engines with 16
prompts the first engine had already served, 6 or 7 of 16 groups per step
were split over both engines and the added one got 18 to 46 of 128
requests; with routing keys no group was split and it got 56 to 80.)

Health: the router's own health checks are off (`--disable-health-check`; slime
starts sglang-router the same way). Its checks GET each engine's `/health`
every 60 s, and SGLang 0.5.23 answers `/health` by generating one token
(`srt/entrypoints/http_server.py`, `health_generate`, which serves both
`/health` and `/health_generate`) even while the engine has released its
weights and KV cache (colocate's train phase): a forward pass on unmapped
memory. Relax's own watch (controller/recovery.py) asks engines for `/health`
only while they generate or receive weights, and replaces those that do not
answer. The router still asks an engine for `/health` once, when it
registers it (start, `add_engine`): an engine that joins holds its memory.

Failures: the router's circuit breaker is off (`--disable-circuit-breaker`).
It counts an engine's failed requests (and each of the router's own retries)
and, past 10 in two minutes, sends that engine nothing for a minute; with one
engine, or all of them, every request is answered 503 "No available workers
(all circuits open or unhealthy)" while the engines answer /health (upstream:
sglang issue 13894, slime issue 1148). Relax's recovery
(controller/recovery.py) decides whether an engine is gone: it asks each engine
and replaces those that do not answer, and a 503 from a router whose engines
all answer would end the run. A failed request is still retried by the router
(on another engine where the routing key allows).

Keep-alive: the engines keep an idle connection open for `ENGINE_KEEP_ALIVE_S`
(SGLang's `SGLANG_TIMEOUT_KEEP_ALIVE`, which the CPU engine reads too; both
default to 5 s), longer than the router keeps idle connections in its pool
(sglang-router's client: 50 to 90 s, depending on the version). With 5 s the
engine closes connections the router still holds, and a request written on one
as it closes fails (a reset) though the engine is well; Relax's own client
closes its idle connections after `client.KEEPALIVE_S`, below 5 s, for the same
reason.

Drained: the router does not report a removed worker's in-flight requests,
so `remove_engine` watches the engine itself: SGLang's `GET /v1/loads`
(running and waiting requests per data-parallel rank, summed) until it reads
0 several times in a row.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from relax_core.cluster.lifetime import Child
from relax_core.cluster.ports import candidate_port, listening_socket

ROUTER_KEY_ENV = "RELAX_ROUTER_API_KEY"
DRAIN_POLL_S = 0.1
# Consecutive idle readings before an engine counts as drained: covers a
# request the router forwarded just before removal that is still on the wire.
DRAIN_IDLE_READINGS = 5
LOAD_KEYS = ("num_running_reqs", "num_waiting_reqs")  # what an engine holds, in SGLang's /v1/loads
BIND_ATTEMPTS = 5  # fresh ports tried when another process took the picked ones first
PORT_TAKEN = "Address already in use"
STOP_GRACE_S = 15.0  # SIGTERM to SIGKILL
TAIL_CHARS = 3000  # of the router's log, in an error


# How long an engine Relax starts keeps an idle connection open (`SGLANG_TIMEOUT_KEEP_ALIVE`): longer than the
# router's pool keeps one (why: the module docstring, Keep-alive).
ENGINE_KEEP_ALIVE_S = 120
KEEP_ALIVE_ENV = "SGLANG_TIMEOUT_KEEP_ALIVE"

# How long the router remembers which engine a key went to after the key's last request: a group's
# samples are all sent within its step; an hour keeps the table small on a long run.
ROUTING_KEY_IDLE_S = 3600


class RouterError(RuntimeError):
    """The router refused a command, died, or did not get ready in time."""


class Router:
    """An sglang-router process in front of the rollout engines (started and stopped by its process group).

    Args:
        host: the only address the router (and its metrics endpoint) binds.
        port: the router's port (default: a free one, picked at start).
        tokenizer_path: a local tokenizer directory; without it the router
            would fetch one from the Hugging Face hub.
        api_key: required from the router's clients and sent to the engines.
        log_path: the router's stdout/stderr.
        metrics_port: Prometheus port on `host` (default: a free one).
        log_level: sglang-router's `--log-level`.
    """

    def __init__(
        self,
        host: str,
        port: int | None,
        tokenizer_path: str,
        api_key: str,
        log_path: str,
        *,
        metrics_port: int | None = None,
        log_level: str = "warn",
    ) -> None:
        if not api_key:
            raise ValueError("the router needs an api_key: it must not accept commands from anyone")
        self.host = host
        self.tokenizer_path, self.log_path, self.log_level = tokenizer_path, log_path, log_level
        self._given_ports = (port, metrics_port)
        self.port, self.metrics_port = port, metrics_port
        self._api_key = api_key
        self._proc: Child | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    # ------------------------------------------------------------ lifecycle
    def command(self, worker_urls: Sequence[str]) -> list[str]:
        """The router's command line (without the key, which travels in the environment)."""
        return [
            sys.executable, "-m", "relax_core.rollout.router",
            "--host", self.host, "--port", str(self.port),
            "--policy", "manual", "--assignment-mode", "min_load", "--max-idle-secs", str(ROUTING_KEY_IDLE_S),
            "--tokenizer-path", self.tokenizer_path,
            "--prometheus-host", self.host, "--prometheus-port", str(self.metrics_port),
            "--log-level", self.log_level,
            "--disable-health-check",  # why: the module docstring (Health)
            "--disable-circuit-breaker",  # why: the module docstring (Failures)
            "--worker-urls", *worker_urls,
        ]  # fmt: skip

    def start(self, worker_urls: list[str], timeout_s: float = 60) -> str:
        """Start the router and wait until it routes to every URL in `worker_urls`; returns its URL."""
        if self._proc is not None and self._proc.poll() is None:
            raise RouterError(f"router already running (pid {self._proc.pid})")
        for attempt in range(1, BIND_ATTEMPTS + 1):
            try:
                self._launch(worker_urls)
                self._wait_for_workers(set(worker_urls), timeout_s)
                return self.url
            except BaseException as exc:
                self.stop()
                if not self._may_retry(exc, attempt):
                    raise
        raise RouterError("unreachable")  # the last attempt re-raised

    def _may_retry(self, exc: BaseException, attempt: int) -> bool:
        """Another process took a port we picked: try fresh ones. A port the caller chose is never replaced,
        so when one of those is the taken one (it cannot be bound now) the error is the caller's at once."""
        if not (isinstance(exc, RouterError) and PORT_TAKEN in str(exc) and attempt < BIND_ATTEMPTS):
            return False
        return None in self._given_ports and all(self._bindable(port) for port in self._given_ports if port)

    def _bindable(self, port: int) -> bool:
        try:
            listening_socket(self.host, port).close()
        except OSError:
            return False
        return True

    def _launch(self, worker_urls: list[str]) -> None:
        """One start of the router process, on the given ports or freshly picked ones."""
        given_port, given_metrics = self._given_ports
        self.port = given_port or candidate_port(self.host)
        self.metrics_port = given_metrics or candidate_port(self.host)
        env = dict(os.environ, **{ROUTER_KEY_ENV: self._api_key})
        self._proc = Child(self.command(worker_urls), log=self.log_path, env=env, die_with_parent=True)

    def stop(self) -> None:
        """SIGTERM to the router's process group, SIGKILL to what is left after `STOP_GRACE_S` (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.stop(grace_s=STOP_GRACE_S)

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_for_workers(self, expected: set[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, headers=self._headers, timeout=5) as http:
            while time.monotonic() < deadline:
                self._check_alive()
                try:
                    if expected <= _healthy(http.get("/workers")):
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                time.sleep(0.2)
        raise RouterError(f"router not routing to {sorted(expected)} after {timeout_s}s; see {self.log_path}")

    def _check_alive(self) -> None:
        if self._proc is None:
            raise RouterError(f"router not running; see {self.log_path}")
        if self._proc.poll() is not None:
            raise RouterError(f"router exited ({self._proc.returncode}); see {self.log_path}:\n"
                              f"{self._proc.output()[-TAIL_CHARS:]}")

    @property
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"}

    # ------------------------------------------------------------ engines
    async def engines(self) -> list[str]:
        """The worker URLs the router routes to now."""
        async with self._client() as http:
            return [w["url"] for w in await _workers(http)]

    async def add_engine(self, url: str, timeout_s: float = 60) -> None:
        """Route to `url` from now on (the engine is up and has current weights)."""
        async with self._client() as http:
            if any(w["url"] == url for w in await _workers(http)):
                return
            # The router would send its own key anyway; naming it keeps that explicit.
            response = await http.post("/workers", json={"url": url, "api_key": self._api_key})
            _expect(response, (200, 202), f"add {url}")
            await self._until(
                http,
                lambda ws: any(w["url"] == url and _is_healthy(w) for w in ws),
                timeout_s,
                f"{url} to be routed to",
            )

    async def remove_engine(self, url: str, drain_timeout_s: float = 300, drain: bool = True) -> None:
        """Stop routing new requests to `url`, then (`drain`) wait until its in-flight requests finished;
        without `drain` (the engine is gone) only the router forgets it."""
        deadline = time.monotonic() + drain_timeout_s
        async with self._client() as http:
            ids = [w["id"] for w in await _workers(http) if w["url"] == url]
            if not ids:
                raise RouterError(f"{url} is not one of the router's engines")
            for worker_id in ids:
                _expect(await http.delete(f"/workers/{worker_id}"), (200, 202), f"remove {url}")
            await self._until(
                http, lambda ws: all(w["url"] != url for w in ws), drain_timeout_s, f"{url} to leave the router"
            )
        if drain:
            await wait_drained(url, self._api_key, max(deadline - time.monotonic(), 1.0))

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=30)

    async def _until(self, http: httpx.AsyncClient, done, timeout_s: float, what: str) -> None:
        """Poll the router's worker list until `done(workers)`: worker changes are queued jobs there."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            if done(await _workers(http)):
                return
            await asyncio.sleep(0.1)
        raise RouterError(f"timed out after {timeout_s}s waiting for {what}; see {self.log_path}")


async def engine_in_flight(http: httpx.AsyncClient) -> int:
    """Requests an engine holds now: SGLang's `/v1/loads`, summed over data-parallel ranks."""
    response = await http.get("/v1/loads", params={"include": "core"})
    _expect(response, (200,), "loads")
    return sum(int(load.get(key, 0)) for load in response.json()["loads"] for key in LOAD_KEYS)


async def wait_drained(url: str, api_key: str, timeout_s: float) -> None:
    """Wait until the engine at `url` has had no request in flight for `DRAIN_IDLE_READINGS` polls."""
    deadline, idle = time.monotonic() + timeout_s, 0
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=10) as http:
        while idle < DRAIN_IDLE_READINGS:
            if time.monotonic() > deadline:
                raise RouterError(f"{url} still has requests in flight after {timeout_s:.0f}s")
            idle = idle + 1 if await engine_in_flight(http) == 0 else 0
            await asyncio.sleep(DRAIN_POLL_S)


async def _workers(http: httpx.AsyncClient) -> list[dict[str, Any]]:
    response = await http.get("/workers")
    _expect(response, (200,), "list workers")
    return response.json()["workers"]


def _is_healthy(worker: dict[str, Any]) -> bool:
    return bool(worker.get("is_healthy", True))


def _healthy(response: httpx.Response) -> set[str]:
    if response.status_code != 200:
        return set()
    return {w["url"] for w in response.json().get("workers", []) if _is_healthy(w)}


def _expect(response: httpx.Response, ok: tuple[int, ...], what: str) -> None:
    if response.status_code not in ok:
        raise RouterError(f"{what}: {response.request.url} -> {response.status_code}: {response.text[:500]}")


def main(argv: list[str] | None = None) -> None:
    """Launch sglang-router with the key from `$RELAX_ROUTER_API_KEY` (refuses to run without one)."""
    from sglang_router.launch_router import launch_router, parse_router_args

    args = parse_router_args(sys.argv[1:] if argv is None else argv)
    args.api_key = os.environ.pop(ROUTER_KEY_ENV, "") or None
    if args.api_key is None:
        raise SystemExit(f"set {ROUTER_KEY_ENV}: the router must not accept commands from anyone")
    launch_router(args)


if __name__ == "__main__":
    main()
