"""The recipe's `reward:` section: the reward function, its workers and error budget, and the judge model of
the `genrm` reward (rewards/genrm.py scores with it; its default prompt is declared here, with the field)."""

from __future__ import annotations

import string

from pydantic import Field, field_validator

from relax_core.config.section import Section

DEFAULT_TEMPLATE = (
    "You are grading an answer.\nQuestion: {question}\nReference answer: {label}\n"
    "Answer to grade: {response}\nGive a score from 0 to 10 as 'Score: N'.\nScore:"
)


class GenRMConfig(Section):
    """The judge of the `genrm` reward: a model Relax serves on judge engines of its own, started with the
    run's engines and trainers and stopped at its end."""

    model: str = Field(min_length=1)
    """Judge model: a local Hugging Face model directory (a relative path is taken from where the run starts,
    like `model.path`) or a hub id."""
    num_engines: int = Field(1, ge=1)
    """Judge engine servers on the engines' node group, the rollout's kind of engine: SGLang servers of
    `rollout.gpus_per_engine` GPUs each in the group's last GPU slots, or CPU engines; each judge call goes
    to the next one in turn."""
    max_new_tokens: int = Field(16, ge=1)
    """Longest judge reply in tokens (greedy); the reply is searched for the score."""
    template: str = DEFAULT_TEMPLATE
    """Judge prompt: `{response}` (required), `{label}`, and `{question}` (the row's `question` column)."""
    max_score: float = Field(10.0, gt=0.0)
    """The judge's scale: a score given without one ("Score: 7") is divided by it, then clipped to [0, 1]."""
    trust_remote_code: bool = False
    """Run the code the judge model directory ships (`auto_map` in its config); without it such a model is
    refused."""

    @field_validator("template")
    @classmethod
    def _placeholders(cls, value: str) -> str:
        try:
            names = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
        except ValueError as exc:
            raise ValueError(f"not a format string ({exc}); write a literal brace as {{{{ or }}}}") from None
        unknown = sorted(names - {"question", "response", "label"})
        if unknown:
            raise ValueError(f"unknown placeholder(s) {', '.join('{' + n + '}' for n in unknown)}; "
                             "use {question}, {response} and {label}")
        if "response" not in names:
            raise ValueError("the template has no {response}: the judge would never see what it grades")
        return value


class RewardConfig(Section):
    """How responses are scored."""

    name: str = Field("exact_match", min_length=1)
    """Reward function (see `relax list rewards`)."""
    key: str | None = None
    """When the reward returns several named scores, the one to train on."""
    plugin_dirs: list[str] = Field(default_factory=list)
    """Extra folders whose `*.py` files define rewards with `@reward("name")`; relative to the recipe file."""
    timeout_s: float = Field(10.0, gt=0.0)
    """Time limit of one reward call; a call past it scores 0."""
    num_workers: int = Field(0, ge=0)
    """Worker processes for synchronous rewards; 0: one per CPU core, at most 16."""
    max_error_frac: float = Field(0.5, ge=0.0, le=1.0)
    """The run stops when more than this fraction of `error_window` samples, among the last
    `error_window`, failed (reward errors plus time-outs); 1.0 never stops it."""
    error_window: int = Field(256, ge=1)
    """Samples over which `max_error_frac` is counted."""
    genrm: GenRMConfig | None = None
    """The `genrm` reward's judge model, served by Relax for the run; unset: a judge server of your own at
    `$RELAX_GENRM_URL`."""

    @property
    def judge_engines(self) -> int:
        """Judge engine servers the run starts (`genrm.num_engines`, 0 without a `genrm` section)."""
        return self.genrm.num_engines if self.genrm is not None else 0
