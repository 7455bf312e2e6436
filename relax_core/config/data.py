"""The recipe's `data:` section: where prompts and labels come from (a synthetic task, a file or a hub data set),
and how they are read (columns, media bounds, chat template, shuffle)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Tag, model_validator

from relax_core.config.section import Section, tagged


class SyntheticData(Section):
    """A verifiable task generated from a seed (quick start, tests)."""

    source: Literal["synthetic"] = "synthetic"
    """Where prompts come from: `synthetic` (generated from a seed)."""
    task: Literal["copy", "reverse", "add", "colours", "tones"] = "copy"
    """Task: `copy` (repeat the string), `reverse` (reverse it) or `add` (sum two numbers); with media, for
    vision-language and omni models: `colours` (which of four colours fills an image; the parquet schema of
    multimodal-open-r1-8k-verified) or `tones` (is the second of two tones higher; image + audio, the
    schema of omni_avqa.yaml). The media tasks ignore the string settings."""
    min_len: int = Field(2, ge=1)
    """Shortest string in a prompt."""
    max_len: int = Field(3, ge=1)
    """Longest string in a prompt."""
    symbols: str = Field("abcde", min_length=2)
    """Characters the task strings are drawn from."""
    seed: int = Field(0, ge=0)
    """Seed of the prompt stream."""
    apply_chat_template: bool = True
    """Wrap each prompt in the model's chat template (a user turn, then the assistant's turn opened); false:
    the prompt's text is tokenized as it is, as base-model ("zero") RL and models trained from scratch take it.
    Media and a system prompt need the template."""

    @model_validator(mode="after")
    def _lengths(self) -> SyntheticData:
        if self.min_len > self.max_len:
            raise ValueError(f"min_len ({self.min_len}) must not exceed max_len ({self.max_len})")
        if not self.apply_chat_template and self.task in ("colours", "tones"):
            raise ValueError(f"apply_chat_template: task {self.task} has media, whose tokens the chat template "
                             "places; set it to true")
        return self


class FileData(Section):
    """A data set file (JSONL, JSON or Parquet) or a hub data set, one prompt per row."""

    source: Literal["file", "hub"] = "file"
    """`file` (a local path) or `hub` (a Hugging Face data set id)."""
    path: str = Field(min_length=1)
    """Path of the file, or the hub data set id."""
    split: str = "train"
    """Split to read (hub data sets)."""
    prompt_key: str = "prompt"
    """Column with the prompt (a string or a list of chat messages)."""
    label_key: str = "label"
    """Column with the reference answer the reward compares against."""
    reward_key: str | None = None
    """Column naming the reward of each row (mixed-task data sets); the recipe's reward otherwise."""
    image_key: str | None = None
    """Column with images (vision-language and omni models): per row a path (relative to the data file), bytes,
    a data URI, a Hugging Face `{bytes, path}` record, a list of these, or null. Files are read when the rows
    load; `relax validate` and `relax submit` decode every one first."""
    audio_key: str | None = None
    """Column with audio (omni models), in the same forms as `image_key` (or a `{array, sampling_rate}` record)."""
    video_key: str | None = None
    """Column with video (omni models), in the same forms as `image_key`."""
    image_min_pixels: int | None = Field(None, ge=1)
    """Smaller images are scaled up (aspect ratio kept) to at least this many pixels; null: left to the processor."""
    image_max_pixels: int | None = Field(None, ge=1)
    """Larger images are scaled down (aspect ratio kept) to at most this many pixels; null: left to the processor."""
    video_fps: float = Field(2.0, gt=0)
    """Frames sampled per second of video time."""
    video_min_frames: int = Field(4, ge=1)
    """Fewest frames taken from a clip (spread evenly over it; never more than the clip has)."""
    video_max_frames: int = Field(768, ge=1)
    """Most frames taken from a clip (spread evenly over it when `video_fps` would take more)."""
    audio_sample_rate: int | None = Field(None, ge=1000)
    """Rate audio is resampled to, in Hz; null: the model's processor's rate."""
    audio_max_seconds: float | None = Field(None, gt=0)
    """Longest audio clip in seconds: a longer one is refused (by `relax validate` first); null: no bound."""
    system_prompt: str | None = None
    """System message put before every prompt."""
    apply_chat_template: bool = True
    """Wrap each prompt in the model's chat template (a user turn, then the assistant's turn opened); false:
    the prompt's text is tokenized as it is, as base-model ("zero") RL and models trained from scratch take it.
    Media and a system prompt need the template."""
    shuffle: bool = True
    """Shuffle the rows each epoch."""
    seed: int = Field(0, ge=0)
    """Seed of the shuffle."""

    @model_validator(mode="after")
    def _media_bounds(self) -> FileData:
        for low, high in (("image_min_pixels", "image_max_pixels"), ("video_min_frames", "video_max_frames")):
            least, most = getattr(self, low), getattr(self, high)
            if least is not None and most is not None and least > most:
                raise ValueError(f"{low} ({least}) must not exceed {high} ({most})")
        if not self.apply_chat_template:
            needs = [k for k in ("system_prompt", "image_key", "video_key", "audio_key") if getattr(self, k)]
            if needs:
                raise ValueError(f"apply_chat_template: {', '.join(needs)} need(s) the chat template (it places a "
                                 "system turn and media tokens); set it to true or remove them")
        return self


DataConfig = Annotated[
    Annotated[SyntheticData, Tag("synthetic")] | Annotated[FileData, Tag("file")] | Annotated[FileData, Tag("hub")],
    tagged("source", "file"),
]
