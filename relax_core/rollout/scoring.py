"""What a rollout asks of whatever scores its responses (rewards/hub.py's `RewardHub`, above this layer):
the item it hands over per response, and the scorer's interface. The rollout manager depends on this
interface, not on the reward hub, so the rewards (the judge among them, which is an engine of its own)
can build on the rollout's engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class RewardItem:
    """One response to score; `reward`: the reward to score it with (None: the scorer's default)."""

    response: str
    label: Any = None
    metadata: dict = field(default_factory=dict)
    reward: str | None = None


class Scorer(Protocol):
    """Scores a batch of responses: `score(items)` gives one result per item, each with its `score` (a
    float), `scores` (named sub-scores) and `status`; `last_stats` says how the last batch went (failure
    counts, seconds: `empty_stats`' keys and more). A plain function becomes one with
    `RewardHub.from_function`."""

    last_stats: dict[str, float]

    async def score(self, items: list[RewardItem]) -> list: ...


def empty_stats() -> dict[str, float]:
    """A scorer's `last_stats` before its first batch."""
    return {"reward_errors": 0, "reward_timeouts": 0, "reward_s": 0.0}
