"""The CPU engine's health and information endpoints, as SGLang 0.5.23's server answers them.

    /health, /health_generate   one handler, as in SGLang (`http_server.py`, `health_generate`):
                                busy, the engine is healthy once its scheduler makes progress;
                                idle, it generates one greedy token. With its memory released
                                that generation would run SGLang's model on unmapped memory, so
                                here it fails (503) and the probe is logged as the caller's bug.
    /model_info, /get_model_info  SGLang's model description (`/get_model_info` is its deprecated
                                name), where clients read the weight version; plus `engine_stats`,
                                the CPU engine's batching counters (not SGLang's)
    /v1/loads                   SGLang's load report: running and waiting requests per DP rank
    /get_load                   what sglang-router 0.3.2 asks a worker (not in SGLang's server)

Relax reads an engine's weight version and load from `/model_info` and `/v1/loads`
(`rollout/client.py`'s `engine_view`, shown by `relax status` and the control API):
neither runs the model, so they answer also while colocate's engines have released
their memory. tests/unit/test_sglang_api.py holds these shapes to SGLang's source.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timezone
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

log = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT (SGLANG_HEALTH_CHECK_TIMEOUT)
PROGRESS_POLL_S = 0.05
PROBED_RELEASED = ("/health reached an engine whose memory is released: SGLang answers it with a one-token "
                   "generation, which would run the model on released memory. Nothing may probe an engine "
                   "between /release_memory_occupation and /resume_memory_occupation.")


def add_info_routes(app: FastAPI, state, run_generate, json_response) -> None:
    """Register the routes above on `app` for the engine `state` (server.py's `EngineState`);
    `run_generate(state, request)` runs a `GenerateReqInput` to its end."""

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200 if await _healthy(state, run_generate) else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> Response:
        return json_response(model_description(state))

    @app.get("/get_load")
    async def get_load() -> Response:
        return json_response([_load(state)])

    @app.get("/v1/loads")
    async def loads() -> Response:  # SGLang's `include=core` section; the CPU engine has no other
        load = _load(state)
        return json_response({
            "timestamp": datetime.now(timezone.utc).isoformat(), "version": "relax-cpu-engine",
            "accelerator": None, "num_accelerators": 0,
            "loads": [{"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": load["num_reqs"] -
                       load["num_waiting_reqs"], "num_waiting_reqs": load["num_waiting_reqs"],
                       "max_running_requests": state.batcher.max_running}],
        })


def model_description(state) -> dict[str, Any]:
    """SGLang's `/model_info` fields that mean something here, and the batching counters."""
    return {
        "model_path": state.model_path,
        "served_model_name": state.model_path,
        "tokenizer_path": state.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.weight_version,
        "engine_stats": state.batcher.stats_dict(),  # not SGLang's: the CPU engine's batching counters
    }


async def _healthy(state, run_generate) -> bool:
    """SGLang's answer to /health: progress of the work in hand, or one token when there is none."""
    from relax_core.rollout.cpu_engine.protocol import GenerateReqInput

    if state.memory.released:
        log.error(PROBED_RELEASED)
        return False
    batcher = state.batcher
    if batcher.running or batcher.waiting:  # busy: SGLang answers from the outputs of the running batch
        return await _progresses(batcher)
    # A fixed seed: the probe never draws from the server's seed stream (unseeded requests stay reproducible).
    probe = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0,
                                                             "sampling_seed": 0})
    try:
        await asyncio.wait_for(run_generate(state, probe), HEALTH_CHECK_TIMEOUT_S)
    except (asyncio.TimeoutError, RuntimeError):
        return False
    return True


async def _progresses(batcher) -> bool:
    """The scheduler runs a forward pass within SGLang's health time-out."""
    start, deadline = batcher.runner.forward_passes, time.monotonic() + HEALTH_CHECK_TIMEOUT_S
    while time.monotonic() < deadline:
        if batcher.runner.forward_passes != start or not (batcher.running or batcher.waiting):
            return True
        await asyncio.sleep(PROGRESS_POLL_S)
    return False


def _load(state) -> dict[str, int]:
    """SGLang's `/get_load` entry for this engine's one data-parallel rank.

    `num_reqs` counts every request the HTTP layer holds (also those waiting
    for `/continue_generation`); read without the scheduler lock, so it is a
    snapshot, exact whenever it reads 0.
    """
    running = list(state.batcher.running)
    return {
        "dp_rank": 0,
        "num_reqs": state.in_flight,
        "num_waiting_reqs": max(state.in_flight - len(running), 0),
        "num_tokens": sum(len(s.prompt_ids) + len(s.output_ids) for s in running),
    }
