"""The one client for rollout engines: SGLang's native HTTP API, nothing else.

The rollout manager, the router and the weight sync (`relax_core.weights.sync`)
talk to every engine through `EngineClient`: a real SGLang server on a GPU
node, or the CPU engine (`relax_core.rollout.cpu_engine`) on a laptop. Only
request and response shapes that SGLang itself has are used here, so code
tested against the CPU engine runs unchanged on the cluster.

`parse_generate_output` turns one `/generate` result into what a `Sample`
needs (token ids, their log-probs, finish reason, the weight version of each token).

An `EngineClient` holds an `aiohttp.ClientSession`, opened on first use, which
belongs to the event loop it is first used on: use it and `aclose()` it inside
one loop. Why aiohttp and not httpx (which the control-plane calls elsewhere
use): behind a router every sample is a request of its own, so a step has
hundreds of requests in flight on one client, and httpcore's connection pool
(1.0.9) scans every connection for each connection at each request's start and
end (`_assign_requests_to_connections`): cubic in the requests in flight.
Measured on this project's 2-core machine (tests/benchmarks/bench_engine_client.py),
a step of 64 requests in flight costs the client 0.58 s of CPU with httpx
against 0.02 s with aiohttp; one of 256, 3.9 s against 0.08 s.

Every failure below HTTP (no connection, a connection dropped, no answer in
time) is raised as `EngineUnreachable`, whatever the library called it.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# sglang-router's header naming a request's routing key (its `manual` policy: one engine per key).
ROUTING_KEY_HEADER = "x-smg-routing-key"
KEEPALIVE_S = 2.0  # below the engines' keep-alive time-out


class EngineError(RuntimeError):
    """An engine answered with an error status or `success: false`."""

    def __init__(self, url: str, status_code: int, message: str) -> None:
        super().__init__(f"{url} -> {status_code}: {message}")
        self.url = url
        self.status_code = status_code
        self.message = message


class EngineFailed(RuntimeError):
    """An engine cannot be replaced (again): the run ends with this message."""


class EngineUnreachable(ConnectionError):
    """A request to an engine failed below HTTP: it could not connect, the connection dropped, or the
    answer did not come in time. `dropped`: the connection closed under a request that was sent (the
    engine may be well and closed an idle connection as it was reused; sending again is safe where the
    engine samples by seed)."""

    def __init__(self, url: str, cause: BaseException) -> None:
        what = "no answer in time" if isinstance(cause, asyncio.TimeoutError) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"{url}: {what}")
        self.url = url
        self.dropped = isinstance(cause, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)) or (
            isinstance(cause, aiohttp.ClientOSError) and not isinstance(cause, aiohttp.ClientConnectorError))


@dataclass
class Reply:
    """An engine's answer: its status and body (read whole before the connection is handed back)."""

    status_code: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


class GenerationAborted(RuntimeError):
    """Engines ended some of a batch's requests as aborted (`/abort_request`, `/pause_generation`, or an
    engine failing): the batch is incomplete and must not be trained on."""


@dataclass
class GenerateOutput:
    """The parts of one `/generate` result that training needs."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str  # the engine's at the end (the last token's)
    text: str = ""
    prompt_tokens: int = 0
    token_versions: list[int] = field(default_factory=list)  # the version that made each output token

    @property
    def policy_version(self) -> int:
        """The oldest version among the tokens (`Sample.policy_version`: the staleness bound must hold for
        every token); the end's when the engine reported no tokens' versions."""
        return min(self.token_versions, default=version_number(self.weight_version))


def version_number(version: str) -> int:
    """An engine's weight version as an int; 0 for SGLang's "default" (the weights it started with)."""
    return int(version) if version.lstrip("-").isdigit() else 0


def token_versions(meta: dict[str, Any], num_tokens: int) -> list[int]:
    """The version of each of `num_tokens` output tokens, from SGLang's `meta_info["weight_versions"]`
    (spans `{"version", "start", "end"}`, end exclusive: sglang/srt/utils/weight_versions.py); without it
    (an engine that reports none) every token is `weight_version`'s."""
    spans = meta.get("weight_versions")
    if not spans:
        return [version_number(str(meta.get("weight_version", "default")))] * num_tokens
    versions: list[int] = []
    for span in spans:
        if span["start"] != len(versions):
            raise ValueError(f"weight_versions spans are not contiguous from 0: {spans}")
        versions += [version_number(str(span["version"]))] * (span["end"] - span["start"])
    if len(versions) != num_tokens:
        raise ValueError(f"weight_versions spans cover {len(versions)} tokens of {num_tokens}: {spans}")
    return versions


