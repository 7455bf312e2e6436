"""The recipe's `train:` section: the optimiser and batch sizes every backend shares, and each backend's own
settings (torch/FSDP2, megatron-core's parallel sizes), picked by `backend`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Tag

from relax_core.config.section import Section, tagged


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
    tagged("backend", "torch"),
]
