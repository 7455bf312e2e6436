"""Example reward plugin: `math_concise`, the `math` reward with a length penalty.

Any `*.py` file in this folder, or in a folder a recipe lists under
`reward.plugin_dirs`, is imported when rewards are looked up; each function
decorated with `@reward("name")` becomes usable as `reward.name: name` (or in
a data set's reward column) with no other change. A reward gets the response
text, the label and the sample's metadata; it may be `async def`, and may
return a float or a dict of named floats (the recipe's `reward.key` picks the
one to train on, default "score"; the others are logged). Try it:

    relax reward score math_concise --response 'So \\boxed{4}' --label 4
"""

from __future__ import annotations

from typing import Any

from relax_core.rewards.math_rewards import math_reward
from relax_core.rewards.registry import reward


@reward("math_concise")
def math_concise(response: str, label: Any, metadata: dict) -> dict[str, float]:
    """math, minus 0.1 per 1,000 characters beyond metadata['max_chars'] (default 4,000), floored at -0.5."""
    accuracy = math_reward(response, label, metadata)
    excess = max(0, len(response) - int((metadata or {}).get("max_chars", 4000)))
    penalty = min(0.5, 0.1 * excess / 1000)
    return {"score": accuracy - penalty, "accuracy": accuracy, "length_penalty": penalty}
