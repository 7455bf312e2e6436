"""The recipe schema: `Recipe`, the whole job, and the checks that read more than one of its sections.

A recipe is YAML validated against `Recipe`. Each section is declared in a
module of its own, named after it: model.py, data.py, rollout.py, train.py,
algorithms.py, reward.py, cluster.py, checkpoint.py (with `recovery`) and
logs.py (`logging`), on section.py's base. Loading (files, dotted overrides,
error messages) is in `loader.py`. This module imports pydantic and nothing
heavy, so the CLI can validate a recipe on a login node in milliseconds.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator

from relax_core.config.algorithms import AlgorithmConfig, GRPOConfig, algorithm_problems
from relax_core.config.checkpoint import CheckpointConfig, RecoveryConfig
from relax_core.config.cluster import ClusterConfig
from relax_core.config.data import DataConfig, FileData
from relax_core.config.engines import engine_kind
from relax_core.config.logs import LoggingConfig
from relax_core.config.model import ModelConfig
from relax_core.config.modes import DEFAULT_MODE, MODE_NAMES, MODES, mode_spec
from relax_core.config.reward import RewardConfig
from relax_core.config.rollout import RolloutConfig
from relax_core.config.section import Section
from relax_core.config.train import MegatronTrainConfig, TorchTrainConfig, TrainConfig


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
    if r.rollout.max_queue_mb is not None and not mode_spec(r.mode).bus:
        queued = " or ".join(f"mode={m.name}" for m in MODES.values() if m.bus)
        return [f"rollout.max_queue_mb: mode {r.mode} queues no samples (each step is generated, then trained); "
                f"it bounds TransferQueue in {queued}: remove it"]
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
