"""`genrm`: LLM-as-judge. A judge model served by a rollout engine grades each response.

The judge is any server speaking the engines' native `/generate` API (SGLang
on a GPU node, the CPU engine here). The prompt comes from a template with
`{question}`, `{response}` and `{label}`; the judge's reply is parsed for a
score ("Score: 7", "7/10", or the last number), divided by `max_score` and
clipped to [0, 1]. A reply without a score is an error (the sample scores 0
and counts in `reward_errors`), never a silent 0.

The judge is async, so the hub awaits it on its event loop (no worker
process), with the recipe's `reward.timeout_s`. The built-in `genrm` reads its
server from `RELAX_GENRM_URL` (and `RELAX_GENRM_API_KEY`); `register_judge`
registers a judge with its own settings under any name, from a plugin.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from relax_core.rewards.registry import reward

DEFAULT_TEMPLATE = (
    "You are grading an answer.\nQuestion: {question}\nReference answer: {label}\n"
    "Answer to grade: {response}\nGive a score from 0 to 10 as 'Score: N'.\nScore:"
)
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


@dataclass
class Judge:
    """A judge model behind `url`; call it like a reward (async)."""

    url: str
    api_key: str | None = None
    template: str = DEFAULT_TEMPLATE
    max_score: float = 10.0
    max_new_tokens: int = 16

    async def __call__(self, response: str, label: Any, metadata: dict) -> dict[str, float]:
        from relax_core.rollout.client import EngineClient

        prompt = self.template.format(question=(metadata or {}).get("question", ""), response=response,
                                      label="" if label is None else label)
        params = {"max_new_tokens": self.max_new_tokens, "temperature": 0.0}
        async with EngineClient(self.url, api_key=self.api_key) as client:
            raw = await client.generate(text=prompt, sampling_params=params, return_logprob=False)
        reply = (raw[0] if isinstance(raw, list) else raw).get("text", "")
        return {"score": parse_score(reply, self.max_score)}


def register_judge(name: str, judge: Judge) -> Judge:
    """Register `judge` as reward `name` (call it from a plugin file)."""

    async def judged(response: str, label: Any, metadata: dict) -> dict[str, float]:
        return await judge(response, label, metadata)

    judged.__doc__ = f"LLM-as-judge at {judge.url}"
    reward(name)(judged)
    return judge


@reward("genrm")
async def genrm(response: str, label: Any, metadata: dict) -> dict[str, float]:
    """LLM-as-judge: a judge model at $RELAX_GENRM_URL scores the response 0-10, scaled to [0, 1]."""
    url = os.environ.get("RELAX_GENRM_URL")
    if not url:
        raise RuntimeError("the genrm reward needs the judge engine's address in RELAX_GENRM_URL")
    return await Judge(url, os.environ.get("RELAX_GENRM_API_KEY"))(response, label, metadata)
