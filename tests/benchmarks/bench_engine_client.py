"""The rollout's HTTP client: CPU it spends per step when every sample is a request of its own.

Behind a router (`rollout.router: true`) the rollout manager sends each sample
as one `/generate` (relax_core/rollout/router.py says why), so a step puts
`prompts x n_samples_per_prompt` requests in flight on one client at once.
This measures the CPU time the client process spends sending `--requests`
concurrent requests and reading their answers, for:

- `engine_client`: Relax's `EngineClient` (relax_core/rollout/client.py, aiohttp);
- `httpx`: an `httpx.AsyncClient` with the limits `EngineClient` used to set
  (max 512 connections, 2 s keep-alive): the client before this benchmark.

The server is a uvicorn app in another process that answers each request
with an SGLang-shaped result after `--delay-s` (an engine generating), so all
requests are in flight together, as in a step. CPU time is this process's own
(`time.process_time`), the median of `--repeat` rounds on one client (kept, as
the rollout keeps its client from step to step) after one warm-up round. The
last line is one JSON object: per client and request count, cpu_s and wall_s.
Seconds; not part of the test suite:

    python3 tests/benchmarks/bench_engine_client.py [--requests 64 256] [--delay-s 0.05] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time

import httpx

from relax_core.rollout.client import EngineClient

SERVER = """
import asyncio, sys, uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

ANSWER = {{"text": "x" * 16, "meta_info": {{"finish_reason": {{"type": "length"}}, "weight_version": "1",
          "output_token_logprobs": [[-0.1, 5, None]] * 16}}}}

async def generate(request):
    await request.json()
    await asyncio.sleep({delay})
    return JSONResponse(ANSWER)

uvicorn.run(Starlette(routes=[Route("/generate", generate, methods=["POST"])]), host="127.0.0.1", port={port},
            log_level="error", timeout_keep_alive=5)
"""
PROMPT = list(range(64))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def engine_client_rounds(url: str, n: int, rounds: int) -> list[tuple[float, float]]:
    async with EngineClient(url) as client:
        return [await timed(lambda: client.generate(PROMPT, sampling_params={"max_new_tokens": 16}), n)
                for _ in range(rounds)]


async def httpx_rounds(url: str, n: int, rounds: int) -> list[tuple[float, float]]:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512, keepalive_expiry=2.0)
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16}, "return_logprob": True}
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        return [await timed(lambda: client.post("/generate", json=body), n) for _ in range(rounds)]


async def timed(request, n: int) -> tuple[float, float]:
    """One step's worth: `n` requests in flight together; (cpu_s, wall_s)."""
    start_cpu, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(request() for _ in range(n)))
    return time.process_time() - start_cpu, time.perf_counter() - start


def measure(rounds_of, url: str, n: int, repeat: int) -> dict[str, float]:
    """One client for all rounds, as the rollout keeps its client from step to step; the first round
    (connections being opened) is left out."""
    rounds = asyncio.run(rounds_of(url, n, repeat + 1))[1:]
    return {"cpu_s": round(statistics.median(r[0] for r in rounds), 4),
            "wall_s": round(statistics.median(r[1] for r in rounds), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--delay-s", type=float, default=0.05)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER.format(delay=args.delay_s, port=port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        results = {}
        for n in args.requests:
            for name, run in (("engine_client", engine_client_rounds), ("httpx", httpx_rounds)):
                results[f"{name}_{n}"] = figures = measure(run, url, n, args.repeat)
                print(f"{name:14s} {n:5d} requests: client cpu {figures['cpu_s']:.3f} s, "
                      f"wall {figures['wall_s']:.3f} s")
        print(json.dumps(results))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
