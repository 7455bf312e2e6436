"""The recipe's `rollout:` section: the engines, sampling, staleness, and the multi-turn parts (an environment
or an agent program) that drive a trajectory's turns."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from relax_core.config.engines import ENGINE_KINDS
from relax_core.config.section import Section


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
    max_queue_mb: float | None = Field(None, gt=0)
    """`fully_async`/`hybrid`: the most MiB of samples TransferQueue holds for the trainer (the rollout
    columns and media the rollout put, of the steps not yet trained): the rollout starts no further step while
    they hold more, so long responses or large media cannot fill the storage units' memory however far
    `max_staleness` would let it run ahead. Null: only `max_staleness` bounds the queue."""
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
