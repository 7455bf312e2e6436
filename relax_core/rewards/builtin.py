"""Built-in rewards for the synthetic tasks (relax_core/data/synthetic.py).

Cheap string checks, so the hub calls them in-process (no worker round trip).

Registered in the reward registry under their names; a recipe selects one
with `reward: <name>`.
"""

from __future__ import annotations

from typing import Any

from relax_core.rewards.registry import reward


@reward("exact_match", in_process=True)
def exact_match(response: str, label: Any, metadata: dict | None = None) -> float:
    """1.0 if the response, stripped of surrounding whitespace, equals the label, else 0.0."""
    return float(response.strip() == str(label).strip())


@reward("copy", in_process=True)
def copy(response: str, label: Any, metadata: dict | None = None) -> float:
    """Partial credit: the fraction of positions where response and label agree.

    `sum_i [response[i] == label[i]] / max(len(response), len(label))`, so a
    response is 1.0 only when it equals the label exactly, and every extra or
    missing character costs as much as a wrong one. The per-position credit
    gives GRPO a signal long before a whole string is right (a random policy
    scores about 1/alphabet size instead of almost never 1).
    """
    target = str(label)
    longest = max(len(response), len(target))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(response, target)) / longest
