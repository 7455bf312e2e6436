"""Multi-turn trajectories: the model's turns, an environment's answers, one token sequence with a loss mask.

    reset(row) -> first message(s) --chat template--> prompt_ids
    loop, at most rollout.env.max_turns times:
        model turn:  /generate on prompt + response so far (the trajectory's engine, its own seed),
                     at most min(max_tokens_per_turn, budget left) tokens   -> loss mask 1, engine log-probs
        env.step(the turn's text) -> observation, reward, done, info
        done, last turn, or no budget left?  end
        observation --chat template (chat_turns.py)--> ids                 -> loss mask 0, log-prob 0
    Sample: prompt_ids, response_ids = every token after the prompt, loss_mask, rollout_logprobs

The budget `rollout.max_new_tokens` covers every token after the prompt, the
model's and the environment's; an answer that would not fit ends the
trajectory with finish reason "length". All trajectories of a step run
concurrently; a prompt's n trajectories go to one engine (behind a router: one
routing key), so its prefix cache serves every turn. Weights may change
while a trajectory runs (the asynchronous modes update engines mid-request),
so each token keeps the version that made it (`Sample.token_versions`); an
environment's tokens carry the version of the turn they answer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from relax_core.data.sample import Sample, mixed_versions
from relax_core.rollout.chat_turns import ChatTurns
from relax_core.rollout.client import GenerateOutput, GenerationAborted, version_number
from relax_core.rollout.envs import as_messages, call, environment_factory
from relax_core.rollout.prompt_prep import Skipped

log = logging.getLogger(__name__)

TurnFn = Callable[[list[int], int, int], Awaitable[GenerateOutput]]  # (ids, max new tokens, turn) -> output


@dataclass
class Trajectory:
    """One trajectory's tokens as they grow, and how it ended."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    finish_reason: str = "stop"
    versions: list[int] = field(default_factory=list)  # one per response token
    turn_version: int = 0  # the version of the last model turn's last token
    reward: float | None = 0.0  # None: the reward hub scores `last_text`
    last_text: str = ""
    closed: bool = False  # the last model turn generated the template's closing token
    info: dict[str, float] = field(default_factory=dict)

    def add_model(self, out: GenerateOutput, text: str, closed: bool) -> None:
        if len(out.logprobs) != len(out.output_ids):
            raise ValueError("the engine returned no log-prob for some generated tokens (return_logprob)")
        self.response_ids += out.output_ids
        self.logprobs += out.logprobs
        self.mask += [1] * len(out.output_ids)
        self.turns += 1
        self.versions += out.token_versions
        self.turn_version = out.token_versions[-1] if out.token_versions else version_number(out.weight_version)
        self.last_text, self.closed = text, closed

    def add_env(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.versions += [self.turn_version] * len(ids)

    def add_info(self, info: dict[str, Any] | None) -> None:
        for key, value in (info or {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.info[key] = self.info.get(key, 0.0) + float(value)

    def sample(self, group_id: int, sample_id: int, row: dict[str, Any]) -> Sample:
        metadata = dict(row.get("metadata") or {}) | {"turns": self.turns}
        return Sample(prompt_ids=list(self.prompt_ids), response_ids=self.response_ids,
                      rollout_logprobs=self.logprobs, loss_mask=self.mask, reward=self.reward or 0.0,
                      group_id=group_id, policy_version=min(self.versions, default=self.turn_version),
                      label=row.get("label"), metadata=metadata, finish_reason=self.finish_reason,
                      sample_id=sample_id, token_versions=mixed_versions(self.versions))


class EnvEpisodes:
    """Runs environment trajectories for the rollout manager (`rollout.env`).

    Args:
        config: the recipe's `rollout.env` (`EnvConfig`).
        chat: renders prompts and observations (chat_turns.py).
        max_new_tokens: the trajectory's budget after the prompt (`rollout.max_new_tokens`).
        max_prompt_len: a longer first prompt skips its row (counted, like a single-turn prompt).
    """

    def __init__(self, config, chat: ChatTurns, max_new_tokens: int, max_prompt_len: int) -> None:
        self.config, self.chat = config, chat
        self.make_env = environment_factory(config)
        self.max_new_tokens, self.max_prompt_len = max_new_tokens, max_prompt_len

    def step_stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        from relax_core.rollout.tools import close_pools

        close_pools()  # the built-in tool environment's workers

    async def run(self, row: dict[str, Any], turn: TurnFn) -> Trajectory | Skipped:
        env = self.make_env()
        try:
            return await self._run(env, row, turn)
        finally:
            close = getattr(env, "close", None)
            if close is not None:
                await call(close)

    async def _run(self, env, row: dict[str, Any], turn: TurnFn) -> Trajectory | Skipped:
        cfg, budget = self.config, self.max_new_tokens
        first = await call(env.reset, row)
        prompt_ids = self.chat.prompt_ids(row["prompt"] if first is None else _first_prompt(first),
                                          tools=getattr(env, "tools", None))
        if len(prompt_ids) > self.max_prompt_len:
            return Skipped(-1, f"its first prompt from the environment is {len(prompt_ids)} tokens "
                               f"(rollout.max_prompt_len={self.max_prompt_len})")
        traj, total = Trajectory(prompt_ids), 0.0
        for index in range(cfg.max_turns):
            left = budget - len(traj.response_ids)
            limit = min(left, cfg.max_tokens_per_turn or left)
            out = await turn(traj.prompt_ids + traj.response_ids, limit, index)
            if out.finish_reason == "abort":
                raise GenerationAborted("an engine aborted a turn of a trajectory")
            text = self.chat.tokenizer.decode(out.output_ids, skip_special_tokens=True)
            last = out.output_ids[-1] if out.output_ids else None
            traj.add_model(out, text, closed=out.finish_reason == "stop" and self.chat.closes_turn(last))
            observation, reward, done, info = _step_result(await call(env.step, text), cfg.name)
            traj.add_info(info)
            total += float(reward or 0.0)
            traj.reward = None if reward is None else total  # the last step's None: the hub scores the last turn
            if done or index == cfg.max_turns - 1:
                return traj
            ids = self.chat.observation_ids(as_messages(observation, getattr(env, "role", "user")), traj.closed)
            if len(traj.response_ids) + len(ids) >= budget:  # no room for the answer and another model token
                traj.finish_reason = "length"
                return traj
            traj.add_env(ids)
        return traj


def _first_prompt(first: Any) -> str | list[dict]:
    if isinstance(first, str):
        return first
    return as_messages(first, "user")


def _step_result(result: Any, name: str) -> tuple[Any, float | None, bool, dict]:
    if not (isinstance(result, tuple) and len(result) == 4):
        raise TypeError(f"rollout.env {name}.step must return (observation, reward, done, info), not {result!r:.200}")
    observation, reward, done, info = result
    return observation, reward, bool(done), info if isinstance(info, dict) else {}


def trajectory_stats(trajectories: list[Trajectory]) -> dict[str, float]:
    """A step's multi-turn metrics: mean turns, the model's share of response tokens, each `info` key's mean."""
    if not trajectories:
        return {}
    count = len(trajectories)
    tokens = sum(len(t.mask) for t in trajectories)
    stats = {"turns_mean": sum(t.turns for t in trajectories) / count,
             "model_token_frac": sum(sum(t.mask) for t in trajectories) / tokens if tokens else 0.0}
    for key in sorted({k for t in trajectories for k in t.info}):
        stats[f"env/{key}"] = sum(t.info.get(key, 0.0) for t in trajectories) / count
    return stats
