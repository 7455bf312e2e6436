"""`genrm`: LLM-as-judge. A judge model served by engines grades each response.

    recipe reward.genrm --> judge_service.py starts the judge engines, waits until healthy
        --> JudgeEndpoints(urls, api_key): plain data, handed to RewardHub.from_config(judge=...)
        --> the hub's `genrm`: a `Judge` on those endpoints, each call to the next engine in turn

The judge is any server speaking the engines' native `/generate` API (the CPU
engine here, SGLang on a GPU node). The prompt comes from `reward.genrm.template`
with `{question}` (the row's `question` column, "" without one), `{response}`
and `{label}`; the judge's greedy reply, at most `max_new_tokens` long, is
parsed for a score ("Score: 7", "7/10", or the last number), divided by
`max_score` and clipped to [0, 1]. A reply without a score is an error (the
sample scores 0 and counts in `reward_errors`), never a silent 0.

The judge is async, so the hub awaits it on its event loop (no worker
process), with the recipe's `reward.timeout_s`. Without a `reward.genrm`
section the built-in `genrm` reads a judge server the user runs from
`RELAX_GENRM_URL` (and `RELAX_GENRM_API_KEY`); `register_judge` registers a
judge with its own settings under any name, from a plugin.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relax_core.config.reward import DEFAULT_TEMPLATE
from relax_core.rewards.registry import reward

_NUM = r"(-?\d+(?:\.\d+)?)"
_SCORE = re.compile(rf"(?i)score\s*[:=]?\s*{_NUM}(?:\s*(?:/|out\s+of)\s*{_NUM})?")
_OUT_OF = re.compile(rf"(?i){_NUM}\s*(?:/|out\s+of)\s*{_NUM}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_score(reply: str, max_score: float = 10.0) -> float:
    """The judge's score in [0, 1]; ValueError when the reply holds none."""
    found = _SCORE.search(reply)
    if found is not None:
        value, scale = float(found.group(1)), float(found.group(2) or max_score)
    elif (ratio := _OUT_OF.search(reply)) is not None:
        value, scale = float(ratio.group(1)), float(ratio.group(2))
    else:
        numbers = _NUMBER.findall(reply)
        if not numbers:
            raise ValueError(f"judge reply has no score: {reply[:200]!r}")
        value, scale = float(numbers[-1]), max_score
    return min(1.0, max(0.0, value / scale)) if scale > 0 else 0.0


@dataclass(frozen=True)
class JudgeEndpoints:
    """Where the judge engines Relax started serve (judge_service.py): plain data, so it travels to
    whichever process runs the reward hub."""

    urls: tuple[str, ...]
    api_key: str | None = field(default=None, repr=False)  # a secret: kept out of logs and messages


@dataclass
class Judge:
    """A judge model behind `url` (one URL, or several: each call goes to the next); call it like a reward."""

    url: str | Sequence[str]
    api_key: str | None = field(default=None, repr=False)
    template: str = DEFAULT_TEMPLATE
    max_score: float = 10.0
    max_new_tokens: int = 16
    _turn: itertools.count = field(default_factory=itertools.count, init=False, repr=False)

    @classmethod
    def serving(cls, endpoints: JudgeEndpoints, section) -> Judge:
        """The judge of a recipe's `reward.genrm` section (`GenRMConfig`) on the engines Relax started."""
        return cls(endpoints.urls, endpoints.api_key, template=section.template, max_score=section.max_score,
                   max_new_tokens=section.max_new_tokens)

    @property
    def urls(self) -> tuple[str, ...]:
        return (self.url,) if isinstance(self.url, str) else tuple(self.url)

    async def __call__(self, response: str, label: Any, metadata: dict) -> dict[str, float]:
        from relax_core.rollout.client import EngineClient

        prompt = self.template.format(question=(metadata or {}).get("question", ""), response=response,
                                      label="" if label is None else label)
        params = {"max_new_tokens": self.max_new_tokens, "temperature": 0.0}
        urls = self.urls
        async with EngineClient(urls[next(self._turn) % len(urls)], api_key=self.api_key) as client:
            raw = await client.generate(text=prompt, sampling_params=params, return_logprob=False)
        reply = (raw[0] if isinstance(raw, list) else raw).get("text", "")
        return {"score": parse_score(reply, self.max_score)}


def as_reward(judge: Judge):
    """`judge` as an async reward function (what the registry and the hub call)."""

    async def judged(response: str, label: Any, metadata: dict) -> dict[str, float]:
        return await judge(response, label, metadata)

    judged.__doc__ = f"LLM-as-judge at {', '.join(judge.urls)}"
    return judged


def register_judge(name: str, judge: Judge) -> Judge:
    """Register `judge` as reward `name` (call it from a plugin file)."""
    reward(name)(as_reward(judge))
    return judge


@reward("genrm")
async def genrm(response: str, label: Any, metadata: dict) -> dict[str, float]:
    """LLM-as-judge: the judge of reward.genrm (or a server at $RELAX_GENRM_URL) scores the response."""
    url = os.environ.get("RELAX_GENRM_URL")
    if not url:
        raise RuntimeError("the genrm reward needs a judge: set reward.genrm.model in the recipe (Relax starts its "
                           "engines), or the address of a judge server of your own in RELAX_GENRM_URL")
    return await Judge(url, os.environ.get("RELAX_GENRM_API_KEY"))(response, label, metadata)
