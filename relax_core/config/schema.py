"""The recipe schema: every option a user can set, typed, bounded and documented.

A recipe is YAML validated against `Recipe`. Loading (files, dotted overrides,
error messages) is in `loader.py`; this module only declares the models and
their cross-field checks. It imports pydantic and nothing heavy, so the CLI can
validate a recipe on a login node in milliseconds.
"""

from __future__ import annotations

import os
import re
import string
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from relax_core.config.algorithms import AlgorithmConfig, GRPOConfig, algorithm_problems
from relax_core.config.engines import ENGINE_KINDS, engine_kind
from relax_core.config.modes import DEFAULT_MODE, MODE_NAMES, MODES, mode_spec
from relax_core.rewards.genrm import DEFAULT_TEMPLATE

Dtype = Literal["float32", "bfloat16", "float16"]


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, docstrings describe fields."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


def _tagged(field: str, default: str):
    """A discriminator that reads `field` from the input and falls back to `default`."""

    def pick(value: Any) -> str:
        if isinstance(value, dict):
            return value.get(field, default)
        return getattr(value, field, default)

    return Discriminator(pick)


# --------------------------------------------------------------------- model
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
    _tagged("source", "hf"),
]


# ---------------------------------------------------------------------- data
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
    _tagged("source", "file"),
]


# ------------------------------------------------------------------- rollout
class EnvConfig(Section):
    """A multi-turn environment (rollout/envs.py): the model's turn is generated, the environment answers as
    the next user or tool message, until it says done, `max_turns` or the token budget ends the trajectory."""

    path: str | None = None
    """Python file defining the environment class (relative to the recipe file); unset: a built-in
    environment (`tools`: the model calls the Python functions of `args.tools` in Qwen's `<tool_call>` form)."""
    name: str = Field(min_length=1)
    """The class in `path` (or the built-in's name) implementing `reset(sample)`, `step(response)` and
    `close()` (rollout/envs.py: `Environment`)."""
    max_turns: int = Field(4, ge=1)
    """Model turns per trajectory at most."""
    max_tokens_per_turn: int | None = Field(None, ge=1)
    """Longest model turn in tokens; null: what is left of the trajectory's budget (`rollout.max_new_tokens`
    covers every token after the prompt: the model's turns and the environment's answers)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's constructor (one instance per trajectory)."""


class AgentConfig(Section):
    """Agent programs (rollout/agent_app.py): one process per trajectory that talks to the policy through an
    OpenAI-compatible endpoint Relax serves for that trajectory; every call is recorded for training."""

    command: str = Field(min_length=1)
    """Shell command started per trajectory. It finds `OPENAI_BASE_URL` and `OPENAI_API_KEY` (the
    trajectory's key), the task in `RELAX_TASK_FILE` (JSON: prompt, label, metadata) and writes its reward
    (a number) to `RELAX_REWARD_FILE`."""
    cwd: str | None = None
    """Folder the command runs in (relative to the recipe file); unset: the recipe's folder."""
    timeout_s: float = Field(60.0, gt=0.0)
    """Time limit of one program: past it the program's whole process group is killed and the trajectory
    scores 0 (counted as `agent_timeouts`)."""


