"""How long the engine client waits: a generation as long as the engine works on it, a dead engine not at all.

What a user relies on: an 8k-token response queued on a busy engine takes longer than any fixed limit,
and cutting it off fails the step; so `/generate` is not bounded by the client's request timeout (the
control requests are), while an engine that dies mid-request (its process killed) fails the request at
once, and one that is gone refuses it. Real HTTP: a server process that answers `/generate` after a
delay longer than the client's timeout, scaled down from the 600 s that once cut generation off.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from engine_fixtures import HOST, free_port

from relax_core.rollout.client import EngineClient, EngineUnreachable

TIMEOUT_S = 1.0  # the client's request timeout, standing in for the old 600 s
SLOW_S = 3.0  # how long the server takes for any answer: longer than TIMEOUT_S

SERVER = """
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Slow(BaseHTTPRequestHandler):
    def _answer(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        time.sleep({slow})
        item = {{"text": "ab", "output_ids": [5, 6], "meta_info": {{
            "finish_reason": {{"type": "length"}}, "weight_version": "1",
            "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]]}}}}
        data = json.dumps(item).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("{host}", {port}), Slow)
print("ready", flush=True)
server.serve_forever()
"""


@pytest.fixture
def slow_engine():
    """A server process that answers every request after SLOW_S; yields (url, process)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER.format(slow=SLOW_S, host=HOST, port=port)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield f"http://{HOST}:{port}", proc
    finally:
        proc.kill()
        proc.wait()


def test_a_generation_longer_than_the_request_timeout_is_not_cut_off(slow_engine):
    url, _ = slow_engine

    async def ask():
        async with EngineClient(url, timeout=TIMEOUT_S) as client:
            start = time.monotonic()
            out = await client.generate([1, 2], sampling_params={"max_new_tokens": 2})
            took = time.monotonic() - start
            with pytest.raises(EngineUnreachable, match="no answer in time"):  # a control request keeps its limit
                await client.get_model_info()
            return out, took

    out, took = asyncio.run(ask())
    assert out["output_ids"] == [5, 6] and took >= SLOW_S


def test_a_generation_can_still_be_bounded_when_asked(slow_engine):
    url, _ = slow_engine

    async def ask():
        async with EngineClient(url, timeout=30, generate_timeout=TIMEOUT_S) as client:
            await client.generate([1, 2], sampling_params={"max_new_tokens": 2})

    with pytest.raises(EngineUnreachable, match="no answer in time"):
        asyncio.run(ask())


def test_an_engine_killed_mid_generation_fails_the_request_at_once(slow_engine):
    url, proc = slow_engine

    async def ask():
        async with EngineClient(url, timeout=TIMEOUT_S) as client:
            request = asyncio.ensure_future(client.generate([1, 2], sampling_params={"max_new_tokens": 2}))
            await asyncio.sleep(0.5)  # the request is in the server, which now dies
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(EngineUnreachable) as raised:
                await request
            assert raised.value.dropped  # sent, then the connection closed: what the turn batcher sends again
            return time.monotonic() - killed

    assert asyncio.run(ask()) < 1.0


def test_an_engine_that_is_gone_refuses_the_request():
    async def ask():
        async with EngineClient(f"http://{HOST}:{free_port()}", timeout=TIMEOUT_S) as client:
            await client.generate([1, 2], sampling_params={"max_new_tokens": 2})

    with pytest.raises(EngineUnreachable) as raised:
        asyncio.run(ask())
    assert not raised.value.dropped  # never sent
