"""The recipe's `model:` section: the policy model, from the hub or a local directory, or a tiny random one."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Tag, model_validator

from relax_core.config.section import Dtype, Section, tagged


class HFModel(Section):
    """A Hugging Face model: a hub id or a local directory with config and weights."""

    source: Literal["hf"] = "hf"
    """Where the model comes from: `hf` (hub id or local directory)."""
    path: str = Field(min_length=1)
    """Hub id (e.g. `Qwen/Qwen3-4B`) or a local directory holding config.json and weights."""
    tokenizer: str | None = None
    """Tokenizer (hub id or local directory) to use instead of the model's own: prompts are encoded,
    responses decoded and checkpoints exported with it."""
    dtype: Dtype = "bfloat16"
    """Parameter dtype for training and rollout."""
    trust_remote_code: bool = False
    """Run the code a model or tokenizer directory ships (`auto_map` in its config) when the trainers,
    engines and driver load it; without it such a model is refused."""


class TinyModel(Section):
    """A tiny random-weight model built locally (quick start, tests): nothing is downloaded."""

    source: Literal["tiny"] = "tiny"
    """Where the model comes from: `tiny` (built from this config with random weights)."""
    architecture: Literal["qwen3", "qwen3_vl", "qwen3_omni"] = "qwen3"
    """Model architecture of the random-weight model (one of `models/tiny.py`'s CONFIG_BUILDERS): `qwen3` (text),
    `qwen3_vl` (Qwen3-VL: images, video) or `qwen3_omni` (Qwen3-Omni thinker: images, video, audio); the sizes
    below shape the text model, the vision/audio encoders are fixed tiny ones."""
    hidden_size: int = Field(64, ge=8)
    """Hidden size."""
    num_layers: int = Field(2, ge=1)
    """Number of transformer layers."""
    num_heads: int = Field(4, ge=1)
    """Attention heads."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention)."""
    alphabet: str = Field("abcdefghijklmnopqrstuvwxyz0123456789 +-=?.,", min_length=2)
    """Characters of the character-level tokenizer (the chat template's are added)."""
    seed: int = Field(0, ge=0)
    """Seed of the random initial weights."""
    dtype: Dtype = "float32"
    """Parameter dtype."""

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModel:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must be divisible by num_heads, and num_heads by num_kv_heads")
        return self


ModelConfig = Annotated[
    Annotated[HFModel, Tag("hf")] | Annotated[TinyModel, Tag("tiny")],
    tagged("source", "hf"),
]