class RolloutConfig(Section):
    """Generation: engines, sampling, and how far rollout may run ahead of training."""

    engine: Literal[ENGINE_KINDS] = "sglang"
    """`sglang`: `sglang.launch_server` on GPU nodes, `gpus_per_engine` GPUs (TP ranks) each; `cpu`: Relax's
    own engine speaking SGLang's API (no GPU); how they differ: relax_core/config/engines.py."""
    num_engines: int = Field(1, ge=1)
    """Number of engine servers."""
    gpus_per_engine: int = Field(1, ge=0)
    """GPUs per engine (tensor parallel size of each engine); 0 for the CPU engine."""
    prompts_per_step: int = Field(32, ge=1)
    """Prompts per training step."""
    n_samples_per_prompt: int = Field(8, ge=1)
    """Responses generated per prompt (the group size of GRPO-like estimators)."""
    max_prompt_len: int = Field(1024, ge=1)
    """Longest prompt in tokens; longer prompts are dropped with a warning."""
    max_new_tokens: int = Field(1024, ge=1)
    """Longest response in tokens."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 disables it."""
    max_staleness: int = Field(1, ge=0)
    """`fully_async`/`hybrid`: how many policy versions a consumed sample may lag behind the weights
    being trained (rollout runs that far ahead of training); 0 is on-policy."""
    max_concurrency: int = Field(64, ge=1)
    """Requests in flight per engine."""
    media_workers: int = Field(1, ge=1)
    """Processes beside the rollout manager that decode images, video and audio and run the model's
    processor (data with `image_key`, `video_key` or `audio_key`), so generation does not wait on them."""
    router: bool | None = None
    """Put the engines behind one router (`sglang-router`: a group's samples stay on one engine, each
    new group goes to the engine with the fewest requests in flight). Null: when there is more than one
    engine; without it the rollout manager spreads prompt groups over the engines itself."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Extra server arguments of each SGLang engine, by SGLang's names (`mem_fraction_static: 0.7` ->
    `--mem-fraction-static 0.7`; true/false for on/off flags, a list for several values). Each key is checked
    against SGLang's server arguments (the installed SGLang's, else the pinned version's); the ones Relax
    sets itself (model path, host, port, TP size, seed, ...) are refused, and so are those that change how many
    GPUs an engine has (`dp_size`, `pp_size`, `nnodes`, ...: the weight sync gives each engine `gpus_per_engine`
    ranks). The cpu engine takes none."""
    deterministic: bool = False
    """SGLang engines: start them with `--enable-deterministic-inference` (batch-invariant kernels), the only
    mode in which SGLang samples by each request's `sampling_seed`, so that a sample sent again after its engine
    was replaced, or drawn again by a resumed run, is the same draw. It costs generation throughput (SGLang's
    report: about a third with CUDA graphs) and pins the sampling backend to pytorch and attention to
    flashinfer, fa3 or triton. Without it SGLang ignores the seeds: a resent sample is a new draw from the same
    weights (still kept once, so no sample is trained twice). The cpu engine always samples by the seeds (it
    refuses this field)."""

    env: EnvConfig | None = None
    """Multi-turn rollouts with an environment (agentic RL): see `EnvConfig`. Unset: one response per prompt."""
    agent: AgentConfig | None = None
    """Multi-turn rollouts driven by an agent program of your own: see `AgentConfig`."""

    @property
    def uses_router(self) -> bool:
        return self.router if self.router is not None else self.num_engines > 1

    @property
    def agentic(self) -> bool:
        return self.env is not None or self.agent is not None

    @model_validator(mode="after")
    def _one_driver(self) -> RolloutConfig:
        if self.env is not None and self.agent is not None:
            raise ValueError("env and agent both drive the turns of a trajectory: set one of them")
        return self


# --------------------------------------------------------------------- train
class TrainCommon(Section):
    lr: float = Field(1e-6, gt=0.0)
    """Peak learning rate."""
    min_lr: float = Field(0.0, ge=0.0)
    """Final learning rate of a decaying schedule."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warm-up."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Maximum global gradient norm."""
    steps: int = Field(100, ge=1)
    """Training steps (one rollout step each; `global_batch_size` and `ppo_epochs` set its optimizer steps)."""
    global_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step, over all data-parallel ranks: a step's samples divided by it is the number
    of optimizer steps per pass (PPO mini-batches), from the second of which on the clip ranges act. Null: all
    the step's samples, one optimizer step (on-policy, ratio 1)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over a step's samples, each taking the step's optimizer steps again."""
    micro_batch_size: int = Field(8, ge=1)
    """Samples per forward/backward pass on one rank."""
    seed: int = Field(0, ge=0)
    """Seed of the trainer's random state and of the per-sample sampling seeds."""
    weight_sync_bucket_mb: float = Field(512.0, gt=0.0)
    """Size of one weight-sync bucket (MiB): tensors are broadcast to the engines bucket by bucket."""
    max_tokens_per_gpu: int | None = Field(None, ge=1)
    """Token budget of one micro-batch on one rank: samples (at most `micro_batch_size`) are packed one
    after another into one row, without padding, up to this many prompt+response tokens (a longer
    sample goes alone). Null: padded micro-batches of `micro_batch_size` samples. Micro-batches with
    images, video or audio are always padded (torch backend). Megatron: the packed row is megatron-core's
    THD layout, each sample attended by itself."""


