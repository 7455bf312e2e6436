"""A real sglang-router process in front of real CPU engines (tiny model).

What a user relies on: requests sent to the router's URL are answered and
spread over the engines; the n samples of one prompt stay on one engine
(batched, or as single requests with the group's routing key); an added
engine gets its share of new groups at once, even of prompts the first engine
has already served; removing an engine loses none of its in-flight requests and sends
it nothing afterwards; nobody without the key can use or command the router,
which listens on the given address only; the router never probes an engine's
`/health` once it routes to it (SGLang answers one with a generation, also
while the engine's memory is released).

Which engine served a request is read from the engines themselves: each
engine is started with its own `--weight-version` label, which it stamps on
every response, and each engine's own `finished_requests` counter.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from engine_fixtures import HOST, EngineServer, free_port, tiny_model_dir  # noqa: F401

from relax_core.rewards.hub import RewardHub
from relax_core.rollout.client import EngineClient, EngineError
from relax_core.rollout.router import Router

API_KEY = "router-test-key-7f3a"
NAMES = ("a", "b")
SHORT = {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):  # noqa: F811
    """Two engines, labelled a and b; started together (model loading dominates)."""
    logs = tmp_path_factory.mktemp("engines")
    servers = {
        name: EngineServer(
            tiny_model_dir, logs / f"{name}.log", API_KEY, "--weight-version", name, "--num-threads", "1"
        )
        for name in NAMES
    }
    with ThreadPoolExecutor(len(servers)) as pool:
        try:
            list(pool.map(lambda s: s.start().wait_healthy(), servers.values()))
            yield servers
        finally:
            list(pool.map(EngineServer.stop, servers.values()))


@pytest.fixture
def make_router(tiny_model_dir, tmp_path):  # noqa: F811
    started: list[Router] = []

    def make(*names: str, engines: dict[str, EngineServer]) -> Router:
        router = Router(HOST, free_port(), str(tiny_model_dir), API_KEY, str(tmp_path / "router.log"))
        started.append(router)
        router.start([engines[n].base_url for n in names])
        return router

    yield make
    for router in started:
        router.stop()


def finished(engines: dict[str, EngineServer]) -> dict[str, int]:
    """Each engine's own count of finished requests."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return {
        name: httpx.get(f"{s.base_url}/get_model_info", headers=headers).json()["engine_stats"]["finished_requests"]
        for name, s in engines.items()
    }


def served(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in before}


async def generate_many(url: str, bodies: list[dict]) -> list:
    """Send every body concurrently to `url`; a result per body, or the exception it raised."""
    async with EngineClient(url, api_key=API_KEY, timeout=120) as client:
        return await asyncio.gather(*(client.generate(**b) for b in bodies), return_exceptions=True)


async def generate_keyed(url: str, bodies: list[tuple[dict, str]]) -> list:
    """Send every (body, routing key) concurrently to `url`; a result per body."""
    async with EngineClient(url, api_key=API_KEY, timeout=120) as client:
        return await asyncio.gather(*(client.generate(**b, routing_key=key) for b, key in bodies))


def distinct_prompts(count: int, offset: int = 0) -> list[dict]:
    # Different first tokens, so no two prompts share a prefix.
    return [{"input_ids": [3 + (i + offset) % 40, 9, 14, 22 + i % 7], "sampling_params": SHORT} for i in range(count)]


def labels(results: list) -> list[str]:
    return [r["meta_info"]["weight_version"] for r in results]


def test_requests_through_router_reach_both_engines(engines, make_router):
    router = make_router("a", "b", engines=engines)
    before = finished(engines)
    results = asyncio.run(generate_many(router.url, distinct_prompts(40)))
    counts = served(before, finished(engines))

    assert all(isinstance(r, dict) and len(r["output_ids"]) == 4 for r in results), results
    assert counts["a"] + counts["b"] == 40
    assert counts["a"] > 0 and counts["b"] > 0, counts
    assert collections.Counter(labels(results)) == {n: c for n, c in counts.items() if c}


