"""HTTP layer of the CPU engine: SGLang's native endpoints over FastAPI/uvicorn.

Request flow: a handler validates the body (`protocol.py`), turns `/generate`
items into `Sequence`s (`generate.py`) and submits them to the scheduler
thread (`batcher.py`), awaiting one future per item; control endpoints run
their action on the scheduler thread through `Batcher.call`, so they take
effect between two forward passes. Health and information (`/health`,
`/model_info`, `/v1/loads`) are `info.py`'s. Status codes and bodies follow SGLang's
`http_server.py`: errors are `{"error": {"message": ...}}` with 400, control
endpoints answer `{"success": bool, "message": str}`.

Multimodal requests (`media_inputs.py`): a `/generate` with `image_data`,
`video_data` or `audio_data` has its media decoded and its prompt expanded
by the model's processor on a worker thread before it is submitted; a
text-only model or bad media answer 400 naming the field and item.

Pause semantics (SGLang's): while paused, new `/generate` requests wait until
`/continue_generation`; in-flight ones are aborted (mode "abort", the
default), kept as they are (mode "in_place") or taken back to the queue
with their tokens so far, their keys and values freed and computed again
when generation continues (mode "retract": a weight update in between
continues them under the new weights).

Colocate on shared GPUs (`memory.py`, `relax_core.rollout.weight_wire`):
`/release_memory_occupation` and `/resume_memory_occupation` free and
reallocate the weights and KV cache (`--enable-memory-saver`), and
`/update_weights_from_tensor` loads tensors another process handed over by
reference, inside a `/begin_weight_update` ... `/end_weight_update` session.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from relax_core.rollout.cpu_engine.batcher import Batcher, Sequence
from relax_core.rollout.cpu_engine.generate import ModelLimits, build_response, build_sequences, unexpanded_prompts
from relax_core.rollout.cpu_engine.info import add_info_routes
from relax_core.rollout.cpu_engine.media_inputs import MediaPreprocessor
from relax_core.rollout.cpu_engine.memory import MemoryReleased, MemorySaver
from relax_core.rollout.cpu_engine.protocol import (
    AbortReq,
    BeginWeightUpdateReqInput,
    DestroyWeightsUpdateGroupReqInput,
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)
from relax_core.rollout.cpu_engine.weight_loader import WeightLoader, parse_dtype

WEIGHTS_RELEASED = "The weights are released; resume them first: /resume_memory_occupation with tags ['weights']."

try:  # SGLang answers with orjson; fall back to the standard library
    import orjson

    def _dumps(content: Any) -> bytes:
        return orjson.dumps(content)
except ImportError:  # pragma: no cover

    def _dumps(content: Any) -> bytes:
        return json.dumps(content).encode()


def json_response(content: Any, status_code: int = 200) -> Response:
    return Response(_dumps(content), status_code=status_code, media_type="application/json")


def error_response(message: str, status_code: int = 400) -> Response:
    return json_response({"error": {"message": message}}, status_code)


def result_response(success: bool, message: str) -> Response:
    return json_response({"success": success, "message": message}, 200 if success else 400)


@dataclass
class EngineState:
    """Everything the handlers share; built by `__main__` once the model is loaded."""

    model_path: str
    tokenizer: Any
    batcher: Batcher
    limits: ModelLimits
    loader: WeightLoader
    memory: MemorySaver
    media: MediaPreprocessor | None = None  # None: a text-only model
    update_session: bool = False  # between /begin_weight_update and /end_weight_update
    groups: dict[str, Any] = field(default_factory=dict)
    # /generate items accepted and not yet answered (waiting for a resume,
    # queued or decoding): what `/get_load` and `/v1/loads` report, so a router can tell
    # when an engine it stopped routing to has drained.
    in_flight: int = 0
    # Set = not paused. (asyncio.Event binds to the running loop on first use.)
    resumed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.resumed.set()

    @property
    def weight_version(self) -> str:
        """The scheduler's version (`Batcher.set_weight_version` changes it between two forward passes)."""
        return self.batcher.weight_version


def create_app(state: EngineState, api_key: str | None = None) -> FastAPI:
    """The FastAPI app; with `api_key`, every path but /health* needs the bearer token."""
    app = FastAPI(openapi_url=None)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    add_info_routes(app, state, _run_generate, json_response)
    _add_generate_routes(app, state)
    _add_control_routes(app, state)
    _add_weight_routes(app, state)
    _add_tensor_routes(app, state)
    _add_memory_routes(app, state)
    return app