def parse_generate_output(result: dict[str, Any]) -> GenerateOutput:
    """Parse one item of a `/generate` response (SGLang's shape).

    Token ids come from `output_token_logprobs` when present (every SGLang
    version has it with `return_logprob`), else from `output_ids`.
    """
    meta = result.get("meta_info", {})
    token_logprobs = meta.get("output_token_logprobs")
    if token_logprobs is not None:
        output_ids = [int(item[1]) for item in token_logprobs]
        logprobs = [float(item[0]) for item in token_logprobs]
    else:
        output_ids, logprobs = list(result.get("output_ids", [])), []
    reason = meta.get("finish_reason") or {}
    return GenerateOutput(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=reason.get("type", "abort") if isinstance(reason, dict) else str(reason),
        weight_version=str(meta.get("weight_version", "default")),
        text=result.get("text", ""),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        token_versions=token_versions(meta, len(output_ids)),
    )


class EngineClient:
    """Async client of one engine's native API.

    Args:
        base_url: e.g. "http://10.0.0.5:30000".
        api_key: sent as `Authorization: Bearer ...` (SGLang's `--api-key`).
        timeout: seconds per control request (health, info, weight sync, memory, pause); not generation.
        max_connections: concurrent requests to this engine; keep it at least
            the engine's `--max-running-requests` so batching is not starved.
        generate_timeout: seconds one `/generate` may take, waiting for a connection included; None (the
            default): as long as the engine works on it. No fixed bound fits generation: an 8k-token response
            queued behind a full batch on a busy engine takes many minutes, and cutting it off fails the step.
            An engine that dies closes the connection (the request fails at once: connection reset or
            refused), and one that hangs is ended by the health watch (controller/recovery.py), which
            fails the request the same way; either way it is sent again once the engine is replaced.
    """

    def __init__(
        self, base_url: str, api_key: str | None = None, timeout: float = 600.0, max_connections: int = 512,
        generate_timeout: float | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_connections = max_connections
        # Connecting stays bounded: an engine that is gone refuses or drops connections within seconds.
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, 30.0))
        self._generate_timeout = aiohttp.ClientTimeout(total=generate_timeout, sock_connect=min(timeout, 30.0))
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:  # here, not in __init__: a session belongs to the loop it is opened in
            self._session = aiohttp.ClientSession(
                self.base_url, headers=self._headers, timeout=self._timeout,
                # Idle connections are closed here before the server's keep-alive (uvicorn's, SGLang's: 5 s)
                # closes them, so a request is rarely sent on a connection the server is closing.
                connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=KEEPALIVE_S),
            )
        return self._session

    async def aclose(self) -> None:
        """Close the connections; a later request opens new ones."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ---- generation ----

    async def generate(
        self,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        text: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        return_logprob: bool = True,
        rid: str | list[str] | None = None,
        routing_key: str | None = None,
        **extra: Any,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """POST /generate; a batch of prompts gives a list of results. `routing_key`: behind a router,
        requests with the same key go to the same engine (relax_core/rollout/router.py); an engine
        ignores it."""
        body: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        body.update({k: v for k, v in (("input_ids", input_ids), ("text", text), ("rid", rid)) if v is not None})
        body.update(extra)
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key is not None else None
        return await self._post_json("/generate", body, headers=headers, timeout=self._generate_timeout)

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """End request `rid`, or every request the engine holds (`abort_all`); they answer with finish
        reason "abort". `rid` is a string even when unused: SGLang's `AbortReq` types it `str = ""`."""
        await self._request("POST", "/abort_request", json={"rid": rid, "abort_all": abort_all})

    # ---- health and info ----

    async def health(self) -> bool:
        """True when the server answers /health with 200 (no exception when down)."""
        return await self._ok("/health")

    async def health_generate(self) -> bool:
        return await self._ok("/health_generate")

    async def get_model_info(self) -> dict[str, Any]:
        """SGLang's `/model_info` (its `/get_model_info` is deprecated and logs a warning per call)."""
        return (await self._request("GET", "/model_info")).json()

    async def get_weight_version(self) -> str:
        return str((await self.get_model_info())["weight_version"])  # SGLang 0.5.23 has no /get_weight_version

    async def get_loads(self) -> list[dict[str, Any]]:
        """SGLang's `/v1/loads` core section: one entry per data-parallel rank (`num_running_reqs`,
        `num_waiting_reqs`, ...). SGLang 0.5.23 has no `/get_load`."""
        return (await self._request("GET", "/v1/loads", params={"include": "core"})).json()["loads"]

    # ---- scheduling control ----

    async def flush_cache(self) -> bool:
        """False when the engine refused because requests are in flight (SGLang's 400)."""
        return (await self._send("POST", "/flush_cache")).status_code == 200

    async def pause_generation(self, mode: str | None = None) -> dict[str, Any]:
        """Pause; `mode` is "abort" (SGLang's default), "retract" or "in_place". SGLang requires a body,
        empty without a mode."""
        body = {} if mode is None else {"mode": mode}
        return (await self._request("POST", "/pause_generation", json=body)).json()

    async def continue_generation(self) -> dict[str, Any]:
        return (await self._request("POST", "/continue_generation", json={})).json()  # SGLang requires a body

    # ---- weight sync ----

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """Ask the engine to join the weight-update group (blocks until all ranks join)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._post_result("/init_weights_update_group", body)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return await self._post_result("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """Announce one bucket; the engine then receives each tensor by broadcast from rank 0 (`load_format`
        "flattened_bucket": the bucket's bytes as one tensor)."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        return await self._post_result("/update_weights_from_distributed", body)

    async def begin_weight_update(self) -> bool:
        """Open SGLang's weight-update session, which its `update_weights_from_*` calls need; False when
        the engine has no sessions (an SGLang from before them answers 404): nothing to open or end."""
        response = await self._send("POST", "/begin_weight_update", json={})
        if response.status_code == 404:
            return False
        _check_result(self.base_url + "/begin_weight_update", response)
        return True

    async def end_weight_update(self) -> None:
        """Close the session `begin_weight_update` opened (SGLang finalizes the loaded weights here)."""
        _check_result(self.base_url + "/end_weight_update", await self._send("POST", "/end_weight_update", json={}))

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """Load tensors handed over by reference (relax_core/rollout/weight_wire.py), one payload per TP rank."""
        body: dict[str, Any] = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._post_result("/update_weights_from_tensor", body)

    # ---- memory (colocate on shared GPUs; SGLang's --enable-memory-saver) ----

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Give back the memory of `tags` ("weights", "kv_cache", "cuda_graph"; None: all) until resumed;
        the engine must be idle, and serves nothing meanwhile."""
        await self._request("POST", "/release_memory_occupation", json={"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Allocate the memory of `tags` again (None: all). Resumed weights hold no model until the next
        weight update (SGLang keeps no copy unless started with --enable-weights-cpu-backup)."""
        await self._request("POST", "/resume_memory_occupation", json={"tags": tags})

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict[str, Any]:
        body = {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        return await self._post_json("/update_weight_version", body)

    # ---- plumbing ----

    async def _ok(self, path: str) -> bool:
        try:
            return (await self._send("GET", path)).status_code == 200
        except EngineUnreachable:
            return False

    async def _send(self, method: str, path: str, timeout: aiohttp.ClientTimeout | None = None,
                    **kwargs: Any) -> Reply:
        """One request, its body read whole; a failure below HTTP raised as `EngineUnreachable`."""
        try:
            async with self._open().request(method, path, timeout=timeout or self._timeout, **kwargs) as response:
                return Reply(response.status, await response.text())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineUnreachable(self.base_url + path, exc) from exc

    async def _request(self, method: str, path: str, **kwargs: Any) -> Reply:
        response = await self._send(method, path, **kwargs)
        if response.status_code != 200:
            raise EngineError(self.base_url + path, response.status_code, _error_message(response))
        return response

    async def _post_json(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                         **kwargs: Any) -> Any:
        return (await self._request("POST", path, json=body, headers=headers, **kwargs)).json()

    async def _post_result(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        result = await self._post_json(path, body)
        if not result.get("success", False):
            raise EngineError(self.base_url + path, 200, result.get("message", ""))
        return result


async def engine_view(url: str, api_key: str | None, timeout_s: float = 2.0) -> dict[str, Any]:
    """What an engine says about itself now: whether it answers, its weight version and its load
    (None where it does not answer within `timeout_s`). Only `/model_info` and `/v1/loads` are asked,
    never `/health`: SGLang answers that with a generation, also while the engine's memory is released
    (colocate's train phase), and a look at a run must never run its engines' models."""
    view: dict[str, Any] = {"answering": False, "weight_version": None, "load": None}
    async with EngineClient(url, api_key=api_key, timeout=timeout_s) as client:
        info, loads = await asyncio.gather(client.get_model_info(), client.get_loads(), return_exceptions=True)
    if isinstance(info, dict):
        view["answering"], view["weight_version"] = True, str(info.get("weight_version"))
    if isinstance(loads, list):
        view["load"] = {key: sum(int(entry.get(key, 0)) for entry in loads)
                        for key in ("num_running_reqs", "num_waiting_reqs")}
    return view


def _check_result(url: str, response: Reply) -> None:
    """Raise EngineError unless a `{"success", "message"}` answer says success."""
    if response.status_code != 200:
        raise EngineError(url, response.status_code, _error_message(response))
    if not response.json().get("success", False):
        raise EngineError(url, 200, response.json().get("message", ""))


def _error_message(response: Reply) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


def answers_health(url: str | None, api_key: str, timeout_s: float) -> bool:
    """Whether the engine at `url` answers /health with 200 within `timeout_s` (a blocking call, for a
    thread of its own; an `EngineClient` asks from an event loop)."""
    import httpx

    if not url:
        return False
    try:
        response = httpx.get(f"{url}/health", timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"})
    except httpx.HTTPError:
        return False
    return response.status_code == 200