def test_sampling_seed_passes_through_router(engines, make_router):
    router = make_router("a", "b", engines=engines)
    body = {"input_ids": [5, 6, 7], "sampling_params": {**SHORT, "max_new_tokens": 12, "sampling_seed": 1234}}
    direct = asyncio.run(generate_many(engines["a"].base_url, [body]))[0]
    via_router = asyncio.run(generate_many(router.url, [body, body]))
    assert [r["output_ids"] for r in via_router] == [direct["output_ids"]] * 2


def test_prompt_group_stays_on_one_engine(engines, make_router):
    router = make_router("a", "b", engines=engines)
    prompts = [[4 + g, 8, 12, 16, 20, 24, 28, 32] for g in range(4)]

    # One batched request per group (one shared sampling_params): one engine answers all n.
    before = finished(engines)
    batches = asyncio.run(
        generate_many(router.url, [{"input_ids": [p] * 6, "sampling_params": SHORT} for p in prompts])
    )
    assert [len(set(labels(b))) for b in batches] == [1] * 4, [labels(b) for b in batches]
    assert sum(served(before, finished(engines)).values()) == 24

    # n single requests per group with their own seeds, all in flight together, each naming its
    # group's routing key (what the rollout manager sends): each group stays on one engine.
    singles = [({"input_ids": p, "sampling_params": {**SHORT, "sampling_seed": s}}, f"g{g}")
               for g, p in enumerate(prompts) for s in range(6)]
    results = asyncio.run(generate_keyed(router.url, singles))
    by_group = collections.defaultdict(set)
    for (_, key), label in zip(singles, labels(results)):
        by_group[key].add(label)
    assert [len(v) for v in by_group.values()] == [1] * 4, dict(by_group)


def test_added_engine_receives_requests(engines, make_router):
    router = make_router("a", engines=engines)
    b_url = engines["b"].base_url
    asyncio.run(router.add_engine(b_url))
    assert sorted(asyncio.run(router.engines())) == sorted([engines["a"].base_url, b_url])

    before = finished(engines)
    results = asyncio.run(generate_many(router.url, distinct_prompts(30, offset=7)))
    counts = served(before, finished(engines))
    assert all(isinstance(r, dict) for r in results), results
    assert counts["b"] > 0 and counts["a"] + counts["b"] == 30, counts