class ApiKeyMiddleware:
    """SGLang's `--api-key`: `Authorization: Bearer KEY` on all but /health*, else 401.

    A plain ASGI middleware (not `BaseHTTPMiddleware`) to keep per-request
    overhead small.
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/health") or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        response = json_response({"error": "Unauthorized"}, 401)
        await response(scope, receive, send)


async def _on_scheduler(state: EngineState, fn) -> Any:
    return await asyncio.wrap_future(state.batcher.call(fn))


def _add_generate_routes(app: FastAPI, state: EngineState) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        try:
            req = GenerateReqInput.model_validate(await request.json())
        except (ValidationError, ValueError) as exc:
            return error_response(str(exc))
        items = _num_items(req)
        state.in_flight += items
        try:
            media = await _prepare_media(state, req, items)
            await state.resumed.wait()
            outputs = await _run_generate(state, req, media)
        except ValueError as exc:
            return error_response(str(exc))
        except MemoryReleased as exc:
            return error_response(str(exc), 503)
        finally:
            state.in_flight -= items
        return json_response(outputs if req.is_batch else outputs[0])


def _num_items(req: GenerateReqInput) -> int:
    prompts = req.text if req.text is not None else req.input_ids
    return len(prompts) if req.is_batch else 1


async def _prepare_media(state: EngineState, req: GenerateReqInput, n: int) -> list | None:
    """Each item's expanded ids and prefill inputs (None: no media), made on the
    preprocessor's thread; None for a request without media."""
    if not req.has_media:
        return None
    if state.media is None:
        raise ValueError(f"The model at {state.model_path} is text-only: it takes no image_data, video_data "
                         "or audio_data.")
    per_item = req.media_per_item(n)
    prompts = unexpanded_prompts(req)

    def prepare() -> list:
        return [state.media.prepare(p, m, f" (item {i} of the batch)" if req.is_batch else "")
                if any(m.values()) else None for i, (p, m) in enumerate(zip(prompts, per_item))]

    return await asyncio.get_running_loop().run_in_executor(state.media.executor, prepare)


async def _run_generate(state: EngineState, req: GenerateReqInput, media: list | None = None) -> list[dict[str, Any]]:
    """Submit every item of `req` and wait for all; no await before submit, so a
    pause that starts later always sees these sequences in the scheduler."""
    state.memory.check_serving()
    loop = asyncio.get_running_loop()
    seqs, params, logprob_flags = build_sequences(req, state.tokenizer, state.batcher, state.limits, media)
    futures = [loop.create_future() for _ in seqs]
    for seq, future in zip(seqs, futures):
        seq.on_done = _resolver(loop, future)
    state.batcher.submit(seqs)
    done: list[Sequence] = await asyncio.gather(*futures)
    return [
        build_response(seq, p, flag, state.tokenizer)
        for seq, p, flag in zip(done, params, logprob_flags)
    ]


def _resolver(loop: asyncio.AbstractEventLoop, future: asyncio.Future):
    def resolve(seq: Sequence) -> None:  # called on the scheduler thread
        loop.call_soon_threadsafe(_set_once, future, seq)

    return resolve


