"""Torch training backend: a Hugging Face causal LM trained with the algorithm suite's losses.

The CPU counterpart of the Megatron backend: the step itself (mini-batches, advantages, the loss,
metrics) is `PolicyTrainer`'s (step.py); here are the forwards and backwards of a Hugging Face model,
data-parallel over a torch.distributed group (gloo on CPUs), optionally sharded with FSDP2
(sharding.py). Each update accumulates the loss's gradients over the micro-batches, sums them over
the ranks (FSDP's reduce-scatter, or one flat all-reduce) and takes an AdamW step. Weight sync reads
`named_parameters_for_sync`, checkpointing `state_dict`/`load_state_dict`; PPO's critic is critic.py's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from relax_core.data.sample import Sample
from relax_core.models.multimodal import pad_token_id
from relax_core.train import sharding
from relax_core.train.batching import MicroBatch, forward_logprobs
from relax_core.train.config import TorchTrainerConfig
from relax_core.train.critic import Critic
from relax_core.train.offload import StorageOffload, module_tensors, optimizer_tensors
from relax_core.train.optim import build_optimizer, build_scheduler
from relax_core.train.step import Micro, Mini, PolicyTrainer
from relax_core.train.step_metrics import SUMS


def load_causal_lm(path: str | Path, dtype: str, device: str = "cpu", trust_remote_code: bool = False, *,
                   weights: bool = True) -> torch.nn.Module:
    """Load the policy (an HF causal LM; Qwen3-VL, or the Qwen3-Omni thinker: `models/multimodal.py`) in eval
    mode (dropout off: log-probs must match the engine's); `weights=False`: built without its weights, its
    parameters on the meta device. A packed micro-batch's samples are attended one by one (`varlen.py`)."""
    from relax_core.models.multimodal import load_policy
    from relax_core.train.varlen import use_varlen

    model = load_policy(path, dtype, device, trust_remote_code, weights=weights)
    use_varlen(model)
    return model


class TorchTrainer(PolicyTrainer):
    """Trains one HF causal LM, data-parallel over a torch.distributed group.

    Args:
        model_path: HF model directory (config.json, safetensors, tokenizer).
        config: optimizer/loss settings.
        ref_model_path: frozen reference model for the KL (loss term or in the
            reward); defaults to `model_path` (the initial policy). Loaded only
            when a KL is on or `config.use_reference` is set.
        process_group: data-parallel group; None = the default group if
            torch.distributed is initialised, else a single process.
    """

    def __init__(
        self,
        model_path: str | Path,
        config: TorchTrainerConfig | None = None,
        *,
        ref_model_path: str | Path | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(config or TorchTrainerConfig())
        cfg = self.config
        self.group = process_group
        # The parameters are float32 master weights, computed in `cfg.dtype` (sharding.build).
        self.model = sharding.build(
            functools.partial(load_causal_lm, model_path, "float32", trust_remote_code=cfg.trust_remote_code),
            fsdp=cfg.fsdp, recompute=cfg.recompute_activations, group=self.group, device=cfg.device,
            compute_dtype=getattr(torch, cfg.dtype), freeze=self._freeze_encoders)
        # With a reference service (fully_async) the reference log-probs come with the samples instead.
        if self._loads_reference:
            self.ref_model = load_causal_lm(
                ref_model_path or model_path, cfg.dtype, cfg.device, cfg.trust_remote_code
            )
            self.ref_model.requires_grad_(False)
        if cfg.teacher_path:
            self.teacher = load_causal_lm(cfg.teacher_path, cfg.teacher_dtype, cfg.device, cfg.trust_remote_code)
            self.teacher.requires_grad_(False)
        self.critic = Critic.from_config(model_path, cfg, self.group) if cfg.critic_lr is not None else None
        self.pad_id = pad_token_id(self.model)
        self.optimizer = build_optimizer(
            self.model.named_parameters(),
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=tuple(cfg.betas),
            eps=cfg.adam_eps,
        )
        self.scheduler = self._build_scheduler(self.optimizer)

    def _build_scheduler(self, optimizer):
        cfg = self.config
        return build_scheduler(optimizer, cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                               total_steps=cfg.total_steps, min_lr_ratio=cfg.min_lr_ratio)

    def _freeze_encoders(self, model: torch.nn.Module) -> None:
        """`train.freeze_vision` / `freeze_audio`: the encoder parameters kept as loaded (`self.frozen`)."""
        cfg = self.config
        if cfg.freeze_vision or cfg.freeze_audio:
            from relax_core.models.multimodal import freeze

            self.frozen = freeze(model, vision=cfg.freeze_vision, audio=cfg.freeze_audio)

    # ------------------------------------------------------------ passes
    @property
    def sharded(self) -> bool:
        return self.config.fsdp

    def _idle_pass(self, *, backward: bool) -> None:
        """A pass over a one-token batch that learns nothing (zero gradient), so this rank joins the
        all-gathers and reduce-scatters of a pass the other ranks run on real micro-batches."""
        logp, _ = forward_logprobs(self.model, self._idle_batch())
        if backward:
            (logp.sum() * 0.0).backward()

    def _policy_logprobs(self, batches: list[MicroBatch], passes: int) -> list[torch.Tensor]:
        """`[B, R]` log-probs of each batch, then idle passes up to `passes` (sharded: the other ranks')."""
        logps = [forward_logprobs(self.model, mb)[0] for mb in batches]
        for _ in range(passes - len(batches)):
            self._idle_pass(backward=False)
        return logps

    # ------------------------------------------------------------ updates
    @torch.no_grad()
    def _prepare(self, samples: Sequence[Sample], ref_rows: Sequence[Sequence[float]] | None = None,
                 passes: int = 0) -> list[Micro]:
        """Pack one mini-batch and compute logp_old (when needed), logp_ref and the critic's values per
        micro-batch, with the weights the step starts from (`ref_rows`: the reference service's numbers
        for these samples, instead of a forward here)."""
        micros = []
        bounds = self._micro_bounds(samples)
        for a, b in zip(bounds, bounds[1:]):
            mb = self._pack(samples[a:b])
            logp_old = forward_logprobs(self.model, mb)[0] if self._recomputes_logp_old else None
            if ref_rows is not None:
                logp_ref = self._given_rows(ref_rows, a, b, mb)
            else:
                logp_ref = forward_logprobs(self.ref_model, mb)[0] if self.ref_model is not None else None
            logp_teacher = forward_logprobs(self.teacher, mb)[0] if self.teacher is not None else None
            values = self.critic.values(mb) if self.critic is not None else None
            micros.append(Micro(mb, logp_old, logp_ref, logp_teacher, values))
        for _ in range(passes - len(micros) if self.sharded else 0):  # join the other ranks' gathers
            if self._recomputes_logp_old:
                self._idle_pass(backward=False)
            if self.critic is not None:
                self.critic.idle_pass(self._idle_batch(), backward=False)
        return micros

    def _update(self, mini: Mini) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Accumulate gradients over the micro-batches, all-reduce, clip, step.

        Returns the all-reduced metric sums, this rank's ratio extremes
        `[-min, max]` and the gradient norm before clipping.
        """
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(len(SUMS), dtype=torch.float64, device=self.device)
        extremes = torch.full((2,), -math.inf, dtype=torch.float64, device=self.device)
        for micro in mini.micros:
            loss, parts, micro_extremes = self._micro_loss(micro, mini)
            loss.backward()
            sums += parts
            extremes = torch.maximum(extremes, micro_extremes)
        if self.sharded:  # FSDP reduce-scattered (summed) each backward's gradients
            for _ in range(mini.passes - len(mini.micros)):
                self._idle_pass(backward=True)
        else:
            self._all_reduce_grads()
        self._all_reduce(sums)
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        if self.sharded:
            grad_norm = sharding.clip_grad_norm(params, max_norm, self.group)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).detach()
        self.optimizer.step()
        return sums, extremes, grad_norm

    def _micro_loss(
        self, micro: Micro, mini: Mini
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This micro-batch's contribution to the mini-batch loss, its metric sums and ratio extremes."""
        logp, entropy = forward_logprobs(self.model, micro.mb, with_entropy=True)
        return self.loss_from(logp, entropy, micro, mini)

    def _critic_update(self, mini: Mini) -> torch.Tensor:
        """One critic optimizer step on the mini-batch (token-mean clipped value loss); its metric sums.
        Unsharded, its gradients are summed over the ranks here; sharded, FSDP did in each backward."""
        def reduce(sums: torch.Tensor) -> None:
            if not self.critic.sharded:
                self._all_reduce_grads(self.critic.parameters())
            self._all_reduce(sums)

        micros = [(micro.mb, micro.values, micro.returns) for micro in mini.micros]
        return self.critic.step(micros, mini.tokens, self.config.grad_clip, reduce, passes=mini.passes,
                                idle=self._idle_batch())

    def _all_reduce_grads(self, params: list | None = None) -> None:
        """Sum gradients over ranks in one flat buffer (ranks with no samples contribute zeros)."""
        if not (self.distributed and self.world_size > 1):
            return
        if params is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    # ------------------------------------------------- GPU memory (colocate)
    def _offload(self, store: StorageOffload, parts: Sequence[str]) -> None:
        """"optimizer": the gradients go, the optimizer's and the critic's state and the reference and teacher
        models; "model": the policy's parameters."""
        if "optimizer" in parts:
            self.optimizer.zero_grad(set_to_none=True)
            tensors = optimizer_tensors(self.optimizer) + module_tensors(self.ref_model) + \
                module_tensors(self.teacher)
            if self.critic is not None:
                self.critic.optimizer.zero_grad(set_to_none=True)
                tensors += optimizer_tensors(self.critic.optimizer) + module_tensors(self.critic.model)
            store.offload(tensors)
        if "model" in parts:
            store.offload(module_tensors(self.model))

    # --------------------------------------------------- sync and checkpoint
    def named_parameters_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, detached tensor) for every parameter, as the engine loads them.

        Names are the model's own `named_parameters()` names, i.e. the keys of
        the HF safetensors checkpoint (tied weights appear once). Sharded,
        each is gathered whole (one parameter at a time, so a bucket of them
        is all that is ever held besides the shards) and cast to the compute
        dtype; every rank must then iterate it, in step. Frozen encoders
        (`train.freeze_vision` / `freeze_audio`) are left out: every engine
        loaded them from the same model directory, and they never change.
        """
        dtype = getattr(torch, self.config.dtype)
        frozen = set(self.frozen)
        for name, param in self.model.named_parameters():
            if name not in frozen:
                yield name, sharding.full(param.detach()).to(dtype)

    def state_dict(self) -> dict:
        """Model, optimizer and scheduler state plus the step counter (for checkpointing).

        Sharded, model and optimizer state are this rank's shards (DTensors, which the checkpoint
        saves as one tensor each) and the optimizer's are keyed by parameter name (torch's
        `get_state_dict`, which also gives a fresh optimizer its moments, to be loaded into).
        """
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model, optimizer = get_state_dict(self.model, self.optimizer)
        else:
            model, optimizer = self.model.state_dict(), self.optimizer.state_dict()
        return {
            "model": model,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            **({"critic": self.critic.state_dict()} if self.critic is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned (any subset of its keys)."""
        if self.sharded and ("model" in state or "optimizer" in state):
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(self.model, self.optimizer, model_state_dict=state.get("model", {}),
                           optim_state_dict=state.get("optimizer", {}))
        else:
            if "model" in state:
                self.model.load_state_dict(state["model"])
            if "optimizer" in state:
                self.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if "critic" in state and self.critic is not None:
            self.critic.load_state_dict(state["critic"])
        self.step = int(state.get("step", self.step))
