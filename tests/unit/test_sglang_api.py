"""Every route, request field and response field the project uses exists in SGLang's own source.

The CPU engine stands in for SGLang everywhere tests run, so nothing may
work against it that SGLang would refuse. The installed SGLang (its source,
`pip install --no-deps`, never imported) is read with `ast`:
`srt/entrypoints/http_server.py` and `v1_loads.py` (routes, and the request
class each takes), `srt/managers/io_struct.py` (request classes),
`srt/sampling/sampling_params.py` (`SamplingParams`), and the files that
build responses. What the project sends is recorded for real: the real
`EngineClient` and `RolloutManager` talk HTTP to a recording server.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from transformers import AutoTokenizer

from relax_core.models import tiny
from relax_core.rewards.hub import RewardHub
from relax_core.rollout import client as client_module
from relax_core.rollout import router
from relax_core.rollout.client import EngineClient
from relax_core.rollout.cpu_engine import protocol
from relax_core.rollout.manager import RolloutManager, SamplingConfig
from relax_core.rollout.sglang_server_args import SGLANG_VERSION
from relax_core.rollout.sglang_source import package_dir

REPO = Path(__file__).resolve().parents[2]
# Served by the CPU engine for sglang-router 0.3.2, which asks every worker for it; SGLang 0.5.23's server
# has /v1/loads instead (relax's own drain check reads that one).
FOR_THE_ROUTER_ONLY = {"/get_load"}


def scores_one() -> RewardHub:
    """A scorer that gives every response 1.0."""
    return RewardHub.from_function(lambda response, label, metadata: 1.0)


def sglang(path: str) -> ast.Module:
    root = package_dir()
    assert root is not None, f"install SGLang's source for the tests: pip install --no-deps sglang=={SGLANG_VERSION}"
    return ast.parse((root / path).read_text())


def class_fields(module: ast.Module) -> dict[str, set[str]]:
    """Fields of every class of a module, with those of its bases from the same module."""
    classes = {node.name: node for node in module.body if isinstance(node, ast.ClassDef)}

    def fields(name: str) -> set[str]:
        node = classes[name]
        own = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        return own.union(*(fields(b.id) for b in node.bases if isinstance(b, ast.Name) and b.id in classes))

    return {name: fields(name) for name in classes}


IO = class_fields(sglang("srt/managers/io_struct.py"))
SAMPLING = class_fields(sglang("srt/sampling/sampling_params.py"))["SamplingParams"]


def routes() -> dict[str, tuple[set[str], str | None]]:
    """`path: (methods, request class or None)` of SGLang's HTTP server."""
    out = {}
    for file in ("srt/entrypoints/http_server.py", "srt/entrypoints/v1_loads.py"):
        for fn in sglang(file).body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for dec in fn.decorator_list:
                if _is_route(dec):
                    out[dec.args[0].value] = (_methods(dec), _request_class(fn))
    return out


def _is_route(dec: ast.expr) -> bool:
    """`@app.post("/path")` and the like (a path read from the environment does not count)."""
    return (isinstance(dec, ast.Call) and getattr(dec.func, "attr", None) in ("get", "post", "put", "api_route")
            and bool(dec.args) and isinstance(dec.args[0], ast.Constant))


def _methods(dec: ast.Call) -> set[str]:
    if dec.func.attr != "api_route":
        return {dec.func.attr.upper()}
    return {elt.value for kw in dec.keywords if kw.arg == "methods" for elt in kw.value.elts}


def _request_class(fn: ast.FunctionDef) -> str | None:
    """The io_struct class a handler reads its body into (`obj: X` or `obj: Annotated[X, Body()]`)."""
    for arg in fn.args.args:
        ann = arg.annotation
        if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) == "Annotated":
            ann = ann.slice.elts[0]
        if isinstance(ann, ast.Name) and ann.id in IO:
            return ann.id
    return None


ROUTES = routes()


