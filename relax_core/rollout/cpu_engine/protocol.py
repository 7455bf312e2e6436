"""Request bodies of the CPU engine, with SGLang's field names and defaults.

Each model mirrors the dataclass of the same name in SGLang's
`python/sglang/srt/managers/io_struct.py` (and `SamplingParams` in
`sampling/sampling_params.py`), restricted to what this engine implements.
Fields SGLang has but this engine cannot honour are rejected with a 400 when
set to a non-default value, rather than silently ignored, so a recipe never
gets different sampling from what it asked for.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# SGLang treats temperatures below this as greedy decoding (top_k = 1).
SAMPLING_EPS = 1e-6

# Sampling parameters SGLang accepts that this engine does not implement,
# with the value that means "off".
_UNSUPPORTED_SAMPLING = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
}

# Request fields SGLang accepts that this engine does not implement.
_UNSUPPORTED_REQUEST = ("input_embeds", "lora_path")

# The media fields of `GenerateReqInput`, by modality.
MEDIA_FIELDS = {"image": "image_data", "video": "video_data", "audio": "audio_data"}

# One media item: a data URI, base64 string, file path or file:// URL (SGLang's
# `load_image` / `load_video` / `load_audio` strings). SGLang's other forms (PIL
# images, bytes, precomputed-embedding dicts) cannot come over HTTP as JSON.
MediaItem = str
# SGLang's `MultimodalDataInputFormat` restricted to strings: one item, a list
# (a single request's items, or one item per request of a batch) or a list of
# lists (each request's items); None (or [None]) is "no media" for that request.
MediaData = MediaItem | list[MediaItem | None | list[MediaItem | None]]


class SamplingParams(BaseModel):
    """Per-request sampling parameters (SGLang `SamplingParams`)."""

    model_config = ConfigDict(extra="allow")

    max_new_tokens: int = Field(128, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _none_means_default(cls, data: Any) -> Any:
        # SGLang lets callers send null for any field to get its default.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        extras = self.model_extra or {}
        bad = [k for k, off in _UNSUPPORTED_SAMPLING.items() if k in extras and extras[k] != off]
        if bad:
            raise ValueError(f"sampling_params {bad} are not supported by the CPU engine; leave them unset.")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class GenerateReqInput(BaseModel):
    """Body of `POST /generate` (SGLang `GenerateReqInput`, the subset this engine implements)."""

    model_config = ConfigDict(extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    image_data: MediaData | None = None
    video_data: MediaData | None = None
    audio_data: MediaData | None = None

    @model_validator(mode="after")
    def _check(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("Either text or input_ids should be provided.")
        if self.stream:
            raise ValueError("stream=True is not supported by the CPU engine.")
        extras = self.model_extra or {}
        bad = [k for k in _UNSUPPORTED_REQUEST if extras.get(k) is not None]
        if bad:
            raise ValueError(f"{bad} are not supported by the CPU engine.")
        if any(n for n in _as_list(self.top_logprobs_num, 1) if n):
            raise ValueError("top_logprobs_num is not supported by the CPU engine.")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def has_media(self) -> bool:
        return any(getattr(self, f) not in (None, []) for f in MEDIA_FIELDS.values())

    def media_per_item(self, n: int) -> list[dict[str, list[str]]]:
        """Each item's media by modality (`{"image": [...], "video": [...], "audio": [...]}`), as SGLang
        normalises them (`GenerateReqInput._normalize_*_data`, then the tokenizer manager's wrapping)."""
        per_field = {m: _media_of_items(getattr(self, f), n, self.is_batch, f) for m, f in MEDIA_FIELDS.items()}
        return [{m: items[i] for m, items in per_field.items()} for i in range(n)]

    def per_item(self, n: int, field: str, default: Any) -> list[Any]:
        """The value of `field` for each of the `n` items (a scalar is shared)."""
        value = getattr(self, field)
        if value is None:
            return [default] * n
        items = _as_list(value, n)
        if len(items) != n:
            raise ValueError(f"{field} has {len(items)} entries for a batch of {n}.")
        return items


def _media_of_items(value: MediaData | None, n: int, batch: bool, field: str) -> list[list[str]]:
    """SGLang's shapes: a single request takes one item or a list of items; a batch takes one item
    (every request gets it), a list with one entry per request (an item, a list of items, or None)."""
    if value is None or value == []:
        return [[] for _ in range(n)]
    if not batch:
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(x, str) for x in items):
            raise ValueError(f"{field} of a single request is one item or a list of items (strings).")
        return [list(items)]
    if isinstance(value, str):
        return [[value] for _ in range(n)]
    if len(value) != n:
        raise ValueError(f"The length of {field} should be equal to the batch size ({len(value)} != {n}).")
    return [[] if e is None else [e] if isinstance(e, str) else [x for x in e if x is not None] for e in value]