def test_an_added_engine_gets_half_the_groups_of_prompts_the_first_has_served(engines, make_router):
    # What a run's later steps send: the same few prompts again (here sharing a chat template), 8 samples
    # each, every group under a new key. The first engine's cache holds every one of them already.
    template = [7, 11, 13, 17, 19, 23, 29, 31, 37, 39, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    prompts = [template + [3 + i, 33] for i in range(16)]
    router = make_router("a", engines=engines)
    asyncio.run(generate_keyed(router.url, [({"input_ids": p, "sampling_params": SHORT}, f"warm{i}")
                                            for i, p in enumerate(prompts)]))
    asyncio.run(router.add_engine(engines["b"].base_url))

    for step in range(2):
        before = finished(engines)
        groups = [({"input_ids": p, "sampling_params": {**SHORT, "sampling_seed": s}}, f"{step}-{i}")
                  for i, p in enumerate(prompts) for s in range(8)]
        results = asyncio.run(generate_keyed(router.url, groups))
        counts = served(before, finished(engines))
        assert counts["a"] + counts["b"] == 128 and 40 <= counts["b"] <= 88, counts
        by_group = collections.defaultdict(set)
        for (_, key), label in zip(groups, labels(results)):
            by_group[key].add(label)
        assert all(len(v) == 1 for v in by_group.values()), dict(by_group)


def test_remove_engine_drains_in_flight_requests(engines, make_router):
    router = make_router("a", "b", engines=engines)
    b_url = engines["b"].base_url
    long = {"max_new_tokens": 160, "temperature": 1.0, "ignore_eos": True}
    bodies = [{"input_ids": [3 + i, 9, 14], "sampling_params": long} for i in range(16)]

    async def scenario():
        before = finished(engines)
        requests = asyncio.ensure_future(generate_many(router.url, bodies))
        await _until_busy(b_url)
        await router.remove_engine(b_url)
        removed_at = time.monotonic()
        b_done_at_removal = served(before, finished(engines))["b"]
        results = await requests
        return before, results, removed_at, b_done_at_removal

    before, results, removed_at, b_done_at_removal = asyncio.run(scenario())

    # Every request, including those on b when it was removed, completed in full.
    assert all(isinstance(r, dict) and len(r["output_ids"]) == 160 for r in results), results
    on_b = labels(results).count("b")
    assert on_b > 0
    # remove_engine returned only after b had finished everything it was given.
    assert b_done_at_removal == on_b == served(before, finished(engines))["b"]
    assert asyncio.run(router.engines()) == [engines["a"].base_url]

    # After removal, nothing more goes to b.
    before = finished(engines)
    results = asyncio.run(generate_many(router.url, distinct_prompts(20, offset=3)))
    assert all(isinstance(r, dict) for r in results), results
    assert served(before, finished(engines)) == {"a": 20, "b": 0}


async def _until_busy(url: str, timeout_s: float = 30) -> None:
    """Wait until the engine at `url` reports a request in flight (SGLang's /get_load)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, headers=headers) as http:
        while time.monotonic() < deadline:
            if (await http.get("/get_load")).json()[0]["num_reqs"] > 0:
                return
            await asyncio.sleep(0.02)
    raise TimeoutError(f"{url} never got a request")


def test_router_requires_its_key_and_binds_only_its_host(engines, make_router):
    router = make_router("a", engines=engines)
    body = {"input_ids": [5, 6, 7], "sampling_params": SHORT}
    for key in (None, "wrong-key"):
        with pytest.raises(EngineError) as refused:
            asyncio.run(_generate_with_key(router.url, key, body))
        assert refused.value.status_code in (401, 403)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        add = httpx.post(f"{router.url}/workers", json={"url": engines["b"].base_url}, headers=headers)
        assert add.status_code in (401, 403)
    assert asyncio.run(router.engines()) == [engines["a"].base_url]
    assert asyncio.run(_generate_with_key(router.url, API_KEY, body))["meta_info"]["weight_version"] == "a"

    # Bound to 127.0.0.1 only: the same ports on 127.0.0.2 (also loopback here) refuse connections.
    for port in (router.port, router.metrics_port):
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.2:{port}/health", timeout=2)
    # The key is not on the command line, which every user of the node can read.
    assert API_KEY not in Path(f"/proc/{router.pid}/cmdline").read_text()


async def _generate_with_key(url: str, key: str | None, body: dict):
    async with EngineClient(url, api_key=key, timeout=60) as client:
        return await client.generate(**body)


def test_every_turn_of_a_multi_turn_trajectory_goes_to_its_prompts_engine(
        engines, make_router, tiny_model_dir, tmp_path):  # noqa: F811
    """Behind the router each turn is a request of its own; the prompt's routing key keeps all turns of all
    its trajectories on one engine, whose prefix cache then holds their growing context."""
    from test_multiturn import ENV

    from relax_core.config.rollout import EnvConfig
    from relax_core.models.tokenizer import load_tokenizer
    from relax_core.rollout.chat_turns import ChatTurns
    from relax_core.rollout.manager import RolloutManager, SamplingConfig
    from relax_core.rollout.multiturn import EnvEpisodes

    seen: dict[str, set] = collections.defaultdict(set)

    class Recorded(EnvEpisodes):
        async def run(self, row, turn):
            async def recorded(ids, max_new_tokens, index):
                out = await turn(ids, max_new_tokens, index)
                seen[row["prompt"]].add(out.weight_version)  # the engine's label
                return out

            return await super().run(row, recorded)

    router = make_router("a", "b", engines=engines)
    (tmp_path / "counter.py").write_text(ENV)
    tokenizer = load_tokenizer(tiny_model_dir)
    episodes = Recorded(EnvConfig(path=str(tmp_path / "counter.py"), name="Counter", max_turns=3,
                                  max_tokens_per_turn=2), ChatTurns(tokenizer), 64, 64)
    sampling = SamplingConfig(n_samples_per_prompt=3, max_new_tokens=64, max_prompt_len=64, max_request_batch=1)
    rows = [{"prompt": p, "label": p, "metadata": {}} for p in ("ab", "ba", "cd", "dc", "ad", "da")]

    async def run():
        manager = RolloutManager([EngineClient(router.url, api_key=API_KEY)], tokenizer, sampling,
                                 RewardHub.from_function(lambda text, label, meta: 0.0), agentic=episodes)
        try:
            return await manager.generate(rows, step=1)
        finally:
            await manager.aclose()

    samples = asyncio.run(run())
    assert len(samples) == 18 and all(s.metadata["turns"] == 3 for s in samples)
    assert {p: len(labels) for p, labels in seen.items()} == {r["prompt"]: 1 for r in rows}, dict(seen)


class ProbedEngine(BaseHTTPRequestHandler):
    """An engine that records every request it gets (path and time) and answers like SGLang's server."""

    seen: list[tuple[float, str]] = []
    failing = 0  # /generate requests still to answer 500

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        ProbedEngine.seen.append((time.monotonic(), self.path.split("?")[0]))
        if self.path.startswith("/generate") and ProbedEngine.failing > 0:
            ProbedEngine.failing -= 1
            self.send_error(500)
            return
        item = {"text": "a", "output_ids": [5], "meta_info": {"finish_reason": {"type": "length"},
                                                              "weight_version": "p"}}
        data = json.dumps(item if self.path.startswith("/generate") else {}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def probed_engine():
    ProbedEngine.seen, ProbedEngine.failing = [], 0
    server = ThreadingHTTPServer((HOST, 0), ProbedEngine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://{HOST}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_router_never_probes_an_engines_health_once_it_routes_to_it(
        probed_engine, tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    """sglang-router checks /health every 60 s unless told not to; here its interval is 1 s, so three
    seconds would hold about three probes, each a one-token generation on SGLang (memory released or not)."""
    router = Router(HOST, free_port(), str(tiny_model_dir), API_KEY, str(tmp_path / "router.log"))
    command = router.command
    monkeypatch.setattr(router, "command", lambda urls: command(urls) + ["--health-check-interval-secs", "1"])
    with router:
        router.start([probed_engine])
        routed = time.monotonic()
        answer = asyncio.run(_generate_with_key(router.url, API_KEY, {"input_ids": [5, 6]}))
        time.sleep(3.5)
    assert answer["meta_info"]["weight_version"] == "p"
    probes = [path for at, path in ProbedEngine.seen if at > routed and path.startswith("/health")]
    assert probes == [], ProbedEngine.seen
    assert "/generate" in [path for _, path in ProbedEngine.seen]


def test_an_engine_that_failed_requests_is_routed_to_as_soon_as_it_answers_again(
        probed_engine, tiny_model_dir, tmp_path):  # noqa: F811
    """An engine that answered 30 requests (the router's own retries among them) with 500 serves the next
    one: the router does not shut it out for a minute ("No available workers (all circuits open or
    unhealthy)", its circuit breaker's answer after 10 failures, while the engine answers /health). Whether
    an engine is gone is Relax's recovery's call (controller/recovery.py), which asks the engine itself."""
    ProbedEngine.failing = 30
    answers = []
    with Router(HOST, free_port(), str(tiny_model_dir), API_KEY, str(tmp_path / "router.log")) as router:
        router.start([probed_engine])
        with httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as http:
            for _ in range(15):
                reply = http.post(f"{router.url}/generate", json={"input_ids": [5, 6]})
                answers.append((reply.status_code, reply.text[:80]))
                if reply.status_code == 200:
                    break
    assert ProbedEngine.failing == 0 and answers[-1][0] == 200, answers
    assert not [a for a in answers if "No available workers" in a[1]], answers