# ------------------------------------------------------------------ recording server
class Recorder(BaseHTTPRequestHandler):
    calls: list[tuple[str, str, object]] = []
    routing_keys: list[str | None] = []  # each /generate's router routing key header

    def _answer(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        path = urlsplit(self.path).path
        Recorder.calls.append((method, path, body))
        if path == "/generate":
            Recorder.routing_keys.append(self.headers.get(client_module.ROUTING_KEY_HEADER))
        if path == "/generate":
            batch = isinstance(body["input_ids"][0], list) if body.get("input_ids") else False
            item = {"text": "ab", "output_ids": [5], "meta_info": {
                "finish_reason": {"type": "length"}, "weight_version": "3", "prompt_tokens": 4,
                "output_token_logprobs": [[-0.5, 5, None]]}}
            answer = [item] * len(body["input_ids"]) if batch else item
        elif path == "/v1/loads":
            answer = {"loads": [{"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 1}]}
        else:
            answer = {"success": True, "message": "", "weight_version": "3"}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self._answer("GET")

    def do_POST(self):  # noqa: N802
        self._answer("POST")

    def log_message(self, *args):
        pass


@pytest.fixture
def recorder():
    Recorder.calls, Recorder.routing_keys = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# Every public method of EngineClient, called with every optional field it can send.
CALLS = {
    "generate": lambda c: c.generate([1, 2], sampling_params={"max_new_tokens": 2}, rid="r1"),
    "abort_request": lambda c: c.abort_request("r1", abort_all=True),
    "health": lambda c: c.health(),
    "health_generate": lambda c: c.health_generate(),
    "get_model_info": lambda c: c.get_model_info(),
    "get_weight_version": lambda c: c.get_weight_version(),
    "get_loads": lambda c: c.get_loads(),
    "flush_cache": lambda c: c.flush_cache(),
    "pause_generation": lambda c: c.pause_generation(),
    "continue_generation": lambda c: c.continue_generation(),
    "init_weights_update_group": lambda c: c.init_weights_update_group("127.0.0.1", 1234, 1, 3, "g", "nccl"),
    "destroy_weights_update_group": lambda c: c.destroy_weights_update_group("g"),
    "update_weights_from_distributed": lambda c: c.update_weights_from_distributed(
        ["w"], ["bfloat16"], [[2, 2]], "g", flush_cache=True, weight_version="3", abort_all_requests=False),
    "begin_weight_update": lambda c: c.begin_weight_update(),
    "end_weight_update": lambda c: c.end_weight_update(),
    "update_weights_from_tensor": lambda c: c.update_weights_from_tensor(
        ["payload"], load_format="direct", flush_cache=True, weight_version="3", abort_all_requests=False),
    "release_memory_occupation": lambda c: c.release_memory_occupation(["kv_cache"]),
    "resume_memory_occupation": lambda c: c.resume_memory_occupation(["kv_cache"]),
    "update_weight_version": lambda c: c.update_weight_version("4", abort_all_requests=True),
}


def test_every_client_method_is_checked():
    public = {name for name, fn in inspect.getmembers(EngineClient, inspect.iscoroutinefunction)
              if not name.startswith("_") and name != "aclose"}
    assert public == set(CALLS), "add the new method to CALLS"


def test_what_the_client_sends_is_what_sglangs_server_takes(recorder):
    async def call_all():
        async with EngineClient(recorder, api_key="k") as c:
            for call in CALLS.values():
                await call(c)
            await c.pause_generation(mode="in_place")

    asyncio.run(call_all())
    for method, path, body in Recorder.calls:
        assert path in ROUTES, f"{method} {path}: SGLang {SGLANG_VERSION} has no such route"
        methods, request_class = ROUTES[path]
        assert method in methods, f"{method} {path}: SGLang takes {sorted(methods)}"
        if request_class is not None:
            assert isinstance(body, dict), f"{path}: SGLang requires a JSON body ({request_class})"
            assert set(body) <= IO[request_class], f"{path}: {set(body) - IO[request_class]} not in {request_class}"
    generate = next(body for _, path, body in Recorder.calls if path == "/generate")
    assert set(generate["sampling_params"]) <= SAMPLING


def test_the_sampling_parameters_of_a_rollout_are_sglangs(recorder, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny.materialize_tiny_model(tmp_path / "m", alphabet="abcd"))
    sampling = SamplingConfig(n_samples_per_prompt=2, max_new_tokens=2, max_prompt_len=64, top_k=3, seed=1)

    async def rollout():
        async with EngineClient(recorder) as c:
            manager = RolloutManager([c], tokenizer, sampling, scores_one())
            return await manager.generate([{"prompt": "ab", "label": "ab"}], step=0)

    samples = asyncio.run(rollout())
    assert [s.response_ids for s in samples] == [[5], [5]] and samples[0].policy_version == 3
    (body,) = [body for _, path, body in Recorder.calls if path == "/generate"]
    assert set(body) <= IO["GenerateReqInput"]
    assert {key for params in body["sampling_params"] for key in params} <= SAMPLING


def test_behind_a_router_each_sample_is_a_request_naming_its_group(recorder, tmp_path):
    """One request per sample (its own seed), and one routing key per prompt group and step, so the router
    keeps a group on one engine and sends each new group where it fits (relax_core/rollout/router.py)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny.materialize_tiny_model(tmp_path / "m", alphabet="abcd"))
    sampling = SamplingConfig(n_samples_per_prompt=3, max_new_tokens=1, max_prompt_len=64, max_request_batch=1)
    rows = [{"prompt": "ab", "label": "ab"}, {"prompt": "ba", "label": "ba"}]

    async def rollout():
        async with EngineClient(recorder) as c:
            manager = RolloutManager([c], tokenizer, sampling, scores_one())
            return await manager.generate(rows, step=0) + await manager.generate(rows, step=1)

    samples = asyncio.run(rollout())
    bodies = [body for _, path, body in Recorder.calls if path == "/generate"]
    assert len(bodies) == len(samples) == 12 and all(isinstance(b["sampling_params"], dict) for b in bodies)
    groups: dict[str, set] = {}
    for body, key in zip(bodies, Recorder.routing_keys):
        groups.setdefault(key, set()).add(tuple(body["input_ids"]))
    assert len(groups) == 4 and all(len(prompts) == 1 for prompts in groups.values()), groups
    assert sorted(Recorder.routing_keys.count(key) for key in groups) == [3] * 4


def test_without_the_chat_template_the_engine_gets_the_prompts_own_tokens(recorder, tmp_path):
    """`data.apply_chat_template: false`: "ab" reaches the engine as its two tokens, not inside a chat turn."""
    from transformers import AutoTokenizer

    from relax_core.models import tiny
    from relax_core.rollout.manager import RolloutManager, SamplingConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny.materialize_tiny_model(tmp_path / "m", alphabet="abcd"))
    sampling = SamplingConfig(n_samples_per_prompt=1, max_new_tokens=1, max_prompt_len=64, seed=1)
    vocab = tokenizer.get_vocab()

    async def rollout(chat_template):
        async with EngineClient(recorder) as c:
            manager = RolloutManager([c], tokenizer, sampling, scores_one(),
                                     chat_template=chat_template)
            return await manager.generate([{"prompt": "ab", "label": "ab"}], step=0)

    Recorder.calls.clear()
    (raw,) = asyncio.run(rollout(False))
    (templated,) = asyncio.run(rollout(True))
    sent = [body["input_ids"] for _, path, body in Recorder.calls if path == "/generate"]
    assert sent[0] == [vocab["a"], vocab["b"]] == raw.prompt_ids
    assert sent[1] == templated.prompt_ids and len(sent[1]) == 21 and vocab["<|im_start|>"] in sent[1]


def test_the_response_fields_the_client_reads_are_ones_sglang_writes():
    read = _strings_read(ast.parse(Path(client_module.__file__).read_text()))
    written = set().union(*IO.values())
    for file in ("srt/managers/tokenizer_manager.py", "srt/entrypoints/http_server.py",
                 "srt/managers/schedule_batch.py", "srt/entrypoints/v1_loads.py", "srt/utils/weight_versions.py"):
        written |= _strings_written(sglang(file))
    assert read <= written, f"the client reads {read - written}, which SGLang {SGLANG_VERSION} never writes"
    assert {"meta_info", "output_token_logprobs", "finish_reason", "weight_version", "weight_versions"} <= read


def test_relaxs_drain_check_reads_sglangs_load_report():
    source = ast.parse(Path(router.__file__).read_text())
    paths = {n.args[0].value for n in ast.walk(source) if isinstance(n, ast.Call)
             and getattr(n.func, "attr", None) == "get" and n.args and isinstance(n.args[0], ast.Constant)
             and str(n.args[0].value).startswith("/v1/")}
    assert paths == {"/v1/loads"} and "/v1/loads" in ROUTES
    snapshot = class_fields(sglang("srt/managers/load_snapshot.py"))["LoadSnapshot"]
    assert set(router.LOAD_KEYS) <= snapshot


def test_the_cpu_engine_takes_sglangs_requests():
    models = {name: cls for name, cls in inspect.getmembers(protocol, inspect.isclass)
              if cls.__module__ == protocol.__name__ and hasattr(cls, "model_fields")}
    for name, cls in models.items():
        theirs = SAMPLING if name == "SamplingParams" else IO.get(name)
        assert theirs is not None, f"protocol.{name}: SGLang has no class of that name"
        assert set(cls.model_fields) <= theirs, f"protocol.{name}: {set(cls.model_fields) - theirs} not in SGLang's"
    assert set(protocol._UNSUPPORTED_SAMPLING) <= SAMPLING
    assert set(protocol._UNSUPPORTED_REQUEST) <= IO["GenerateReqInput"]


def test_the_cpu_engine_serves_only_sglangs_routes():
    source = ast.parse((REPO / "relax_core/rollout/cpu_engine/server.py").read_text())
    served = {dec.args[0].value: _methods(dec) for node in ast.walk(source)
              if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) for dec in node.decorator_list
              if _is_route(dec)}
    assert "/generate" in served and len(served) > 10
    for path, methods in served.items():
        if path in FOR_THE_ROUTER_ONLY:
            continue
        assert path in ROUTES, f"the CPU engine serves {path}, which SGLang {SGLANG_VERSION} does not"
        assert methods <= ROUTES[path][0], f"{path}: the CPU engine takes {methods}, SGLang {ROUTES[path][0]}"


def _strings_read(module: ast.Module) -> set[str]:
    """Keys a module reads from JSON: `x.get("key")` and `x["key"]`."""
    out = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" and node.args:
            out |= {node.args[0].value} if isinstance(node.args[0], ast.Constant) else set()
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and isinstance(node.ctx, ast.Load):  # `d["key"] = ...` fills the client's own dict
            out.add(node.slice.value)
    return {key for key in out if isinstance(key, str)}


def _strings_written(module: ast.Module) -> set[str]:
    """Keys a module puts into dicts: `{"key": ...}` and `d["key"] = ...`."""
    out = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Dict):
            out |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            out |= {node.slice.value} if isinstance(node.slice, ast.Constant) else set()
    return {key for key in out if isinstance(key, str)}


def test_a_multimodal_rollout_request_holds_sglangs_fields_and_encodings(recorder, tmp_path):
    import base64
    import io

    import numpy as np
    from PIL import Image

    from relax_core.config.data import SyntheticData
    from relax_core.data.media import MediaBounds
    from relax_core.data.prompts import build_prompt_source
    from relax_core.models import multimodal
    from relax_core.rollout.prompt_prep import MediaPrompts

    model_dir = tiny.materialize_tiny_model(tmp_path / "vl", architecture="qwen3_vl", alphabet="'.?ABCDWbcdfghlopw")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = build_prompt_source(SyntheticData(task="colours")).next_batch(1)
    sampling = SamplingConfig(n_samples_per_prompt=1, max_new_tokens=1, max_prompt_len=512, seed=1)
    media = MediaPrompts(str(model_dir), MediaBounds(), None, 512)

    async def rollout():
        async with EngineClient(recorder) as c:
            manager = RolloutManager([c], tokenizer, sampling, scores_one(), media=media)
            return await manager.generate(rows, step=0)

    try:
        (sample,) = asyncio.run(rollout())
    finally:
        media.close()
    (body,) = [body for _, path, body in Recorder.calls if path == "/generate"]
    assert set(body) == {"input_ids", "image_data", "sampling_params", "return_logprob"} <= IO["GenerateReqInput"]
    vocab = tokenizer.get_vocab()
    pads = [i for i, t in enumerate(body["input_ids"]) if t == vocab[multimodal.IMAGE]]
    assert len(pads) == 1 and body["input_ids"][pads[0] - 1] == vocab[multimodal.VISION_START]  # unexpanded
    (uri,) = body["image_data"]
    prefix = "data:image/png;base64,"
    assert uri.startswith(prefix)
    sent = np.asarray(Image.open(io.BytesIO(base64.b64decode(uri[len(prefix):]))))
    original = np.asarray(Image.open(io.BytesIO(rows[0]["media"]["image"][0]["bytes"])).convert("RGB"))
    assert np.array_equal(sent, original)  # the pixels of the data set, losslessly
    grid = sample.multimodal["image_grid_thw"].tolist()
    assert sample.prompt_ids.count(vocab[multimodal.IMAGE]) == grid[0][1] * grid[0][2] // 4  # expanded for training


def test_a_row_whose_media_fail_at_run_time_is_skipped_and_counted(recorder, tmp_path, caplog):
    from relax_core.config.data import SyntheticData
    from relax_core.data.media import MediaBounds
    from relax_core.data.prompts import build_prompt_source
    from relax_core.rollout.prompt_prep import MediaPrompts

    model_dir = tiny.materialize_tiny_model(tmp_path / "vl", architecture="qwen3_vl", alphabet="'.?ABCDWbcdfghlopw")
    rows = build_prompt_source(SyntheticData(task="colours")).next_batch(3)
    rows[1]["media"]["image"] = [{"bytes": b"not an image", "path": "/data/broken.png"}]  # changed since validate
    sampling = SamplingConfig(n_samples_per_prompt=2, max_new_tokens=1, max_prompt_len=512, seed=1)
    media = MediaPrompts(str(model_dir), MediaBounds(), None, 512)

    async def rollout():
        async with EngineClient(recorder) as c:
            manager = RolloutManager([c], AutoTokenizer.from_pretrained(model_dir), sampling,
                                     scores_one(), media=media)
            return await manager.generate(rows, step=0), manager.last_reward_stats

    try:
        with caplog.at_level("WARNING"):
            samples, stats = asyncio.run(rollout())
    finally:
        media.close()
    assert len(samples) == 4 and {s.group_id for s in samples} == {0, 2}  # rows 0 and 2, two samples each
    assert stats["prompts_skipped"] == 1.0
    assert "broken.png" in caplog.text and "row 1" in caplog.text


def test_what_status_reads_of_an_engine_comes_from_sglangs_routes(recorder):
    """`relax status` and the control API show each engine's weight version and load: from /model_info and
    /v1/loads, which SGLang 0.5.23 serves (it has no /get_weight_version or /get_load), and never from /health,
    which SGLang answers with a generation, also while the engine's memory is released."""
    from relax_core.rollout.client import engine_view

    view = asyncio.run(engine_view(recorder, "k"))
    assert view == {"answering": True, "weight_version": "3", "load": {"num_running_reqs": 2, "num_waiting_reqs": 1}}
    paths = {path for _, path, _ in Recorder.calls}
    assert paths == {"/model_info", "/v1/loads"} and paths <= set(ROUTES)
    assert not {"/get_weight_version", "/get_load"} & set(ROUTES)
