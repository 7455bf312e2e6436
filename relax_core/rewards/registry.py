"""Registry of reward functions, looked up by the name a recipe gives.

The rollout side calls `get_reward(name)(response, label, metadata)` on each
decoded response and stores the float in `Sample.reward`. A reward is a plain
function `fn(response: str, label, metadata: dict) -> float`, registered with
`@reward("name")`. Built-ins (builtin.py) are registered on first lookup, so
importing this module stays cheap. (A fuller reward hub with plug-ins comes later.)
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

RewardFn = Callable[[str, Any, dict], float]

_REWARDS: dict[str, RewardFn] = {}
_BUILTIN_MODULES = ("relax_core.rewards.builtin",)


def reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn` under `name` (re-registering a name replaces it)."""

    def decorate(fn: RewardFn) -> RewardFn:
        _REWARDS[name] = fn
        return fn

    return decorate


def get_reward(name: str) -> RewardFn:
    """The reward function registered as `name`."""
    _load_builtins()
    if name not in _REWARDS:
        raise KeyError(
            f"unknown reward '{name}'; registered rewards: {', '.join(list_rewards())}"
        )
    return _REWARDS[name]


def list_rewards() -> list[str]:
    """Names of all registered rewards, sorted."""
    _load_builtins()
    return sorted(_REWARDS)


def _load_builtins() -> None:
    # Imported here, not at module level: builtin.py imports this module for `@reward`.
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
