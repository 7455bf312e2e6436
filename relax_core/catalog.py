"""What a recipe can name: algorithms and rewards, with descriptions and parameters.

Read by `relax list` and by recipe checks. Algorithms come from the recipe
schema (each algorithm's typed config is the source of truth for its
parameters); rewards from the reward registry.
"""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import BaseModel

from relax_core.config.schema import ALGORITHM_MODELS


def algorithm_entries() -> list[dict[str, Any]]:
    """One entry per algorithm: name, one-line description, parameters with defaults."""
    return [
        {"name": name, "description": _first_line(model.__doc__), "parameters": _defaults(model)}
        for name, model in ALGORITHM_MODELS.items()
    ]


def reward_entries(plugin_dirs: list[str] | tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One entry per reward the registry knows: built-ins and plug-ins (default folder and `plugin_dirs`)."""
    from relax_core.rewards.registry import get_spec, list_rewards

    entries = []
    for name in list_rewards(plugin_dirs):
        spec = get_spec(name, plugin_dirs)
        entries.append({"name": name, "description": _first_line(inspect.getdoc(spec.fn)), "source": str(spec.source)})
    return entries


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0] if doc and doc.strip() else ""


def _defaults(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    params: dict[str, Any] = {}
    for key, info in model.model_fields.items():
        if key == "name":
            continue
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            params |= _defaults(annotation, f"{prefix}{key}.")
        elif info.is_required():
            params[prefix + key] = "required"
        else:
            params[prefix + key] = info.get_default(call_default_factory=True)
    return params