def _set_once(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _add_control_routes(app: FastAPI, state: EngineState) -> None:
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        # No prefix cache to flush; like SGLang, refuse while requests run (or wait, unless paused).
        idle = await _on_scheduler(state, lambda b: b.flushable())
        return Response(
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n",
            status_code=200 if idle else 400,
        )

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        try:
            mode = PauseGenerationReqInput.model_validate_json(await request.body() or b"{}").mode
        except ValidationError as exc:
            return error_response(str(exc))
        state.resumed.clear()
        await _on_scheduler(state, lambda b: _pause(b, mode))
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        await _on_scheduler(state, lambda b: setattr(b, "hold", False))
        state.resumed.set()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/abort_request")
    async def abort_request(obj: AbortReq) -> Response:
        rid = None if obj.abort_all else obj.rid
        if rid is None and not obj.abort_all:
            return error_response("Give a rid or abort_all=true.")
        await _on_scheduler(state, lambda b: b.abort(rid))
        return Response(status_code=200)


def _pause(batcher: Batcher, mode: str) -> None:
    if mode == "abort":
        batcher.abort()
    elif mode == "retract":
        batcher.retract()
    else:
        batcher.hold = True


def _add_weight_routes(app: FastAPI, state: EngineState) -> None:
    @app.post("/init_weights_update_group")
    async def init_weights_update_group(obj: InitWeightsUpdateGroupReqInput) -> Response:
        ok, message = await _init_group(state, obj)
        return result_response(ok, message)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(obj: DestroyWeightsUpdateGroupReqInput) -> Response:
        from relax_core.rollout.weight_group import destroy_weight_update_group

        group = state.groups.pop(obj.group_name, None)
        if group is None:
            return result_response(False, f"No weight update group named {obj.group_name!r}.")
        await asyncio.to_thread(destroy_weight_update_group, group)
        return result_response(True, "Succeeded to destroy custom process group.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(obj: UpdateWeightsFromDistributedReqInput) -> Response:
        ok, message = await _update_weights(state, obj)
        if ok and obj.weight_version is not None:
            message += f" Weight version updated to {obj.weight_version}."
        return result_response(ok, message)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Response:
        body = await request.json()
        if body.get("abort_all_requests"):
            await _on_scheduler(state, lambda b: b.abort())
        new_version = str(body["new_version"])
        await _on_scheduler(state, lambda b: b.set_weight_version(new_version))
        return json_response(
            {
                "success": True,
                "message": f"Weight version updated to {state.weight_version}",
                "new_version": state.weight_version,
            }
        )


async def _init_group(state: EngineState, obj: InitWeightsUpdateGroupReqInput) -> tuple[bool, str]:
    import torch

    from relax_core.rollout.weight_group import init_weight_update_group

    if obj.group_name in state.groups:
        return False, f"A weight update group named {obj.group_name!r} already exists; destroy it first."
    if obj.backend == "nccl" and not torch.cuda.is_available():
        return False, "backend 'nccl' needs CUDA; the CPU engine needs backend='gloo'."
    try:
        group = await asyncio.to_thread(
            init_weight_update_group,
            obj.master_address,
            obj.master_port,
            obj.rank_offset,  # + tp_rank, which is always 0 here
            obj.world_size,
            obj.group_name,
            obj.backend,
        )
    except Exception as exc:  # noqa: BLE001 - reported to the caller like SGLang does
        return False, f"Failed to init custom process group: {exc}"
    state.groups[obj.group_name] = group
    return True, "Succeeded to initialize custom process group."


async def _update_weights(state: EngineState, obj: UpdateWeightsFromDistributedReqInput) -> tuple[bool, str]:
    group = state.groups.get(obj.group_name)
    if group is None:
        return False, f"No weight update group named {obj.group_name!r}; call /init_weights_update_group."
    if not state.update_session:  # as SGLang 0.5.23: every update_weights_from_* inside a session
        return False, ("update_weights_from_distributed must run between begin_weight_update() and "
                       "end_weight_update()")
    if "weights" in state.memory.released:
        return False, WEIGHTS_RELEASED
    try:
        for dtype in obj.dtypes:
            parse_dtype(dtype)
    except ValueError as exc:
        return False, str(exc)
    if obj.abort_all_requests:
        await _on_scheduler(state, lambda b: b.abort())
    try:
        receive = state.loader.receive_flattened if obj.load_format == "flattened_bucket" else state.loader.receive

        def load(batcher: Batcher) -> None:  # the new version from the first token the new weights make
            receive(group, obj.names, obj.dtypes, obj.shapes)
            batcher.set_weight_version(obj.weight_version)

        await _on_scheduler(state, load)
    except Exception as exc:  # noqa: BLE001
        return False, f"Failed to update parameter online: {exc}"
    return True, "Succeeded to update parameter online."


def _add_tensor_routes(app: FastAPI, state: EngineState) -> None:
    @app.post("/begin_weight_update")
    async def begin_weight_update(obj: BeginWeightUpdateReqInput) -> Response:
        if state.update_session:
            return result_response(False, "a weight-update session is already open; call end_weight_update() first")
        state.update_session = True
        return result_response(True, "Success")

    @app.post("/end_weight_update")
    async def end_weight_update() -> Response:
        if not state.update_session:
            return result_response(False, "no weight-update session is open; call begin_weight_update() first")
        state.update_session = False
        return result_response(True, "Success")

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(obj: UpdateWeightsFromTensorReqInput) -> Response:
        ok, message = await _update_from_tensor(state, obj)
        if ok and obj.weight_version is not None:
            message += f" Weight version updated to {obj.weight_version}."
        return result_response(ok, message)


async def _update_from_tensor(state: EngineState, obj: UpdateWeightsFromTensorReqInput) -> tuple[bool, str]:
    """Load this rank's payload (entry 0: one TP rank) on the scheduler thread; SGLang's checks and messages."""
    from relax_core.rollout.weight_wire import deserialize_named_tensors

    if not state.update_session:
        return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
    if "weights" in state.memory.released:
        return False, WEIGHTS_RELEASED
    if obj.abort_all_requests:
        await _on_scheduler(state, lambda b: b.abort())

    def load(batcher: Batcher) -> bool:
        state.loader.load(deserialize_named_tensors(obj.serialized_named_tensors[0]))
        batcher.set_weight_version(obj.weight_version)
        return batcher.flushable()

    try:
        idle = await _on_scheduler(state, load)
    except Exception as exc:  # noqa: BLE001 - reported to the caller like SGLang does
        return False, f"Failed to update parameter online: {exc}"
    if obj.flush_cache and not idle:
        return False, ("Weights were updated, but the cache was not flushed because requests are still running or "
                       "queued. Retract or finish them, then call /flush_cache.")
    return True, "Success"


def _add_memory_routes(app: FastAPI, state: EngineState) -> None:
    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request) -> Response:
        try:
            tags = ReleaseMemoryOccupationReqInput.model_validate_json(await request.body() or b"{}").tag_set
        except ValidationError as exc:
            return error_response(str(exc))
        if problem := state.memory.problem(tags, resume=False):
            return error_response(problem)
        added = tags - state.memory.released
        state.memory.released |= added  # from here on no request is admitted
        try:
            await _on_scheduler(state, lambda b: state.memory.release(b, added))
        except RuntimeError as exc:
            state.memory.released -= added
            return error_response(str(exc))
        return json_response(None)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request) -> Response:
        try:
            tags = ResumeMemoryOccupationReqInput.model_validate_json(await request.body() or b"{}").tag_set
        except ValidationError as exc:
            return error_response(str(exc))
        if problem := state.memory.problem(tags, resume=True):
            return error_response(problem)
        await _on_scheduler(state, lambda b: state.memory.resume(tags))
        state.memory.released -= tags
        return json_response(None)