class TorchTrainConfig(TrainCommon):
    """The PyTorch backend (any transformers model; data parallel over torch.distributed)."""

    backend: Literal["torch"] = "torch"
    """Training backend: `torch`."""
    cpu_ranks_per_node: int = Field(1, ge=1)
    """Data-parallel processes per node when the node has no GPU."""
    fsdp: bool | None = None
    """Shard parameters, gradients and optimizer state over the training ranks (FSDP2), float32 master
    weights computed in `model.dtype`. Null: on when the train group has GPUs. A checkpoint resumes with
    the same setting."""
    recompute_activations: bool = False
    """Recompute each decoder layer's activations in the backward pass: less memory, about a third more
    compute."""
    freeze_vision: bool = False
    """Keep the vision encoder (and its merger into the language model) at its initial weights: it gets no
    gradient, no optimizer state and is not resent to the engines (vision-language and omni models)."""
    freeze_audio: bool = False
    """Keep the audio encoder at its initial weights, likewise (omni models)."""


class MegatronTrainConfig(TrainCommon):
    """The megatron-core backend: Qwen3 and Qwen3-MoE built with megatron-core's own layers, tensor /
    pipeline / expert parallel, Megatron distributed checkpoints (train/megatron/)."""

    backend: Literal["megatron"] = "megatron"
    """Training backend: `megatron`."""
    cpu_ranks_per_node: int = Field(1, ge=1)
    """Trainer processes per node when the node has no GPU (data x tensor x pipeline parallel, over gloo)."""
    tensor_parallel: int = Field(1, ge=1)
    """Tensor-parallel size: attention heads, MLP columns and the vocabulary split over this many ranks."""
    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline-parallel size: the layers split into this many stages (1F1B schedule)."""
    context_parallel: int = Field(1, ge=1)
    """Context-parallel size (needs Transformer Engine's attention: only 1 in this version)."""
    expert_parallel: int = Field(1, ge=1)
    """Expert-parallel size (Qwen3-MoE): each MoE layer's experts split over this many data-parallel ranks."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: norms and dropout split along the sequence over the TP ranks."""
    recompute_activations: bool = False
    """Recompute each layer's activations in the backward pass (Megatron's full, uniform recomputation)."""
    distributed_optimizer: bool = False
    """Shard the optimizer state (fp32 master weights, Adam moments) over the data-parallel ranks."""

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel


TrainConfig = Annotated[
    Annotated[TorchTrainConfig, Tag("torch")] | Annotated[MegatronTrainConfig, Tag("megatron")],
    _tagged("backend", "torch"),
]


# ----------------------------------------------------------------- algorithm
# One typed config per algorithm lives in config/algorithms.py (re-exported here).


# -------------------------------------------------------------------- reward
class GenRMConfig(Section):
    """The judge of the `genrm` reward: a model Relax serves on judge engines of its own, started with the
    run's engines and trainers and stopped at its end."""

    model: str = Field(min_length=1)
    """Judge model: a local Hugging Face model directory (a relative path is taken from where the run starts,
    like `model.path`) or a hub id."""
    num_engines: int = Field(1, ge=1)
    """Judge engine servers (placed on the engines' node group, beside the rollout engines); each judge call
    goes to the next one in turn."""
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


# ------------------------------------------------------------------- cluster
class NodeGroup(Section):
    """One node group of the heterogeneous job."""

    nodes: int = Field(1, ge=0)
    """Number of nodes."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node used by Relax."""
    cpus_per_node: int = Field(2, ge=1)
    """CPU cores per node."""
    mem: str | None = Field(None, pattern=r"^\d+[KMGT]?$")
    """Memory per node as Slurm writes it (e.g. `480G`); the partition default if unset. Where the site
    contains jobs with cgroups (`ConstrainRAMSpace`), that default (often `DefMemPerCPU` times the cores) is
    the node's limit for Ray, the trainer ranks and the engines together: ask for what they need."""
    gpu_type: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """GPU model as the site's Slurm names it (the type in `sinfo -o %G`'s `gpu:a100:8` is `a100`): the job
    asks for `--gres=gpu:<gpu_type>:<gpus_per_node>` on each node. Any model when unset (`--gres=gpu:N`)."""
    gpu_memory_gib: float | None = Field(None, gt=0)
    """Memory of each of this group's GPUs, in GiB: the memory plan (`relax validate`) refuses a recipe whose
    trainer ranks, engines or reference workers would not fit it. From `gpu_type` when unset and the type
    names one size (h100 80, h200 141, ...: launch/memory.py); unchecked otherwise."""
    partition: str | None = None
    """This group's partition; `cluster.slurm.partition` when unset (e.g. rollout nodes in another partition)."""
    account: str | None = None
    """This group's account; `cluster.slurm.account` when unset."""
    qos: str | None = None
    """This group's quality of service; `cluster.slurm.qos` when unset."""
    constraint: str | None = None
    """This group's node features; `cluster.slurm.constraint` when unset."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set for this group's processes (e.g. NCCL settings of a partition)."""

    @model_validator(mode="after")
    def _gpu_type_needs_gpus(self) -> NodeGroup:
        if self.gpu_type and not self.gpus_per_node:
            raise ValueError(f"gpu_type is {self.gpu_type} but gpus_per_node is 0: set gpus_per_node, "
                             "or drop gpu_type")
        if self.gpu_memory_gib and not self.gpus_per_node:
            raise ValueError(f"gpu_memory_gib is {self.gpu_memory_gib:g} but gpus_per_node is 0: set gpus_per_node, "
                             "or drop gpu_memory_gib")
        return self

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def placement(self, slurm: SlurmConfig) -> dict[str, str | None]:
        """Partition, account, QOS and constraint of this group: its own, else `cluster.slurm`'s."""
        return {name: getattr(self, name) or getattr(slurm, name) for name in PLACEMENT}

    def shape(self, slurm: SlurmConfig) -> dict[str, object]:
        """What Slurm is asked for on each of this group's nodes (groups of one shape fit one plain job)."""
        return {"cpus_per_node": self.cpus_per_node, "gpus_per_node": self.gpus_per_node,
                "gpu_type": self.gpu_type, "mem": self.mem} | self.placement(slurm)


# The Slurm settings a node group may set for itself (each defaults to cluster.slurm's).
PLACEMENT = ("partition", "account", "qos", "constraint")


# Slurm accepts MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM and D-HH:MM:SS.
_SLURM_TIME = re.compile(r"^\d+(:\d{2}){0,2}$|^\d+-\d+(:\d{2}){0,2}$")
# sbatch's GPU requests: --gres, --gpus, --gpus-per-node/-task/-socket, -G.
_GPU_OPTION = re.compile(r"^(--gres(?!-flags)|--gpus|-G)")


class SlurmConfig(Section):
    """Slurm options of the job (a node group's partition, account, qos and constraint override these)."""

    partition: str | None = None
    """Partition (`-p`)."""
    account: str | None = None
    """Account to charge (`-A`)."""
    qos: str | None = None
    """Quality of service (`--qos`)."""
    time: str = "04:00:00"
    """Wall-time limit, Slurm format (`HH:MM:SS`, `D-HH:MM:SS`, or minutes)."""
    constraint: str | None = None
    """Node features (`-C`)."""
    layout: Literal["auto", "het", "single"] = "auto"
    """How the node groups become one Slurm job. `single`: one plain job of all the groups' nodes
    (`--nodes=N+M`), split by node list: train's nodes first, then rollout's, then reference's; it needs every
    group to ask for the same node shape (cpus_per_node, gpus_per_node, gpu_type, mem, partition, account,
    qos, constraint). `het`: a heterogeneous job, one component per group (each may differ; site policies
    and submit filters then apply to each component). `auto`: `single` when the shapes are the same, else
    `het`."""
    extra_sbatch: list[str] = Field(default_factory=list)
    """Extra `#SBATCH` option lines, e.g. `--exclusive` (on every component); GPUs are asked for by
    `cluster.<group>.gpus_per_node` and `gpu_type`, never here."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run before anything starts (module load, environment activation)."""
    signal_before_end_s: int = Field(300, ge=30)
    """Seconds before the time limit at which Relax checkpoints and requeues."""
    startup_timeout_s: float = Field(300.0, ge=5.0)
    """How long the job waits for every node to join its Ray cluster before it fails, naming the missing ones."""

    @field_validator("time")
    @classmethod
    def _time_format(cls, value: str) -> str:
        if not _SLURM_TIME.match(value):
            raise ValueError(f"'{value}' is not a Slurm time (use HH:MM:SS, D-HH:MM:SS or minutes)")
        return value

    @field_validator("extra_sbatch")
    @classmethod
    def _no_gpu_options(cls, value: list[str]) -> list[str]:
        for line in value:
            if _GPU_OPTION.match(line.strip()):
                raise ValueError(f"'{line}': Relax writes each group's GPU request itself (--gres=gpu:TYPE:N): "
                                 "set cluster.<group>.gpus_per_node and cluster.<group>.gpu_type (group: train, "
                                 "rollout, reference) instead")
        return value


class ContainerConfig(Section):
    """Run every step inside an Apptainer image."""

    image: str | None = None
    """Path of the `.sif` image; no container when unset."""
    binds: list[str] = Field(default_factory=list)
    """Bind mounts (`src[:dst[:opts]]`) besides those Relax adds: the run directory and every path the recipe
    names (model, tokenizer, data, environment and agent code, reward plug-ins, judge, `checkpoint.dir`, the
    hub cache), each at the same path inside."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set inside the container. The host's environment does not pass in (`--cleanenv`:
    no module's PYTHONPATH, LD_LIBRARY_PATH or NCCL_*), except what Slurm sets for the step (SLURM_*, the GPUs
    it assigned) and RELAX_*, HF_* and WANDB_*; set anything else (NCCL_SOCKET_IFNAME, ...) here."""


_INTERFACE_PATTERN = re.compile(r"[A-Za-z0-9_.:@*?\[\]-]{1,64}")


class NetworkConfig(Section):
    """Which network the job's processes talk over."""

    interface: list[str] | None = None
    """Network interfaces for Ray's node address and NCCL/Gloo sockets, in order of preference: names or shell
    patterns (`[ib0, "ib*", "eth*"]`; one name alone also works); each node takes the first that exists there
    with an IPv4 address, so node types with differently named interfaces share a recipe. Unset: the address
    the node's hostname resolves to, or where that is loopback (127.0.1.1 under Debian's /etc/hosts), the
    interface that routes to the head, the default route's, or the first other interface that is up."""

    @field_validator("interface", mode="before")
    @classmethod
    def _names_or_patterns(cls, value: Any) -> Any:
        names = [value] if isinstance(value, str) else value
        if isinstance(names, list):
            bad = [name for name in names if not isinstance(name, str) or not _INTERFACE_PATTERN.fullmatch(name)]
            if bad or not names:
                raise ValueError(f"{bad or names} is not a list of interface names or patterns (e.g. [ib0, 'eth*'])")
        return names


class ClusterConfig(Section):
    """Where the job runs."""

    executor: Literal["auto", "slurm", "local"] = "auto"
    """`slurm`, `local` (this machine), or `auto` (Slurm when `sbatch` is on PATH)."""
    train: NodeGroup = Field(default_factory=NodeGroup)
    """Training node group (het group 0)."""
    rollout: NodeGroup = Field(default_factory=lambda: NodeGroup(nodes=0))
    """Rollout node group (het group 1); may stay empty in colocate mode (engines then share the training nodes)."""
    reference: NodeGroup = Field(default_factory=lambda: NodeGroup(nodes=0))
    """Reference-model node group (het group 2; `fully_async` with a reference model only): the frozen reference
    model's workers run there, one per GPU (one per node of a CPU group). 0 nodes: no group of its own, the
    trainer ranks hold the reference model and compute its log-probs themselves."""
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    """Slurm options."""
    container: ContainerConfig = Field(default_factory=ContainerConfig)
    """Apptainer container."""
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    """Network selection."""
    hub_cache: str | None = None
    """Shared folder where `relax submit` downloads the recipe's hub models and data sets on the login node
    (compute nodes often have no internet; the job reads them from here with the hub offline); it must be
    visible from every node. Unset: `hub-cache` beside the run directory (in its parent folder)."""

    @property
    def groups(self) -> list[str]:
        """The node groups that have nodes, in het-group order: the job's het group i is `groups[i]`."""
        return [name for name in ("train", "rollout", "reference") if getattr(self, name).nodes]

    @property
    def heterogeneous(self) -> bool:
        """A heterogeneous Slurm job (one component per group), not one plain job (`cluster.slurm.layout`)."""
        return len(self.groups) > 1 and (self.slurm.layout == "het" or bool(self.shape_differences()))

    def shape_differences(self) -> list[str]:
        """Where the groups' node shapes differ, as `cluster.<group>.<field>` is X but ... is Y."""
        first, *others = self.groups or ["train"]
        shape = getattr(self, first).shape(self.slurm)
        return [f"cluster.{name}.{key} is {_unset(value)} but cluster.{first}.{key} is {_unset(shape[key])}"
                for name in others for key, value in getattr(self, name).shape(self.slurm).items()
                if value != shape[key]]

    @model_validator(mode="after")
    def _single_needs_one_shape(self) -> ClusterConfig:
        if self.slurm.layout == "single" and self.shape_differences():
            raise ValueError("slurm.layout is single (one plain job), but the node groups ask for different nodes: "
                             f"{'; '.join(self.shape_differences())}; make them the same, or set "
                             "cluster.slurm.layout to auto or het (a heterogeneous job)")
        return self


def _unset(value: object) -> object:
    return "unset" if value is None else value


# ------------------------------------------------------ checkpoint, logging
class CheckpointConfig(Section):
    """Megatron-format checkpoints."""

    dir: str | None = None
    """Checkpoint folder; `<run dir>/checkpoints` if unset."""
    interval: int = Field(50, ge=1)
    """Save every this many steps (and at the end)."""
    keep_last: int = Field(3, ge=1)
    """Checkpoints kept; older ones are deleted."""
    resume: bool = True
    """Resume from the latest checkpoint of the run directory when there is one."""


class RecoveryConfig(Section):
    """What a run does when one of its processes fails (controller/recovery.py)."""

    health_timeout_s: float = Field(60.0, gt=0.0)
    """Every engine must answer /health within this while the run generates; one that does not (hung,
    stopped) is ended and replaced. An engine that dies is replaced as soon as a request to it fails;
    either way its lost requests are sent again, so no sample is lost or trained twice."""
    max_engine_restarts: int = Field(3, ge=0)
    """Replacements of one engine within an hour; after its next failure it is left out and the run goes on
    with the other engines, or, when it was the last, ends naming the engine and its log (0: no
    replacement)."""
    max_restarts: int = Field(3, ge=0)
    """Restarts of the whole job from its latest checkpoint, inside the same driver, after a trainer rank or a
    service that holds training state died (or ran out of memory once); the next such failure ends the run
    with its cause (0: the first one does). Errors that would only happen again (a bad recipe found late,
    out of memory twice the same way) end the run at once."""


class WandbConfig(Section):
    """Weights & Biases (`logging.backends: [wandb]`)."""

    project: str | None = None
    """The W&B project (default: the recipe's name)."""


class LoggingConfig(Section):
    """Where runs and metrics go."""

    run_root: str = "runs"
    """Folder under which each run gets its own directory."""
    backends: list[Literal["tensorboard", "wandb", "clearml", "jsonl"]] = Field(
        default_factory=lambda: ["tensorboard"])
    """Where each step's metrics go besides `metrics.jsonl`, which is always written (`jsonl` may be
    listed; `[]` or `[jsonl]`: nothing else). `tensorboard`: event files in RUN/tensorboard. `wandb`:
    a W&B run in RUN/wandb, offline unless `WANDB_MODE=online` is in the driver's environment (upload it
    later with `wandb sync RUN/wandb/offline-run-*`); its id is kept in RUN/wandb_run_id, so a resumed or
    requeued run continues the same W&B run. Each is imported only when listed."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """W&B settings (read when `backends` lists wandb)."""
    notify: list[str] = Field(default_factory=list)
    """Apprise URLs that get the run's events (started, a summary every `notify_every` steps, checkpoints,
    engine restarts, stopped, requeued, finished, failed with its cause): `ntfy://`, `slack://`,
    `mailto://`, `json://host:port/path` for a webhook of one's own... Write a URL that holds a token as
    `${VARIABLE}` from the environment. A notifier that is down never slows or fails the run."""
    notify_every: int = Field(50, ge=1)
    """Steps between two summaries sent to `notify` (step, reward, throughput, staleness)."""

    @field_validator("backends")
    @classmethod
    def _each_once(cls, value: list[str]) -> list[str]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} listed more than once")
        return value

    @model_validator(mode="after")
    def _wandb_settings_need_wandb(self) -> LoggingConfig:
        if self.wandb != WandbConfig() and "wandb" not in self.backends:  # a setting nothing would read
            raise ValueError("logging.wandb is set but logging.backends does not list wandb: add wandb to "
                             "logging.backends, or drop logging.wandb")
        return self

    @field_validator("notify")
    @classmethod
    def _apprise_urls(cls, value: list[str]) -> list[str]:
        if value:
            from relax_core.metrics.notify import unusable

            bad = [value.index(url) + 1 for url in unusable(value)]
            if bad:
                schemes = ", ".join(f"entry {i} ({value[i - 1].split('://', 1)[0]}://...)" for i in bad)
                raise ValueError(f"{schemes}: not a URL Apprise can send to; see "
                                 "https://github.com/caronc/apprise/wiki for each service's form")
        return value

    @model_validator(mode="after")
    def _notify_every_needs_notify(self) -> LoggingConfig:
        if self.notify_every != 50 and not self.notify:
            raise ValueError("logging.notify_every is set but logging.notify lists no URL: add one, or drop "
                             "logging.notify_every")
        return self

    def uses(self, backend: str) -> bool:
        return backend in self.backends


# -------------------------------------------------------------------- recipe
class Recipe(Section):
    """A whole Relax job: what to train, on what, how, and where."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Run name (letters, digits, `.`, `_`, `-`)."""
    model: ModelConfig
    """The policy model."""
    data: DataConfig
    """Prompts and labels."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation."""
    train: TrainConfig = Field(default_factory=TorchTrainConfig)
    """Training backend and optimiser."""
    algorithm: AlgorithmConfig = Field(default_factory=GRPOConfig)
    """RL algorithm."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward."""
    mode: Literal[MODE_NAMES] = DEFAULT_MODE
    """`colocate` (rollout and training take turns, on-policy; engines share the training nodes unless
    a rollout group is given), `fully_async` or `hybrid` (separate rollout group, concurrent); what each
    runs where: relax_core/config/modes.py."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Nodes, Slurm, container."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoints."""
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    """Health checks and the replacement of failed processes."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Run directory and metrics."""

    @model_validator(mode="after")
    def _cross_checks(self) -> Recipe:
        problems = _mode_problems(self) + _engine_problems(self) + _train_problems(self) + _algorithm_problems(self)
        problems += _judge_problems(self) + _agent_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def samples_per_step(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.n_samples_per_prompt

    @property
    def train_ranks(self) -> int:
        """Data-parallel x model-parallel processes of the training group."""
        group = self.cluster.train
        if group.gpus_per_node:
            return group.gpus
        ranks_per_node = getattr(self.train, "cpu_ranks_per_node", 1)
        return group.nodes * ranks_per_node

    @property
    def data_parallel(self) -> int:
        mp = getattr(self.train, "model_parallel", 1)
        return max(self.train_ranks // mp, 1)


def _mode_problems(r: Recipe) -> list[str]:
    if mode_spec(r.mode).own_rollout_group and not r.cluster.rollout.nodes:
        return [f"cluster.rollout.nodes: mode {r.mode} needs a rollout node group (set it to 1 or more)"]
    return _reference_group_problems(r)


def _reference_group_problems(r: Recipe) -> list[str]:
    """A reference group serves the reference service of `fully_async`; elsewhere nothing would run on it."""
    if not r.cluster.reference.nodes:
        return []
    if not mode_spec(r.mode).field_services:
        served = " or ".join(f"mode={m.name}" for m in MODES.values() if m.field_services)
        return [f"cluster.reference.nodes: mode {r.mode} computes the reference log-probs inside the trainer's "
                f"processes, so a reference node group needs {served} (or set cluster.reference.nodes=0)"]
    if not r.algorithm.uses_reference:
        return [f"cluster.reference.nodes: algorithm {r.algorithm.name} with algorithm.kl.coef=0 uses no reference "
                "model, so a reference node group has nothing to run (set algorithm.kl.coef above 0, or "
                "cluster.reference.nodes=0)"]
    if r.cluster.train.gpus_per_node and not r.cluster.reference.gpus_per_node:
        return ["cluster.reference.gpus_per_node: the reference workers would run the model on the CPUs of a "
                "GPU recipe; give the reference group GPUs (one worker per GPU), or set cluster.reference.nodes=0 "
                "to compute the reference log-probs in the trainer ranks"]
    return []


def rollout_group_name(r: Recipe) -> str:
    """Where the engines run: the rollout group if there is one, else (colocate) the training group."""
    return "rollout" if r.cluster.rollout.nodes else "train"


def _engine_problems(r: Recipe) -> list[str]:
    ro = r.rollout
    if not engine_kind(ro.engine).on_gpus:
        if ro.gpus_per_engine:
            return [f"rollout.gpus_per_engine: the {ro.engine} engine uses no GPU; set it to 0"]
        return []
    if ro.gpus_per_engine < 1:
        return [f"rollout.gpus_per_engine: the {ro.engine} engine needs at least 1 GPU per engine"]
    return []  # whether the engines' GPUs fit their group: launch/plan.py (resource_problems, at validate)


def _train_problems(r: Recipe) -> list[str]:
    problems = []
    train, group = r.train, r.cluster.train
    if group.nodes < 1:
        problems.append("cluster.train.nodes: the training group needs at least 1 node")
    if isinstance(train, MegatronTrainConfig):
        problems += _megatron_problems(r, train)
    if not problems and r.samples_per_step % r.data_parallel:
        problems.append(
            f"rollout.prompts_per_step: {r.rollout.prompts_per_step} prompts x "
            f"{r.rollout.n_samples_per_prompt} samples = {r.samples_per_step} samples per step cannot be "
            f"split evenly over {r.data_parallel} data-parallel ranks"
        )
    return problems or _batch_problems(r)


def _megatron_problems(r: Recipe, train: MegatronTrainConfig) -> list[str]:
    """The parallel sizes must tile the trainer ranks (GPUs, or `cpu_ranks_per_node` processes per node)."""
    where = f"{r.train_ranks} training GPUs" if r.cluster.train.gpus_per_node else \
        f"{r.train_ranks} trainer ranks (cluster.train.nodes x train.cpu_ranks_per_node)"
    if r.train_ranks % train.model_parallel:
        return [f"train.tensor_parallel: tensor x pipeline x context parallel = {train.model_parallel} does not "
                f"divide the {where}"]
    problems = []
    if r.data_parallel % train.expert_parallel:
        problems.append(f"train.expert_parallel: {train.expert_parallel} does not divide the {r.data_parallel} "
                        f"data-parallel ranks ({where} / {train.model_parallel} model-parallel)")
    if train.sequence_parallel and train.tensor_parallel == 1:
        problems.append("train.sequence_parallel: needs train.tensor_parallel > 1")
    return problems


def _batch_problems(r: Recipe) -> list[str]:
    """`train.global_batch_size` cuts each step into whole optimizer steps, each split evenly over the ranks."""
    size, samples, dp = r.train.global_batch_size, r.samples_per_step, r.data_parallel
    if size is None:
        return []
    if samples % size:
        return [f"train.global_batch_size: {r.rollout.prompts_per_step} prompts x {r.rollout.n_samples_per_prompt} "
                f"samples = {samples} samples per step is not a multiple of {size} samples per optimizer step"]
    if size % dp:
        return [f"train.global_batch_size: {size} samples per optimizer step cannot be split evenly over "
                f"{dp} data-parallel ranks"]
    if r.train.micro_batch_size > size // dp:
        return [f"train.micro_batch_size: {r.train.micro_batch_size} is more than the {size} // {dp} = {size // dp} "
                f"samples each data-parallel rank has per optimizer step (train.global_batch_size / ranks)"]
    return []


def _judge_problems(r: Recipe) -> list[str]:
    """`reward.genrm` serves the `genrm` reward: set exactly when something scores with it."""
    reward, routed = r.reward, isinstance(r.data, FileData) and r.data.reward_key is not None
    if reward.genrm is not None and reward.name != "genrm" and not routed:
        return [f"reward.genrm: a judge model is set, but reward.name is '{reward.name}' and no data.reward_key "
                "column routes rows to rewards, so no sample would be judged: set reward.name=genrm, or remove "
                "reward.genrm"]
    if reward.name == "genrm" and reward.genrm is None and not os.environ.get("RELAX_GENRM_URL"):
        return ["reward.genrm.model: reward genrm needs a judge model: set reward.genrm.model to a model "
                "directory or hub id (Relax starts and stops its engines), or export RELAX_GENRM_URL with the "
                "address of a judge server of your own"]
    return []


def _agent_problems(r: Recipe) -> list[str]:
    if r.rollout.agent is not None and not r.data.apply_chat_template:
        return ["data.apply_chat_template: an agent program sends chat messages, which only the chat template turns "
                "into tokens; set it to true"]
    return []


def _algorithm_problems(r: Recipe) -> list[str]:
    return algorithm_problems(
        r.algorithm,
        mode=r.mode,
        group_size=r.rollout.n_samples_per_prompt,
        max_new_tokens=r.rollout.max_new_tokens,
    )