def _as_list(value: Any, n: int) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value] * n


class InitWeightsUpdateGroupReqInput(BaseModel):
    """Body of `POST /init_weights_update_group`."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(BaseModel):
    """Body of `POST /update_weights_from_distributed`.

    The trainer (rank 0 of the group) broadcasts one tensor per entry of
    `names`, in that order, with the given dtype and shape.
    """

    model_config = ConfigDict(extra="ignore")

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["flattened_bucket"] | None = None  # SGLang also takes custom loaders; this engine not

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_as_str(cls, v: Any) -> Any:
        return None if v is None else str(v)

    @model_validator(mode="after")
    def _check(self) -> UpdateWeightsFromDistributedReqInput:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have the same length.")
        return self


class DestroyWeightsUpdateGroupReqInput(BaseModel):
    """Body of `POST /destroy_weights_update_group`."""

    group_name: str = "weight_update_group"


class PauseGenerationReqInput(BaseModel):
    """Body of `POST /pause_generation` (optional; SGLang's default mode is abort).

    abort: in-flight requests return at once with finish_reason type "abort".
    in_place: in-flight requests stay, their KV cache kept, and resume on continue.
    retract: in-flight requests go back to the queue with their tokens so far, their KV cache freed;
    on continue they are prefilled again (prompt and tokens) with the weights loaded then.
    """

    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortReq(BaseModel):
    """Body of `POST /abort_request`."""

    rid: str | None = None
    abort_all: bool = False


# SGLang's memory tags (`sglang.srt.constants.GPU_MEMORY_ALL_TYPES`); no tags means all of them.
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


class ReleaseMemoryOccupationReqInput(BaseModel):
    """Body of `POST /release_memory_occupation` (optional)."""

    model_config = ConfigDict(extra="forbid")  # a field SGLang does not have is the caller's mistake

    tags: list[Literal["kv_cache", "weights", "cuda_graph"]] | None = None

    @property
    def tag_set(self) -> frozenset[str]:
        return frozenset(self.tags or MEMORY_TAGS)


class ResumeMemoryOccupationReqInput(ReleaseMemoryOccupationReqInput):
    """Body of `POST /resume_memory_occupation` (optional)."""


class UpdateWeightsFromTensorReqInput(BaseModel):
    """Body of `POST /update_weights_from_tensor`.

    `serialized_named_tensors` holds one base64 payload per TP rank (this
    engine has one rank and reads entry 0), each a pickle of
    `[(name, tensor), ...]` whose tensors are handles to the sender's memory
    (`relax_core.rollout.weight_wire`).
    """

    model_config = ConfigDict(extra="forbid")

    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: Literal["direct"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Literal["target", "all"] = "all"  # "draft": this engine has no draft model
    torch_empty_cache: bool = False

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_as_str(cls, v: Any) -> Any:
        return None if v is None else str(v)


class BeginWeightUpdateReqInput(BaseModel):
    """Body of `POST /begin_weight_update` (SGLang's weight-update session)."""

    model_config = ConfigDict(extra="forbid")

    selector: Literal["target", "all"] = "all"
