"""Is a resubmitted recipe still the same run? The check behind `relax submit RECIPE --run-dir EXISTING`.

A resumed run continues from its checkpoint as if it had never stopped, so the
new recipe may differ from the stored recipe.yaml only where a difference
cannot change what the run computes. That is an allow-list (`SAFE_TO_CHANGE`),
not a deny-list: a field added to the schema later must match until someone
decides it is safe, so a new knob can never silently fork a run.

`fingerprint` hashes the same must-match part of a recipe; the checkpoint
directory's identity file records it (relax_core/checkpoint/owner.py).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from relax_core.errors import RecipeError

# dotted prefix -> why changing it on resume leaves the run the same run
SAFE_TO_CHANGE = {
    "name": "a label; the run directory is what identifies the run",
    "train.steps": "where the run ends: a resumed run continues to the new last step",
    "train.weight_sync_bucket_mb": "how the weights travel to the engines, not what they are",
    "checkpoint.interval": "how often the state is saved",
    "checkpoint.keep_last": "how many saves are kept",
    "logging": "how metrics are shown; run_root is unused once --run-dir names the run",
    "cluster.executor": "where the driver runs; the node groups that compute must still match",
    "cluster.slurm": "scheduling only: partition, account, qos, time limit, signals, start-up timeout",
    "cluster.network": "which interface the job's processes talk over",
    "cluster.hub_cache": "where the hub ids are downloaded to; the ids stay the same",
    "cluster.train.mem": "a memory request",
    "cluster.rollout.mem": "a memory request",
    "cluster.reference.mem": "a memory request",
    "reward.num_workers": "how many processes score samples, not the scores",
    "reward.max_error_frac": "when failing rewards stop the run, not what they score (raise it to resume such a run)",
    "reward.error_window": "the window of that stop rule",
}
UNSET = "(unset)"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b.c": leaf} of a nested dict; lists and empty dicts are leaves."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat |= flatten(value, f"{prefix}.{key}" if prefix else str(key))
    return flat


def is_safe(dotted: str) -> bool:
    return any(dotted == p or dotted.startswith(p + ".") for p in SAFE_TO_CHANGE)


def identity_fields(resolved: dict[str, Any]) -> dict[str, Any]:
    """The fields that make a run what it is: everything not in `SAFE_TO_CHANGE`."""
    return {k: v for k, v in flatten(resolved).items() if not is_safe(k)}


def fingerprint(resolved: dict[str, Any]) -> str:
    """A short hash of a resolved recipe's identity fields."""
    text = json.dumps(identity_fields(resolved), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stored_recipe(text: str) -> dict[str, Any]:
    """A run's recipe.yaml, resolved by today's schema when it still validates (so a field added
    since gets its default on both sides), else as written."""
    from pydantic import ValidationError

    from relax_core.config.schema import Recipe

    raw = yaml.safe_load(text) or {}
    try:
        return Recipe.model_validate(raw).model_dump(mode="json")
    except ValidationError:
        return raw


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, old, new) of every field that differs, in the new recipe's order."""
    a, b = flatten(old), flatten(new)
    keys = list(b) + [k for k in a if k not in b]
    return [(k, a.get(k, UNSET), b.get(k, UNSET)) for k in keys if a.get(k, UNSET) != b.get(k, UNSET)]


def check_same_run(old: dict[str, Any], new: dict[str, Any], run_path: str) -> list[tuple[str, Any, Any]]:
    """The safe changes of a resume; RecipeError naming each field that would make it a different run."""
    found = changes(old, new)
    forbidden = [c for c in found if not is_safe(c[0])]
    if forbidden:
        listed = "; ".join(describe(c) for c in forbidden)
        raise RecipeError(
            f"--run-dir {run_path} is an existing run, and this recipe would make it a different run: {listed}. "
            f"Resubmit with the stored values (see {run_path}/recipe.yaml), or start a new run with another "
            f"--run-dir. Safe to change when resuming: {', '.join(SAFE_TO_CHANGE)}")
    return found


def describe(change: tuple[str, Any, Any]) -> str:
    field, old, new = change
    return f"{field}: {_show(old)} -> {_show(new)}"


def _show(value: Any) -> str:
    return value if value == UNSET else json.dumps(value)
