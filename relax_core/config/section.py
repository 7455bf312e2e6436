"""What every recipe section shares: the base model (unknown keys refused, fields documented by their
docstrings), the parameter dtypes, and the discriminator that picks a section's class by its tag field.

Each section's models live in a module of their own beside this one (model.py, data.py, rollout.py, ...);
schema.py joins them into the `Recipe`. pydantic only: nothing heavy is imported.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator

Dtype = Literal["float32", "bfloat16", "float16"]


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, docstrings describe fields."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


def tagged(field: str, default: str):
    """A discriminator that reads `field` from the input and falls back to `default`."""

    def pick(value: Any) -> str:
        if isinstance(value, dict):
            return value.get(field, default)
        return getattr(value, field, default)

    return Discriminator(pick)