def load_engine_state(model_path: str, *, dtype: str, max_running: int, seed: int, weight_version: str,
                      trust_remote_code: bool = False, enable_memory_saver: bool = False,
                      video: dict | None = None) -> EngineState:
    """Load model and tokenizer and start the scheduler thread (`video`: how videos are sampled into frames,
    `MediaBounds`' video fields; their defaults where absent)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax_core.models import multimodal

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    text_only = multimodal.family(model_path) == "text"
    if text_only:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=parse_dtype(dtype),
                                                     trust_remote_code=trust_remote_code)
    else:  # Qwen3-VL, or Qwen3-Omni's thinker
        model = multimodal.load_policy(model_path, dtype=str(parse_dtype(dtype)).removeprefix("torch."))
    model.eval().requires_grad_(False)
    text_config = model.config.get_text_config()
    _check_full_attention(text_config)
    batcher = Batcher(
        model,
        tokenizer,
        max_running=max_running,
        seed=seed,
        original_logprob=os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true"),
        media_inputs=None if text_only else multimodal.model_inputs,
        weight_version=weight_version,
    )
    batcher.start()
    limits = ModelLimits(
        context_length=text_config.max_position_embeddings,
        vocab_size=text_config.vocab_size,
        eos_ids=_eos_ids(model, tokenizer),
    )
    memory = MemorySaver(model, enable_memory_saver)
    media = None if text_only else MediaPreprocessor(model_path, video or {})
    return EngineState(model_path, tokenizer, batcher, limits, WeightLoader(model), memory, media)


def _check_full_attention(text_config) -> None:
    kinds = set(getattr(text_config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise SystemExit(f"The CPU engine supports full-attention models only; this one has {sorted(kinds)}.")


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (model.generation_config, model.config):
        value = getattr(source, "eos_token_id", None)
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
