"""The CPU rollout engine, run as a real HTTP server and driven through `EngineClient`.

What a user relies on: `/generate` returns the asked-for tokens with SGLang's
response shape; the reported log-probs are the model's own (checked against a
plain transformers forward of prompt + output, computed here); concurrent
requests are decoded together; stop conditions, the API key and pause /
continue behave as in SGLang.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch
from engine_fixtures import ENGINE_API_KEY as API_KEY
from engine_fixtures import EngineServer
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax_core.rollout.client import EngineClient, EngineError, parse_generate_output

# `engine` (conftest.py): the session's engine server on `tiny_model_dir`.


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def run(engine: EngineServer, fn, api_key: str | None = API_KEY):
    """Run `fn(client)` in a fresh event loop with a fresh client."""

    async def main():
        async with EngineClient(engine.base_url, api_key=api_key, timeout=120) as client:
            return await fn(client)

    return asyncio.run(main())


def reference_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output_t | prompt, output_<t) from one unpadded forward, temperature 1."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    return [logp[len(prompt) + t - 1, tok].item() for t, tok in enumerate(output)]


def max_logprob_error(model, prompt, result) -> float:
    out = parse_generate_output(result)
    expected = reference_logprobs(model, prompt, out.output_ids)
    return max(abs(a - b) for a, b in zip(out.logprobs, expected))


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23]]


def test_batch_generate_returns_tokens_and_model_logprobs(engine, reference):
    model, _ = reference
    params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    results = run(engine, lambda c: c.generate(PROMPTS, sampling_params=params))

    assert isinstance(results, list) and len(results) == len(PROMPTS)
    for prompt, result in zip(PROMPTS, results):
        meta = result["meta_info"]
        assert len(result["output_ids"]) == 12 and meta["completion_tokens"] == 12
        assert meta["prompt_tokens"] == len(prompt)
        assert meta["finish_reason"]["type"] == "length"
        assert meta["weight_version"] == "default"
        assert [item[1] for item in meta["output_token_logprobs"]] == result["output_ids"]
        assert max_logprob_error(model, prompt, result) < 1e-4


def test_concurrent_requests_are_decoded_together(engine, reference):
    model, _ = reference
    n, new_tokens = 8, 16
    params = {"max_new_tokens": new_tokens, "ignore_eos": True}
    prompts = [[5 + i] * (2 + i) for i in range(n)]  # different lengths: padding is exercised

    async def burst(client: EngineClient):
        before = (await client.get_model_info())["engine_stats"]
        results = await asyncio.gather(*(client.generate(p, sampling_params=params) for p in prompts))
        after = (await client.get_model_info())["engine_stats"]
        return results, after["forward_passes"] - before["forward_passes"]

    results, forwards = run(engine, burst)

    assert all(len(r["output_ids"]) == new_tokens for r in results)
    # One request at a time would take n * new_tokens forward passes.
    assert forwards <= (n * new_tokens) // 2, forwards
    for prompt, result in zip(prompts, results):
        assert max_logprob_error(model, prompt, result) < 1e-4


def test_rows_joining_and_leaving_the_batch_keep_the_model_logprobs(engine, reference):
    # Rows finish at different steps (the batch shrinks), a longer prompt joins
    # while the others decode, and the longest row outgrows the cache's spare
    # columns: each row still gets the log-probs of its own unpadded forward.
    model, _ = reference
    prompts = [[5 + i] * (1 + 3 * i) for i in range(6)]
    lengths = [3, 90, 17, 60, 1, 45]

    def params(n):
        return {"max_new_tokens": n, "ignore_eos": True}

    async def scenario(client: EngineClient):
        first = [asyncio.ensure_future(client.generate(p, sampling_params=params(n))) for p, n in zip(prompts, lengths)]
        await _until_running(client)
        late = await client.generate([30] * 20, sampling_params=params(40))
        return await asyncio.gather(*first), late

    results, late = run(engine, scenario)

    for prompt, n, result in zip(prompts + [[30] * 20], lengths + [40], results + [late]):
        assert len(result["output_ids"]) == n
        assert max_logprob_error(model, prompt, result) < 1e-4


def test_the_samples_of_one_prompt_share_its_prefill_and_keep_the_model_logprobs(engine, reference):
    # A group's n samples are one prompt n times: prefilled once, as SGLang's prefix cache does
    # (`cached_tokens` counts the prompt tokens a row took from another's prefill).
    model, _ = reference
    prompts = [[5, 6, 7, 8]] * 4 + [[9, 10]] * 3 + [[11, 12, 13]]
    params = [{"max_new_tokens": 6, "ignore_eos": True, "sampling_seed": i} for i in range(len(prompts))]
    results = run(engine, lambda c: c.generate(prompts, sampling_params=params))
    assert [r["meta_info"]["cached_tokens"] for r in results] == [0, 4, 4, 4, 0, 2, 2, 0]
    assert len({tuple(r["output_ids"]) for r in results[:4]}) > 1  # each sample draws its own tokens
    for prompt, result in zip(prompts, results):
        assert max_logprob_error(model, prompt, result) < 1e-4


def test_text_input_gives_single_result(engine, reference):
    _, tokenizer = reference
    result = run(engine, lambda c: c.generate(text="hello world", sampling_params={"max_new_tokens": 4}))
    assert isinstance(result, dict)
    assert result["meta_info"]["prompt_tokens"] == len(tokenizer.encode("hello world"))
    assert "output_token_logprobs" in result["meta_info"]


def test_stop_token_ids_and_stop_strings(engine, reference):
    _, tokenizer = reference
    prompt = [5, 6, 7]
    greedy = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    ref = run(engine, lambda c: c.generate(prompt, sampling_params=greedy))["output_ids"]

    stop_token = ref[4]
    cut = ref.index(stop_token) + 1
    by_token = run(engine, lambda c: c.generate(prompt, sampling_params={**greedy, "stop_token_ids": [stop_token]}))
    assert by_token["output_ids"] == ref[:cut]
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}

    stop = tokenizer.decode(ref[6:8])
    cut = next(n for n in range(1, len(ref) + 1) if stop in tokenizer.decode(ref[:n]))
    by_string = run(engine, lambda c: c.generate(prompt, sampling_params={**greedy, "stop": [stop]}))
    assert by_string["output_ids"] == ref[:cut]
    assert by_string["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    full_text = tokenizer.decode(ref[:cut])
    assert by_string["text"] == full_text[: full_text.find(stop)]


def test_sampling_seed_makes_sampling_reproducible(engine):
    def params(seed):
        return {"max_new_tokens": 30, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed}

    async def three(client):
        return await asyncio.gather(*(client.generate([9, 9], sampling_params=params(s)) for s in (7, 7, 8)))

    a, b, c = run(engine, three)
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


def test_api_key_is_required_except_for_health(engine):
    url = engine.base_url
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/get_model_info").status_code == 401
    assert httpx.post(f"{url}/generate", json=body).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(f"{url}/generate", json=body, headers=wrong).status_code == 401
    right = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(f"{url}/generate", json=body, headers=right).status_code == 200
    with pytest.raises(EngineError) as err:
        run(engine, lambda c: c.get_model_info(), api_key=None)
    assert err.value.status_code == 401


def test_server_listens_only_on_the_given_host(engine):
    assert httpx.get(f"{engine.base_url}/health").status_code == 200
    with pytest.raises(httpx.ConnectError):  # another loopback address, same port
        httpx.get(f"http://127.0.0.2:{engine.port}/health", timeout=2)


def test_weight_update_without_group_is_refused(engine):
    with pytest.raises(EngineError) as err:
        run(engine, lambda c: c.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[4, 4]]))
    assert err.value.status_code == 400 and "init_weights_update_group" in err.value.message


def test_unsupported_sampling_params_are_rejected(engine):
    with pytest.raises(EngineError) as err:
        run(engine, lambda c: c.generate([1, 2], sampling_params={"repetition_penalty": 1.3}))
    assert err.value.status_code == 400 and "repetition_penalty" in err.value.message


def test_pause_blocks_new_generation_until_continue(engine):
    params = {"max_new_tokens": 8, "ignore_eos": True}

    async def scenario(client: EngineClient):
        await client.pause_generation()
        task = asyncio.ensure_future(client.generate([3, 4, 5], sampling_params=params))
        await asyncio.sleep(1.0)
        waited = not task.done()
        await client.continue_generation()
        return waited, await asyncio.wait_for(task, 30)

    waited, result = run(engine, scenario)
    assert waited
    assert len(result["output_ids"]) == 8


def test_pause_abort_returns_in_flight_requests(engine):
    params = {"max_new_tokens": 400, "ignore_eos": True}

    async def scenario(client: EngineClient):
        task = asyncio.ensure_future(client.generate([3, 4], sampling_params=params))
        await _until_running(client)
        await client.pause_generation(mode="abort")
        result = await asyncio.wait_for(task, 30)
        await client.continue_generation()
        return result

    result = run(engine, scenario)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(result["output_ids"]) < 400


def test_pause_in_place_keeps_and_resumes_in_flight_requests(engine):
    params = {"max_new_tokens": 200, "ignore_eos": True}

    async def scenario(client: EngineClient):
        task = asyncio.ensure_future(client.generate([3, 4], sampling_params=params))
        await _until_running(client)
        await client.pause_generation(mode="in_place")
        steps = (await client.get_model_info())["engine_stats"]["decode_steps"]
        await asyncio.sleep(0.5)
        frozen = (await client.get_model_info())["engine_stats"]["decode_steps"] == steps
        flushed = await client.flush_cache()  # SGLang refuses while requests are in flight
        await client.continue_generation()
        return frozen, flushed, await asyncio.wait_for(task, 60)

    frozen, flushed, result = run(engine, scenario)
    assert frozen and not flushed
    assert len(result["output_ids"]) == 200
    assert result["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_retract_frees_the_cache_and_continues_each_request_from_its_tokens(engine):
    """SGLang's retract: running requests go back to the queue with their tokens, the cache can be flushed
    (what a weight update in between needs), and on continue each is prefilled again from its prompt and
    tokens. With the same weights and seed it ends as an uninterrupted request does."""
    params = {"max_new_tokens": 120, "ignore_eos": True, "temperature": 1.0, "sampling_seed": 77}

    async def scenario(client: EngineClient):
        plain = await client.generate([3, 4, 5], sampling_params=params, return_logprob=True)
        task = asyncio.ensure_future(client.generate([3, 4, 5], sampling_params=params, return_logprob=True))
        await _until_running(client)
        await client.pause_generation(mode="retract")
        before = (await client.get_model_info())["engine_stats"]
        flushed = await client.flush_cache()  # nothing runs: SGLang's scheduler ignores the paused queue
        await asyncio.sleep(0.3)
        frozen = (await client.get_model_info())["engine_stats"]["decode_steps"] == before["decode_steps"]
        await client.continue_generation()
        retracted = await asyncio.wait_for(task, 60)
        after = (await client.get_model_info())["engine_stats"]
        return plain, retracted, flushed, frozen, after["prefill_passes"] - before["prefill_passes"]

    plain, retracted, flushed, frozen, prefills = run(engine, scenario)
    assert flushed and frozen
    assert prefills == 1  # prefilled again from its prompt and tokens, after continue
    assert retracted["output_ids"] == plain["output_ids"]
    assert len(retracted["output_ids"]) == 120
    ours = [lp for lp, _, _ in retracted["meta_info"]["output_token_logprobs"]]
    theirs = [lp for lp, _, _ in plain["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4


def test_each_output_token_keeps_the_weight_version_that_made_it_as_sglang_reports_it(engine):
    """Weights change twice while a greedy request runs (each time: retract, a new version, continue, as the
    asynchronous modes' sync does). The response's spans end where the request stood at each change, counted
    here from the engine's generated-token counter while it was paused, and its meta_info is what SGLang's own
    functions make of those changes (tests/sglang_real.py, in a child process)."""
    params = {"max_new_tokens": 120, "ignore_eos": True, "temperature": 0}

    async def generated(client: EngineClient) -> int:
        return (await client.get_model_info())["engine_stats"]["generated_tokens"]

    async def scenario(client: EngineClient):
        start_version = await client.get_weight_version()
        plain = await client.generate([3, 4, 5], sampling_params=params)
        before = await generated(client)
        task = asyncio.ensure_future(client.generate([3, 4, 5], sampling_params=params, return_logprob=True))
        counts = []
        for version in ("101", "102"):
            await _until_running(client)
            await client.pause_generation(mode="retract")
            counts.append(await generated(client) - before)  # the request's output tokens so far
            await client.update_weight_version(version)
            await client.continue_generation()
        mixed = await asyncio.wait_for(task, 60)
        await client.update_weight_version(start_version)  # the engine is the session's: leave it as it was
        return start_version, plain["meta_info"], mixed, counts

    start, plain, mixed, (first, second) = run(engine, scenario)
    assert plain["weight_versions"] == [{"version": start, "start": 0, "end": 120}]
    assert plain["weight_version"] == start
    assert 0 < first < second < 120
    meta = mixed["meta_info"]
    assert meta["weight_versions"] == [{"version": start, "start": 0, "end": first},
                                       {"version": "101", "start": first, "end": second},
                                       {"version": "102", "start": second, "end": 120}]
    sglang = _sglang_weight_versions([[start, first], ["101", second]], "102", 120)
    assert {k: meta[k] for k in ("weight_version", "weight_versions")} == sglang
    out = parse_generate_output(mixed)
    assert out.token_versions == [0] * first + [101] * (second - first) + [102] * (120 - second)
    assert out.policy_version == 0 and out.weight_version == "102"


def _sglang_weight_versions(events: list[list], version: str, tokens: int) -> dict:
    """SGLang 0.5.23's meta_info for these weight changes, from its own functions in a child process (importing
    sglang patches transformers for the whole process: tests/sglang_real.py)."""
    import json
    import subprocess
    import sys

    from engine_fixtures import REPO_ROOT

    done = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "sglang_real.py"), "weight-versions",
                           json.dumps([events, version, tokens])], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


async def _until_running(client: EngineClient, timeout: float = 20) -> None:
    start = (await client.get_model_info())["engine_stats"]["decode_steps"]
    deadline = time.monotonic() + timeout
    while (await client.get_model_info())["engine_stats"]["decode_steps"] < start + 3:
        assert time.monotonic() < deadline, "generation did not start"
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------ health and information, as SGLang's
def _stats(engine: EngineServer) -> dict[str, int]:
    return run(engine, lambda c: c.get_model_info())["engine_stats"]


def test_health_is_a_one_token_generation_when_idle_and_the_batchs_progress_when_busy(engine):
    """SGLang answers /health (and /health_generate) by generating one token when it holds no request;
    when it does, the probe adds none and succeeds once the running batch makes progress."""
    before = _stats(engine)
    assert httpx.get(f"{engine.base_url}/health", timeout=30).status_code == 200
    idle = _stats(engine)
    assert idle["forward_passes"] > before["forward_passes"]  # it ran the model

    long = {"max_new_tokens": 150, "temperature": 1.0, "ignore_eos": True}

    async def busy(client):
        request = asyncio.ensure_future(client.generate([5, 6, 7], sampling_params=long))
        await _until_running(client)
        async with httpx.AsyncClient(base_url=engine.base_url, timeout=30) as http:
            status = (await http.get("/health")).status_code
        await request
        return status

    assert run(engine, busy) == 200
    assert _stats(engine)["finished_requests"] == idle["finished_requests"] + 1  # the probe added none


def _sglang_tree(path: str):
    import ast

    from relax_core.rollout.sglang_source import package_dir

    return ast.parse((package_dir() / path).read_text())


def _returned_dict_keys(module, function: str, name: str | None = None) -> set[str]:
    """The constant keys of the dict `function` returns (or assigns to `name`)."""
    import ast

    fn = next(n for n in ast.walk(module) if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef)
              and n.name == function)
    for node in ast.walk(fn):
        value = node.value if isinstance(node, ast.Return) or (
            isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [name]) else None
        if isinstance(value, ast.Dict) and (name is not None or isinstance(node, ast.Return)):
            return {k.value for k in value.keys if isinstance(k, ast.Constant)}
    raise AssertionError(f"{function} builds no dict literal")


def test_model_info_and_loads_have_sglangs_shapes(engine):
    """What status and the control API read (weight version, running and waiting requests) comes from
    routes SGLang 0.5.23 has, in its shapes: /model_info's fields and /v1/loads' report."""
    import ast

    headers = {"Authorization": f"Bearer {API_KEY}"}
    info = httpx.get(f"{engine.base_url}/model_info", headers=headers).json()
    loads = httpx.get(f"{engine.base_url}/v1/loads", params={"include": "core"}, headers=headers).json()
    theirs_info = _returned_dict_keys(_sglang_tree("srt/entrypoints/http_server.py"), "model_info", "result")
    theirs_loads = _returned_dict_keys(_sglang_tree("srt/entrypoints/v1_loads.py"), "get_loads")
    snapshot = next(n for n in _sglang_tree("srt/managers/load_snapshot.py").body
                    if isinstance(n, ast.ClassDef) and n.name == "LoadSnapshot")
    load_fields = {n.target.id for n in snapshot.body if isinstance(n, ast.AnnAssign)}
    assert set(info) - {"engine_stats"} <= theirs_info and "weight_version" in info
    assert set(loads) == theirs_loads
    assert all(set(entry) <= load_fields for entry in loads["loads"])
    assert {"num_running_reqs", "num_waiting_reqs"} <= set(loads["loads"][0])


def test_status_reads_version_and_load_and_never_probes_an_engine_whose_memory_is_released(
        tiny_model_dir, tmp_path):
    """colocate's train phase: the engines' memory is released. /health would run the model there (SGLang's
    one-token generation), so `relax status` and the control API ask /model_info and /v1/loads instead."""
    import json
    import os
    import subprocess
    import sys

    from relax_core.rollout.client import engine_view
    from relax_core.rundir import RunDir

    run_dir = RunDir(tmp_path / "runs" / "r1")
    run_dir.create()
    run_dir.recipe.write_text("name: r1\n")  # what makes a folder a run directory
    run_dir.write_secret("engine_api_key", API_KEY)
    with EngineServer(tiny_model_dir, tmp_path / "engine.log", API_KEY, "--enable-memory-saver",
                      "--weight-version", "7") as server:
        run_dir.update_state(state="running", name="r1", engines=[
            {"id": "e0", "state": "active", "origin": "launch", "url": server.base_url, "pid": server.proc.pid,
             "restarts": 0}])
        run(server, lambda c: c.release_memory_occupation())
        assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 503  # SGLang: a forward pass
        view = asyncio.run(engine_view(server.base_url, API_KEY))
        env = os.environ | {"COLUMNS": "200", "NO_COLOR": "1"}
        shown = subprocess.run([sys.executable, "-m", "relax_cli.main", "status", str(run_dir.path)],
                               capture_output=True, text=True, env=env, timeout=60)
        as_json = subprocess.run([sys.executable, "-m", "relax_cli.main", "status", str(run_dir.path), "--json"],
                                 capture_output=True, text=True, env=env, timeout=60)
        run(server, lambda c: c.resume_memory_occupation())
        log = server.log()
    assert view == {"answering": True, "weight_version": "7", "load": {"num_running_reqs": 0, "num_waiting_reqs": 0}}
    assert shown.returncode == 0, shown.stderr
    line = next(line for line in shown.stdout.splitlines() if line.startswith("engine e0"))
    assert "healthy" in line and "weights v7" in line and "requests 0+0" in line, line
    (engine,) = json.loads(as_json.stdout)["engines"]
    assert (engine["healthy"], engine["weight_version"], engine["load"]["num_running_reqs"]) == (True, "7", 0)
    assert log.count("reached an engine whose memory is released") == 1  # only the probe this test sent
