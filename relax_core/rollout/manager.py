"""The rollout manager: prompts in, scored `Sample`s out.

For each step it encodes the prompts with the chat template, asks the
engines for `n_samples_per_prompt` responses each (all samples of a prompt go
to the same engine, so its prefix cache serves the group), scores every
response with the reward, and returns one `Sample` per response with the
engine's log-probs and weight version. Scoring goes through the reward hub
(relax_core/rewards/hub.py) once per step, for all samples concurrently, each
with its row's own reward (`row["reward"]`, from `data.reward_key`) or the
recipe's; the step's failure counts are left in `last_reward_stats` for the
controller, and too many failures end the run there. Every sample gets its own sampling
seed derived from (run seed, step, index), so a resumed run draws exactly
the samples the uninterrupted run would have drawn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relax_core.data.prompts import encode_prompt
from relax_core.rewards.hub import RewardHub, RewardItem, empty_stats
from relax_core.rollout.client import EngineClient, GenerationAborted, parse_generate_output
from relax_core.rollout.prompt_prep import MediaPrompts, Prompt, Skipped
from relax_core.rollout.types import Sample

log = logging.getLogger(__name__)


@dataclass
class SamplingConfig:
    n_samples_per_prompt: int
    max_new_tokens: int
    max_prompt_len: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_request_batch: int = 64
    seed: int = 0


GROUP_STRIDE = 1_000_000  # group id = step key * GROUP_STRIDE + prompt row: unique over a run


def sample_seed(seed: int, step: int, index: int) -> int:
    """A 31-bit sampling seed unique to (run seed, step, sample index)."""
    return ((seed * 1_000_003 + step) * 100_003 + index) % (2**31 - 1)


class RolloutManager:
    def __init__(self, clients: list[EngineClient], tokenizer, sampling: SamplingConfig,
                 reward_fn: RewardHub | Callable[[str, Any, dict], float], system_prompt: str | None = None,
                 media: MediaPrompts | None = None, chat_template: bool = True):
        """`reward_fn`: a `RewardHub` (worker pool, time limits, per-sample routing), or a plain
        function, which is wrapped in a hub that calls it in-process. `media`: prepares the rows that
        carry images, video or audio (rollout/prompt_prep.py); without it rows are text. `chat_template`:
        `data.apply_chat_template` (false: a text prompt's own tokens)."""
        self.clients, self.tokenizer, self.sampling = clients, tokenizer, sampling
        self.reward_hub = reward_fn if isinstance(reward_fn, RewardHub) else RewardHub.from_function(reward_fn)
        self.system_prompt, self.chat_template = system_prompt, chat_template
        self.media = media
        self.dropped_prompts = 0
        self.last_reward_stats: dict[str, float] = empty_stats()

    async def generate(self, rows: list[dict[str, Any]], step: int) -> list[Sample]:
        """Responses to `rows` (dicts with prompt, label, metadata), scored."""
        prompts = await self._encode(rows)
        per_engine: list[list[Prompt]] = [[] for _ in self.clients]
        for position, prompt in enumerate(prompts):
            per_engine[position % len(self.clients)].append(prompt)
        groups = await asyncio.gather(*(self._on_engine(c, items, step) for c, items in zip(self.clients, per_engine)))
        raise_if_aborted(groups)
        by_row = dict(pair for group in groups for pair in group)
        built: list[tuple[Sample, str, str | None]] = []
        for prompt in prompts:
            row_index = prompt.row_index
            built += self._samples(by_row[row_index], rows[row_index], prompt,
                                   group_id=step * GROUP_STRIDE + row_index)
        await self._score(built)
        self.last_reward_stats["prompts_skipped"] = float(self.dropped_prompts)  # so far in the run
        return [sample for sample, _, _ in built]

    async def _encode(self, rows: list[dict[str, Any]]) -> list[Prompt]:
        """Each row's `Prompt`; rows whose media fail or whose prompt is too long are dropped, counted."""
        with_media = [(i, row) for i, row in enumerate(rows) if row.get("media") and self.media is not None]
        prepared: list[Prompt | Skipped] = await self.media.prepare(with_media) if with_media else []
        for index, row in enumerate(rows):
            if not (row.get("media") and self.media is not None):
                ids = encode_prompt(self.tokenizer, row["prompt"], self.system_prompt, self.chat_template)
                prepared.append(Prompt(index, ids, ids) if len(ids) <= self.sampling.max_prompt_len else
                                Skipped(index, f"its prompt is {len(ids)} tokens "
                                               f"(rollout.max_prompt_len={self.sampling.max_prompt_len})"))
        kept = []
        for item in sorted(prepared, key=lambda p: p.row_index):
            if isinstance(item, Skipped):
                self.dropped_prompts += 1
                log.warning("skipped a prompt (row %d of the step): %s", item.row_index, item.reason)
            else:
                kept.append(item)
        return kept

    async def _on_engine(self, client: EngineClient, items: list[Prompt], step: int):
        """Generate n responses for each prompt in `items` on one engine."""
        n = self.sampling.n_samples_per_prompt
        flat = [(p, p.row_index * n + k) for p in items for k in range(n)]
        size = self.sampling.max_request_batch
        chunks = [flat[i:i + size] for i in range(0, len(flat), size)]
        outputs = await asyncio.gather(*(self._request(client, chunk, step) for chunk in chunks))
        results: dict[int, list] = {}
        for chunk, chunk_out in zip(chunks, outputs):
            for (prompt, _), out in zip(chunk, chunk_out):
                results.setdefault(prompt.row_index, []).append(out)
        return list(results.items())

    async def _request(self, client: EngineClient, chunk: list[tuple[Prompt, int]], step: int):
        s = self.sampling
        params = [{"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                   "top_k": s.top_k, "sampling_seed": sample_seed(s.seed, step, index)} for _, index in chunk]
        if len(chunk) == 1:  # a single request: what a router accepts with per-sample parameters
            prompt = chunk[0][0]
            # The group's key: a router sends all n samples of a prompt to one engine.
            raw = await client.generate(prompt.request_ids, sampling_params=params[0], return_logprob=True,
                                        routing_key=f"{step}-{prompt.row_index}", **prompt.media)
        else:
            media = {name: [p.media.get(name, []) for p, _ in chunk]
                     for name in sorted({name for p, _ in chunk for name in p.media})}
            raw = await client.generate([p.request_ids for p, _ in chunk], sampling_params=params,
                                        return_logprob=True, **media)
        return [parse_generate_output(item) for item in (raw if isinstance(raw, list) else [raw])]

    def _samples(self, responses, row: dict[str, Any], prompt: Prompt,
                 group_id: int) -> list[tuple[Sample, str, str | None]]:
        """Unscored samples of one prompt, each with its decoded response text and its row's reward."""
        metadata = row.get("metadata") or {}
        n = self.sampling.n_samples_per_prompt
        return [(Sample(
            prompt_ids=list(prompt.prompt_ids), response_ids=out.output_ids, rollout_logprobs=out.logprobs,
            group_id=group_id, policy_version=out.policy_version, label=row.get("label"),
            metadata=metadata, finish_reason=out.finish_reason, sample_id=group_id * n + k,
            multimodal=prompt.multimodal,
        ), out.text, row.get("reward")) for k, out in enumerate(responses)]

    async def set_clients(self, clients: list[EngineClient]) -> None:
        """Send later requests to `clients` (the engine set changed between steps); close the old ones."""
        old, self.clients = self.clients, list(clients)
        await asyncio.gather(*(client.aclose() for client in old))

    async def aclose(self) -> None:
        await asyncio.gather(*(client.aclose() for client in self.clients))

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the HTTP clients (in the loop they were used on)."""
        loop.run_until_complete(self.aclose())

    async def _score(self, built: list[tuple[Sample, str, str | None]]) -> None:
        """Set every sample's reward in one concurrent hub call (failures score 0 and are counted)."""
        items = [RewardItem(text, sample.label, sample.metadata, reward) for sample, text, reward in built]
        results = await self.reward_hub.score(items)
        for (sample, _, _), result in zip(built, results):
            sample.reward = result.score
        self.last_reward_stats = dict(self.reward_hub.last_stats)


def raise_if_aborted(groups) -> None:
    """An aborted request (the run is stopping, or an engine failed) makes the whole batch unusable:
    stop before scoring it rather than train on cut-off responses."""
    outs = [out for group in groups for _, responses in group for out in responses]
    aborted = sum(out.finish_reason == "abort" for out in outs)
    if aborted:
        raise GenerationAborted(f"{aborted} of {len(outs)} responses were aborted by the engines")
