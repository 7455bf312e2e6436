"""Turns of many trajectories, sent to their engine together.

Each trajectory of a multi-turn step asks for its next turn when its
environment has answered, so requests arrive one by one; sent one by one they
cost an HTTP round trip and a scheduling pass each (256 round trips a step in
the agentic quick start). `TurnBatcher` queues the turns asked for in the same
pass of the event loop and sends each engine's queue as one batched
`/generate` (SGLang takes a list of `input_ids` with one set of sampling
parameters each), at most `max_batch` per request. Behind a router
(`max_batch` 1) every turn goes alone, with its routing key.
"""

from __future__ import annotations

import asyncio
from typing import Any

from relax_core.rollout.client import EngineClient, EngineUnreachable, GenerateOutput, parse_generate_output


class TurnBatcher:
    def __init__(self, max_batch: int) -> None:
        self.max_batch = max(1, max_batch)
        self._queues: dict[int, tuple[EngineClient, list]] = {}
        self._sending: set[asyncio.Task] = set()

    async def generate(self, client: EngineClient, ids: list[int], params: dict[str, Any],
                       routing_key: str | None = None) -> GenerateOutput:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        _, queue = self._queues.setdefault(id(client), (client, []))
        queue.append((ids, params, routing_key, future))
        if len(queue) == 1:  # the first of this pass: send what has gathered once the pass ends
            loop.call_soon(self._flush, id(client))
        return await future

    def _flush(self, key: int) -> None:
        client, queue = self._queues.pop(key)
        for start in range(0, len(queue), self.max_batch):
            task = asyncio.ensure_future(self._send(client, queue[start:start + self.max_batch]))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, client: EngineClient, chunk: list) -> None:
        try:
            for attempt in range(2):  # a connection the server closed under the request: once more, same seeds
                try:
                    if len(chunk) == 1:
                        ids, params, key, _ = chunk[0]
                        raw = await client.generate(ids, sampling_params=params, return_logprob=True, routing_key=key)
                    else:
                        raw = await client.generate([c[0] for c in chunk], sampling_params=[c[1] for c in chunk],
                                                    return_logprob=True)
                    break
                except EngineUnreachable as exc:
                    if attempt or not exc.dropped:
                        raise
            results = raw if isinstance(raw, list) else [raw]
            for (_, _, _, future), result in zip(chunk, results):
                if not future.done():
                    future.set_result(parse_generate_output(result))
        except BaseException as exc:  # every turn of the batch fails with it (its engine failed)
            for *_, future in chunk:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
