"""The rollout manager: prompts in, scored `Sample`s out.

For each step it encodes the prompts with the chat template, asks the
engines for `n_samples_per_prompt` responses each (all samples of a prompt go
to the same engine, so its prefix cache serves the group), scores every
response with the reward, and returns one `Sample` per response with the
engine's log-probs and weight version. Scoring goes through the scorer
(rollout/scoring.py's interface: the run's reward hub, relax_core/rewards/hub.py)
once per step, for all samples concurrently, each with its row's own reward
(`row["reward"]`, from `data.reward_key`) or the recipe's; the step's failure
counts are left in `last_reward_stats` for the controller, and too many
failures end the run there.

Every sample gets its own sampling seed derived from (run seed, step, index),
sent as SGLang's `sampling_params.sampling_seed`. What it buys depends on the
engine:
- the CPU engine, and SGLang with `rollout.deterministic` (its
  `--enable-deterministic-inference`): the seed decides the draw, so a resumed
  run draws the samples the uninterrupted run would have drawn, and a request
  sent again after its engine failed (the `recovery`, controller/recovery.py,
  replaced it) draws the same samples;
- SGLang without it: SGLang ignores the seed (it builds a per-request seed
  tensor only in deterministic inference, srt/sampling/sampling_batch_info.py),
  so a resent request is a new draw from the same weights and a resumed run
  draws new samples. Each is still a sample of the current policy.
Either way only one answer per sample is kept: no sample is lost or trained twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from relax_core.data.prompts import encode_prompt
from relax_core.data.sample import Sample, group_order, mixed_versions
from relax_core.rollout.client import (
    EngineClient,
    EngineError,
    EngineUnreachable,
    GenerationAborted,
    parse_generate_output,
)
from relax_core.rollout.prompt_prep import MediaPrompts, Prompt, Skipped
from relax_core.rollout.scoring import RewardItem, Scorer, empty_stats
from relax_core.rollout.turn_batch import TurnBatcher

log = logging.getLogger(__name__)
GroupSink = Callable[[list[Sample]], Awaitable[None]]  # takes one prompt's scored samples (`generate`'s on_group)


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
    max_concurrency: int = 64  # multi-turn: trajectories in flight per engine client


MAX_RECOVERIES = 3  # engine replacements within one generation round before the step fails
GROUP_STRIDE = 1_000_000  # group id = step key * GROUP_STRIDE + prompt row: unique over a run
TURN_STRIDE = 1_000  # multi-turn: turn t of sample i samples with the seed of index i * TURN_STRIDE + t
SEGMENT_STRIDE = 64  # agent programs: segment j of trajectory i has sample id i * SEGMENT_STRIDE + j


def sample_seed(seed: int, step: int, index: int) -> int:
    """A 31-bit sampling seed unique to (run seed, step, sample index)."""
    return ((seed * 1_000_003 + step) * 100_003 + index) % (2**31 - 1)


class RolloutManager:
    def __init__(self, clients: list[EngineClient], tokenizer, sampling: SamplingConfig,
                 scorer: Scorer, system_prompt: str | None = None,
                 media: MediaPrompts | None = None, chat_template: bool = True, recovery=None, agentic=None):
        """`scorer`: scores the responses (rollout/scoring.py's interface): the run's `RewardHub` (worker
        pool, time limits, per-sample routing; `RewardHub.from_function` wraps a plain function).
        `media`: prepares the rows that carry images, video or audio (rollout/prompt_prep.py); without it
        rows are text. `chat_template`:
        `data.apply_chat_template` (false: a text prompt's own tokens). `recovery`: replaces engines that die or
        hang during a step (controller/recovery.py's `EngineRecovery`: `check_every_s`, `check()`,
        `recover(error)` -> the new clients); None: an engine's failure ends the step with its error.
        `agentic`: multi-turn trajectories instead of one response per sample (`rollout.env`: multiturn.py's
        `EnvEpisodes`, `rollout.agent`: agent_app.py's `AgentPrograms`): `await agentic.run(row, turn)` gives
        a prompt's trajectory (or several segments of one), `turn(ids, max_new_tokens, index)` generating on
        the trajectory's engine."""
        self.clients, self.tokenizer, self.sampling = clients, tokenizer, sampling
        self.reward_hub = scorer
        self.system_prompt, self.chat_template = system_prompt, chat_template
        self.media = media
        self.dropped_prompts = 0
        self.resent = 0  # samples sent again after their engine was replaced (so far in the run)
        self.recovery = recovery
        self.last_reward_stats: dict[str, float] = empty_stats()
        self.agentic = agentic

    async def generate(self, rows: list[dict[str, Any]], step: int, on_group: GroupSink | None = None) -> list[Sample]:
        """Responses to `rows` (dicts with prompt, label, metadata), scored, in the rows' order.

        `on_group`: called with each prompt's scored samples as soon as they are (a stream: the asynchronous
        modes put each group into TransferQueue at once): each prompt gets its own requests, so a group
        finishes with its own slowest sample, not the step's. Multi-turn trajectories are handed over once the
        step's are all done (a failed engine runs them again from their start, multiturn.py)."""
        if self.agentic is not None:
            samples = await self._generate_trajectories(rows, step)
            if on_group is not None:
                for group in group_order(samples):
                    await on_group(group)
            return samples
        prompts = await self._encode(rows)
        scored: dict[int, list[Sample]] = {}
        self.last_reward_stats = empty_stats()

        async def done(prompt: Prompt, responses: list) -> None:
            raise_if_aborted(responses)
            built = self._samples(responses, rows[prompt.row_index], prompt,
                                  group_id=step * GROUP_STRIDE + prompt.row_index)
            await self._score(built)
            scored[prompt.row_index] = [sample for sample, _, _ in built]
            if on_group is not None:
                await on_group(scored[prompt.row_index])

        await self._generate(prompts, step, done, per_group=on_group is not None)
        self.last_reward_stats["prompts_skipped"] = float(self.dropped_prompts)  # so far in the run
        self.last_reward_stats["samples_resent"] = float(self.resent)  # so far in the run
        return [sample for prompt in prompts for sample in scored[prompt.row_index]]

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

    async def _generate(self, prompts: list[Prompt], step: int, done: Callable[[Prompt, list], Awaitable[None]],
                        per_group: bool = False) -> None:
        """Every sample's output: `done(prompt, outputs)` once all n outputs of a prompt are in. The prompts go
        round-robin to the clients (all n samples of a prompt to one), in requests of at most
        `max_request_batch` samples (`per_group`: none holds two prompts' samples, so each prompt is done when
        its own samples are). A request an engine fails (it died, or hung and was ended by the watch) is sent
        again once the recovery replaced the engine (the same draw where the engine samples by the seed, see
        the module docstring), and only its one answer is kept."""
        n, size = self.sampling.n_samples_per_prompt, self.sampling.max_request_batch
        per_engine: list[list[list[tuple[Prompt, int]]]] = [[] for _ in self.clients]
        for position, prompt in enumerate(prompts):
            samples = [(prompt, prompt.row_index * n + k) for k in range(n)]
            queue = per_engine[position % len(self.clients)]
            if per_group or not queue:
                queue.append(samples)
            else:
                queue[-1] += samples
        todo = [(client, flat[i:i + size]) for client, queue in zip(self.clients, per_engine) for flat in queue
                for i in range(0, len(flat), size)]
        outputs: dict[int, Any] = {}
        finished: set[int] = set()  # row indexes handed to `done`
        for _ in range(MAX_RECOVERIES + 1):
            failed: list[tuple[list[tuple[Prompt, int]], Exception]] = []

            async def send(client: EngineClient, chunk: list[tuple[Prompt, int]], failed=failed) -> None:
                try:
                    answers = await self._request(client, chunk, step)
                except (EngineUnreachable, EngineError) as exc:
                    failed.append((chunk, exc))
                    return
                outputs.update((index, out) for (_, index), out in zip(chunk, answers))
                completed = {prompt.row_index: prompt for prompt, _ in chunk}  # the prompts this request touched
                for row_index, prompt in completed.items():
                    indexes = [row_index * n + k for k in range(n)]
                    if all(i in outputs for i in indexes) and row_index not in finished:
                        finished.add(row_index)
                        await done(prompt, [outputs[i] for i in indexes])

            await self._watched(asyncio.gather(*(send(client, chunk) for client, chunk in todo)))
            if not failed:
                return
            if self.recovery is None:
                raise failed[0][1]
            # Nothing is in flight now: a safe point to replace engines (controller/recovery.py).
            await self.replace_engines(failed[0][1])
            chunks = [chunk for chunk, _ in failed]
            self.resent += sum(len(chunk) for chunk in chunks)
            log.warning("sending %d sample(s) again after an engine was replaced",
                        sum(len(chunk) for chunk in chunks))
            todo = [(self.clients[i % len(self.clients)], chunk) for i, chunk in enumerate(chunks)]
        raise RuntimeError(f"the engines failed {MAX_RECOVERIES + 1} times in one step; see the engine logs "
                           "under the run's logs/ directory")

    async def replace_engines(self, error: Exception) -> None:
        """The recovery replaces the engines that failed (`error`: the failure that showed it); the next
        requests go to the engines serving then. Call it with nothing in flight."""
        await self.set_clients(await self.recovery.recover(error))

    async def _watched(self, work):
        """Await `work` while the recovery's watch asks every engine for /health (an engine that does not
        answer in time is ended, so that its requests fail and are sent again)."""
        if self.recovery is None or self.recovery.check_every_s is None:
            return await work
        task = asyncio.ensure_future(work)
        while not (await asyncio.wait({task}, timeout=self.recovery.check_every_s))[0]:
            await self.recovery.check()
        return task.result()

    # ------------------------------------------------------------------ multi-turn
    async def _generate_trajectories(self, rows: list[dict[str, Any]], step: int) -> list[Sample]:
        """Every row's n trajectories (multiturn.py), scored: by the environment, or by the reward hub on the
        last model turn where the environment left the reward to it. An engine that fails mid-step is replaced
        and the step's trajectories run again from their start (same seeds, new environments)."""
        from relax_core.rollout.multiturn import Trajectory, trajectory_stats

        n = self.sampling.n_samples_per_prompt
        for _ in range(MAX_RECOVERIES + 1):
            try:
                results = await self._watched(self._run_trajectories(rows, step))
                break
            except (EngineUnreachable, EngineError) as exc:
                if self.recovery is None:
                    raise
                await self.replace_engines(exc)
                self.resent += len(rows) * n
                log.warning("running the step's %d trajectories again after an engine was replaced", len(rows) * n)
        else:
            raise RuntimeError(f"the engines failed {MAX_RECOVERIES + 1} times in one step; see the engine logs "
                               "under the run's logs/ directory")
        samples: list[Sample] = []
        to_score: list[tuple[Sample, str, str | None]] = []
        done: list[Trajectory] = []
        for row_index, row in enumerate(rows):
            runs = results[row_index * n:(row_index + 1) * n]
            skipped = next((r for r in runs if isinstance(r, Skipped)), None)
            if skipped is not None:
                self.dropped_prompts += 1
                log.warning("skipped a prompt (row %d of the step): %s", row_index, skipped.reason)
                continue
            group_id = step * GROUP_STRIDE + row_index
            for k, run in enumerate(runs):
                segments = run if isinstance(run, list) else [run]
                for j, traj in enumerate(segments):
                    sample_id = group_id * n + k if len(segments) == 1 and not isinstance(run, list) else \
                        (group_id * n + k) * SEGMENT_STRIDE + j
                    sample = traj.sample(group_id, sample_id, row)
                    samples.append(sample)
                    done.append(traj)
                    if traj.reward is None:
                        to_score.append((sample, traj.last_text, row.get("reward")))
        self.last_reward_stats = empty_stats()
        if to_score:
            await self._score(to_score)
        self.last_reward_stats |= trajectory_stats(done) | self.agentic.step_stats()
        self.last_reward_stats["prompts_skipped"] = float(self.dropped_prompts)
        self.last_reward_stats["samples_resent"] = float(self.resent)
        return samples

    async def _run_trajectories(self, rows: list[dict[str, Any]], step: int) -> list:
        """All trajectories of the step, concurrently (at most `max_concurrency` per engine client); the first
        failure cancels the rest and is raised."""
        n, s = self.sampling.n_samples_per_prompt, self.sampling
        clients = list(self.clients)
        limit = asyncio.Semaphore(s.max_concurrency * len(clients))
        batcher = TurnBatcher(s.max_request_batch)

        async def one(row_index: int, k: int):
            index = row_index * n + k
            client = clients[row_index % len(clients)]  # all of a prompt's trajectories on one engine

            async def turn(ids: list[int], max_new_tokens: int, turn_index: int):
                seed = sample_seed(s.seed, step, index * TURN_STRIDE + turn_index)
                params = {"max_new_tokens": max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                          "top_k": s.top_k, "sampling_seed": seed}
                return await batcher.generate(client, ids, params, routing_key=f"{step}-{row_index}")

            async with limit:
                return await self.agentic.run(rows[row_index], turn)

        tasks = [asyncio.ensure_future(one(r, k)) for r in range(len(rows)) for k in range(n)]
        try:
            _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # a failure, or this step being cancelled: nothing of it keeps running
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        failed = next((t for t in tasks if not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
        return [task.result() for task in tasks]

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
            multimodal=prompt.multimodal, token_versions=mixed_versions(out.token_versions),
        ), out.text, row.get("reward")) for k, out in enumerate(responses)]

    async def set_clients(self, clients: list[EngineClient]) -> None:
        """Send later requests to `clients` (the engine set changed between steps); close the old ones."""
        old, self.clients = self.clients, list(clients)
        await asyncio.gather(*(client.aclose() for client in old))

    async def aclose(self) -> None:
        await asyncio.gather(*(client.aclose() for client in self.clients))
        if self.agentic is not None:
            self.agentic.close()

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the HTTP clients (in the loop they were used on)."""
        loop.run_until_complete(self.aclose())

    async def _score(self, built: list[tuple[Sample, str, str | None]]) -> None:
        """Set every sample's reward in one concurrent hub call (failures score 0 and are counted); the
        step's stats add up its calls (one per prompt when groups stream)."""
        items = [RewardItem(text, sample.label, sample.metadata, reward) for sample, text, reward in built]
        results = await self.reward_hub.score(items)
        for (sample, _, _), result in zip(built, results):
            sample.reward = result.score
        stats = self.last_reward_stats
        self.last_reward_stats = {key: stats.get(key, 0) + value for key, value in self.reward_hub.last_stats.items()}


def raise_if_aborted(outs: list) -> None:
    """An aborted request (the run is stopping, or an engine failed) makes the whole batch unusable:
    stop before scoring it rather than train on cut-off responses."""
    aborted = sum(out.finish_reason == "abort" for out in outs)
    if aborted:
        raise GenerationAborted(f"{aborted} of {len(outs)} responses were aborted by the engines")
