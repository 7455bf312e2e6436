"""Torch training backend: a Hugging Face causal LM trained with the algorithm suite's losses.

The CPU counterpart of the Megatron backend. The controller hands each
data-parallel rank its shard of a step's `Sample`s; `train_step` recomputes
the old (and reference) log-probs, computes per-token advantages with the
algorithm's estimator over the whole step (all ranks; step_advantages.py),
accumulates the algorithm's policy loss over micro-batches, all-reduces the gradients over the
process group (gloo here) and takes an AdamW step. Weight sync reads
`named_parameters_for_sync`, checkpointing `state_dict`/`load_state_dict`.

A step may take several optimizer steps (`num_mini_batches` x
`num_epochs`, the recipe's `train.global_batch_size` and `train.ppo_epochs`):
each rank splits its shard into `num_mini_batches` contiguous mini-batches,
so optimizer step k sees the k-th mini-batch of every rank. The old
log-probs (and the critic's old values) are computed once, with the step's
initial weights, before the first update; from the second update on the
ratio pi/pi_old leaves 1 and the clip ranges act. A step with fewer samples
than the recipe's (DAPO dynamic sampling that ran out of rounds) keeps the
number of optimizer steps and makes each mini-batch smaller; a mini-batch
that is empty on every rank is skipped.

With a critic (PPO, critic.py) the step also reads its values before the
update (they feed GAE) and takes one critic optimizer step per mini-batch
after the policy's; a teacher (on-policy distillation) adds its log-probs.

Loss normalisers (token and sequence counts) are summed over every
micro-batch and rank of a mini-batch before the first backward, and gradients
are summed (not averaged) across ranks, so the update does not depend on how
the batch was split (see algorithms/aggregation.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from relax_core.algorithms import registry
from relax_core.algorithms.losses import tis_weight
from relax_core.config.algorithm_specs import get_spec
from relax_core.data.sample import Sample
from relax_core.models.multimodal import pad_token_id
from relax_core.train import sharding
from relax_core.train.batching import (
    MicroBatch,
    forward_logprobs,
    micro_bounds,
    pack,
    shard_bounds,
)
from relax_core.train.config import TorchTrainerConfig
from relax_core.train.critic import Critic, critic_metrics
from relax_core.train.offload import StorageOffload, module_tensors, optimizer_tensors
from relax_core.train.optim import build_optimizer, build_scheduler
from relax_core.train.step_advantages import StepResult, StepRows, pad_rows, step_advantages

# Order of the per-update metric sums that are all-reduced in one tensor.
_SUMS = ("pg_loss", "kl_loss", "clipped", "entropy", "kl", "tis", "ratio", "tokens")


@dataclass
class _Micro:
    """A packed micro-batch with the per-step constants of its samples."""

    mb: MicroBatch
    logp_old: (
        torch.Tensor | None
    )  # [B, R]; None: take the update forward's own (see _on_policy)
    logp_ref: torch.Tensor | None  # [B, R]
    logp_teacher: torch.Tensor | None = None  # [B, R] (opd)
    values: torch.Tensor | None = None  # [B, R] critic values before the step (ppo)
    returns: torch.Tensor | None = None  # [B, R] gae returns, the critic's target
    advantages: torch.Tensor | None = None  # [B, R], set once the step's advantages are known
    keep: torch.Tensor | None = None  # [B, R] M2PO's kept tokens; None = all


@dataclass
class _Mini:
    """The micro-batches of one optimizer step and the step-global normalisers."""

    micros: list[_Micro]
    tokens: float
    seqs: float
    norm_len: float
    passes: int = 0  # sharded: forward/backward passes every rank runs (the most micro-batches of any rank)


@dataclass
class _Totals:
    """What a step's updates add up to, kept on the trainer's device until the step ends (one host copy
    then, not one per micro-batch): policy metric sums, grad norms, the ratio's range, critic sums."""

    sums: torch.Tensor | None = None  # float64 [len(_SUMS)]
    extremes: torch.Tensor | None = None  # float64 [-min, max] of the ratio over masked tokens (one MAX all-reduce)
    grad_norms: list[torch.Tensor | float] = field(default_factory=list)
    critic: torch.Tensor | None = None  # float64 [loss, clipped, tokens]
    critic_updates: int = 0

    def add_policy(self, sums: torch.Tensor, extremes: torch.Tensor, grad_norm: torch.Tensor | float) -> None:
        self.sums = sums if self.sums is None else self.sums + sums
        self.extremes = extremes if self.extremes is None else torch.maximum(self.extremes, extremes)
        self.grad_norms.append(grad_norm)

    def add_critic(self, sums: torch.Tensor) -> None:
        self.critic = sums if self.critic is None else self.critic + sums
        self.critic_updates += 1


def _ratio_extremes(ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[-min, max]` of the ratio over the masked tokens (-inf, -inf when there are none), float64 on the
    ratio's device (no host copy: a selection by the mask would need one for its size)."""
    picked = mask.bool()
    ratio = ratio.detach().to(torch.float64)
    none = torch.full_like(ratio, -math.inf)
    return torch.stack([torch.where(picked, -ratio, none).amax(), torch.where(picked, ratio, none).amax()]) \
        if ratio.numel() else torch.full((2,), -math.inf, dtype=torch.float64, device=ratio.device)


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


class TorchTrainer:
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
        self.config = config or TorchTrainerConfig()
        cfg = self.config
        torch.manual_seed(cfg.seed)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.group = process_group
        # The parameters are float32 master weights, computed in `cfg.dtype` (sharding.build).
        self.frozen: list[str] = []
        self.model = sharding.build(
            functools.partial(load_causal_lm, model_path, "float32", trust_remote_code=cfg.trust_remote_code),
            fsdp=cfg.fsdp, recompute=cfg.recompute_activations, group=self.group, device=cfg.device,
            compute_dtype=getattr(torch, cfg.dtype), freeze=self._freeze_encoders)
        self.ref_model = None
        # With a reference service (fully_async) the reference log-probs come with the samples instead.
        if (cfg.use_kl_loss or cfg.use_reference or self._kl_in_reward) and not cfg.reference_service:
            self.ref_model = load_causal_lm(
                ref_model_path or model_path, cfg.dtype, cfg.device, cfg.trust_remote_code
            )
            self.ref_model.requires_grad_(False)
        self.teacher = None
        if cfg.teacher_path:
            self.teacher = load_causal_lm(cfg.teacher_path, cfg.teacher_dtype, cfg.device, cfg.trust_remote_code)
            self.teacher.requires_grad_(False)
        self.critic = Critic.from_config(model_path, cfg, self.group) if cfg.critic_lr is not None else None
        self.last_returns: list[list[float]] | None = None  # this rank's GAE returns of the last step
        self._offloaded: StorageOffload | None = None  # what `offload` handed back (colocate on GPU nodes)
        self.pad_id = pad_token_id(self.model)
        self.optimizer = build_optimizer(
            self.model.named_parameters(),
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=tuple(cfg.betas),
            eps=cfg.adam_eps,
        )
        self.scheduler = self._build_scheduler(self.optimizer)
        self._init_algorithm()

    def _build_scheduler(self, optimizer):
        cfg = self.config
        return build_scheduler(optimizer, cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                               total_steps=cfg.total_steps, min_lr_ratio=cfg.min_lr_ratio)

    def _init_algorithm(self) -> None:
        """The algorithm's estimator, policy loss, token selection, aggregation and KL estimator."""
        cfg = self.config
        self.step = 0
        self.spec = spec = get_spec(cfg.algorithm)
        self._estimator = registry.get_estimator(spec.advantage_estimator)
        self._policy_loss = registry.get_loss(spec.policy_loss)
        # A token selection (M2PO) runs over the whole step, not per micro-batch.
        self._select = None
        if spec.token_selection:
            self._select = functools.partial(registry.get_token_selection(spec.token_selection),
                                             **cfg.selection_kwargs)
        self._agg = registry.get_loss_aggregator(cfg.loss_agg or spec.loss_agg)
        self._kl_fn = registry.get_kl_estimator(cfg.kl_estimator)

    def _freeze_encoders(self, model: torch.nn.Module) -> None:
        """`train.freeze_vision` / `freeze_audio`: the encoder parameters kept as loaded (`self.frozen`)."""
        cfg = self.config
        if cfg.freeze_vision or cfg.freeze_audio:
            from relax_core.models.multimodal import freeze

            self.frozen = freeze(model, vision=cfg.freeze_vision, audio=cfg.freeze_audio)

    @property
    def device(self) -> torch.device:
        return torch.device(self.config.device)

    # ----------------------------------------------------------- distributed
    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.distributed else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if self.distributed else 1

    def _all_reduce(self, tensor: torch.Tensor, op=None) -> torch.Tensor:
        """In place, over the ranks; a CPU tensor (a metric sum, a count) travels through the device when the
        group is NCCL's."""
        if self.distributed and self.world_size > 1:
            op = op or dist.ReduceOp.SUM
            if tensor.device.type == "cpu" and dist.get_backend(self.group) == "nccl":
                moved = tensor.to(self.config.device)
                dist.all_reduce(moved, op=op, group=self.group)
                tensor.copy_(moved)
            else:
                dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def _all_gather(self, obj: object) -> list:
        if not (self.distributed and self.world_size > 1):
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    # ------------------------------------------------------------- log-probs
    def _pack(self, samples: Sequence[Sample]) -> MicroBatch:
        return pack(samples, self.pad_id, self.config.device, packed=self.config.max_tokens_per_micro_batch is not None)

    def _micro_bounds(self, samples: Sequence[Sample]) -> list[int]:
        cfg = self.config
        return micro_bounds(samples, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Log-prob (temperature 1) of every response token of every sample, under the current policy.
        Sharded, every rank calls it (with its own samples)."""
        result: list[list[float]] = []
        bounds = self._micro_bounds(samples)
        for a, b in zip(bounds, bounds[1:]):
            mb = self._pack(samples[a:b])
            logp, _ = forward_logprobs(self.model, mb)
            result.extend(mb.response_lists(logp))
        for _ in range(self._passes([len(bounds) - 1])[0] - (len(bounds) - 1)):
            self._idle_pass(backward=False)
        return result

    # ------------------------------------------------------------ sharded
    @property
    def sharded(self) -> bool:
        return self.config.fsdp

    def _passes(self, counts: list[int]) -> list[int]:
        """Sharded: the most micro-batches any rank has in each mini-batch (every rank runs that many)."""
        if not self.sharded:
            return counts
        most = self._all_reduce(torch.tensor(counts, dtype=torch.float64), dist.ReduceOp.MAX)
        return [int(n) for n in most.tolist()]

    def _idle_pass(self, *, backward: bool) -> None:
        """A pass over a one-token batch that learns nothing (zero gradient), so this rank joins the
        all-gathers and reduce-scatters of a pass the other ranks run on real micro-batches."""
        logp, _ = forward_logprobs(self.model, self._idle_batch())
        if backward:
            (logp.sum() * 0.0).backward()

    def _idle_batch(self) -> MicroBatch:
        idle = Sample(prompt_ids=[self.pad_id], response_ids=[self.pad_id], rollout_logprobs=[0.0], loss_mask=[0])
        return self._pack([idle])

    # ------------------------------------------------------------ train step
    def train_step(
        self, samples: Sequence[Sample], advantages: Sequence[float] | None = None,
        ref_logprobs: Sequence[Sequence[float]] | None = None,
    ) -> dict[str, float]:
        """One training step on this rank's shard of the step's samples.

        Every rank of the group must call it (with its own, possibly empty,
        shard). Advantages come from the configured estimator over the rewards
        of all ranks' samples (groups may span ranks), unless `advantages`
        (one per local sample, e.g. from an advantage worker) is given.
        `ref_logprobs` (one list per local sample, per response token, from
        the reference service) replace the trainer's own reference forward;
        required when the config says `reference_service`. logp_old (the
        anchor of the ratio and of the importance weight) and PPO's values
        are always computed here, with the weights the step starts from:
        the metric `logp_old_version` says which (`self.step` before it).

        Returns:
            Metrics, equal on all ranks: loss, pg_loss, kl_loss, kl, clipfrac,
            ratio_mean/min/max (pi/pi_old over the learned tokens; min/max
            absent when none were learned), entropy, tis_weight (if TIS),
            grad_norm, lr, optimizer_steps, num_tokens, num_samples,
            reward_mean, logp_old_version, and with a critic value_loss and
            vf_clipfrac.
            Token-level ones are token-means over all updates of the step;
            losses and grad_norm are means over its optimizer steps.
        """
        cfg = self.config
        if cfg.reference_service and ref_logprobs is None and (cfg.use_kl_loss or self._kl_in_reward):
            raise ValueError("the reference log-probs come from the reference service: pass ref_logprobs")
        minis, step_info = self._minis(samples, advantages, ref_logprobs)
        step_info["logp_old_version"] = float(self.step)
        lr = self.scheduler.get_last_lr()[0]
        totals = _Totals()
        train_policy = not self._has_critic or self.step >= cfg.critic_warmup_steps
        for _ in range(cfg.num_epochs):
            for mini in minis:
                if train_policy:
                    totals.add_policy(*self._update(mini))
                if self.critic is not None:
                    totals.add_critic(self._critic_update(mini))
        if totals.extremes is not None:
            self._all_reduce(totals.extremes, dist.ReduceOp.MAX)
        self.scheduler.step()
        self.step += 1
        return self._metrics(totals, lr, step_info)

    def _minis(self, samples: Sequence[Sample], advantages: Sequence[float] | None,
               ref_logprobs: Sequence[Sequence[float]] | None = None) -> tuple[list[_Mini], dict]:
        """This rank's shard cut into `num_mini_batches` mini-batches, all prepared before any update.

        logp_old, logp_ref and the critic's values of every mini-batch are
        computed here, with the step's initial weights. Mini-batches empty on
        every rank (a step with fewer samples than mini-batches) are dropped
        on all ranks alike: their normalisers are all-reduced.
        """
        bounds = shard_bounds(len(samples), self.config.num_mini_batches)
        parts = [samples[a:b] for a, b in zip(bounds, bounds[1:])]
        def cut(rows):
            return [rows[a:b] if rows is not None else None for a, b in zip(bounds, bounds[1:])]

        passes = self._passes([len(self._micro_bounds(part)) - 1 for part in parts])
        micro_lists = [self._prepare(part, ref, passes=n) for part, ref, n in zip(parts, cut(ref_logprobs), passes)]
        step_info = self._set_advantages(samples, [m for ms in micro_lists for m in ms], advantages)
        minis = [self._normalisers(ms, part, n) for ms, part, n in zip(micro_lists, parts, passes)]
        return [mini for mini in minis if mini.seqs > 0], step_info

    @property
    def _has_critic(self) -> bool:
        """PPO: a critic is trained."""
        return self.config.critic_lr is not None

    @property
    def _kl_in_reward(self) -> bool:
        return float(self.config.estimator_kwargs.get("kl_coef", 0.0)) > 0

    @property
    def _recomputes_logp_old(self) -> bool:
        """logp_old needs a forward of its own before the first update (not the update's own, detached)."""
        return self._needs_logp_old or not self._on_policy

    @property
    def _needs_logp_old(self) -> bool:
        """The estimator or the token selection reads logp_old before the update."""
        return self.spec.needs_logp_old or self._kl_in_reward or self._select is not None

    def _step_rows(self, samples: Sequence[Sample], micros: list[_Micro]) -> StepRows:
        """This rank's inputs of the step's estimator, as per-sample lists."""
        rows = StepRows([s.reward for s in samples], [s.group_id for s in samples], {"mask": []})
        wanted = {"kl": self._kl_in_reward, "logp": self._needs_logp_old,
                  "logp_rollout": self._select is not None, "logp_teacher": self.teacher is not None,
                  "values": self._has_critic}
        rows.tokens.update({key: [] for key, on in wanted.items() if on})
        for micro in micros:
            mb = micro.mb
            rows.tokens["mask"] += mb.response_lists(mb.loss_mask)
            if wanted["kl"]:
                rows.tokens["kl"] += mb.response_lists(self._kl_fn(micro.logp_old, micro.logp_ref))
            if wanted["logp"]:
                rows.tokens["logp"] += mb.response_lists(micro.logp_old)
            if wanted["logp_rollout"]:
                rows.tokens["logp_rollout"] += mb.response_lists(mb.rollout_logprobs)
            if wanted["logp_teacher"]:
                rows.tokens["logp_teacher"] += mb.response_lists(micro.logp_teacher)
            if wanted["values"]:
                rows.tokens["values"] += mb.response_lists(micro.values)
        return rows

    def _set_advantages(
        self, samples: Sequence[Sample], micros: list[_Micro], given: Sequence[float] | None
    ) -> dict[str, float]:
        """Fill each micro-batch's `[B, R]` advantages (and M2PO keep mask); return reward statistics."""
        local = self._step_rows(samples, micros)
        gathered = self._all_gather(local)
        step = StepRows.concat(gathered)
        info = {
            "reward_mean": sum(step.rewards) / len(step.rewards) if step.rewards else 0.0,
            "num_samples": float(len(step.rewards)),
        }
        if given is not None:
            if len(given) != len(samples):
                raise ValueError(f"got {len(given)} advantages for {len(samples)} samples")
            result = StepResult([[float(a)] * len(m) for a, m in zip(given, local.tokens["mask"])])
        else:
            result = step_advantages(self._estimator, self.config.estimator_kwargs, step, select=self._select)
            offset = sum(len(part.rewards) for part in gathered[: self.rank])
            result = result.rows(offset, offset + len(samples))
        self.last_returns = result.returns
        if self._has_critic and result.returns is None:
            raise ValueError(f"the critic needs returns; estimator {self.spec.advantage_estimator} gives none")
        start, device = 0, self.config.device
        for micro in micros:
            n, width = micro.mb.loss_mask.shape
            part = result.rows(start, start + n)
            micro.advantages = pad_rows(part.advantages, width).to(device)
            micro.keep = pad_rows(part.keep, width).to(device) if part.keep is not None else None
            micro.returns = pad_rows(part.returns, width).to(device) if part.returns is not None else None
            start += n
        return info

    @property
    def _on_policy(self) -> bool:
        """One update per step: logp_old is the update forward's own log-prob, detached.

        The weights have not changed since the batch was packed, so a separate
        no-grad forward would give exactly the same numbers; skipping it saves
        a third of the step's compute.
        """
        return self.config.num_mini_batches == 1 and self.config.num_epochs == 1

    @torch.no_grad()
    def _prepare(self, samples: Sequence[Sample], ref_rows: Sequence[Sequence[float]] | None = None,
                 passes: int = 0) -> list[_Micro]:
        """Pack one mini-batch and compute logp_old (when needed), logp_ref and the critic's values per
        micro-batch, with the weights the step starts from (`ref_rows`: the reference service's numbers
        for these samples, instead of a forward here)."""
        cfg = self.config
        micros = []
        bounds = self._micro_bounds(samples)

        def given(rows, a: int, b: int, mb: MicroBatch) -> torch.Tensor:
            return pad_rows([list(r) for r in rows[a:b]], mb.loss_mask.shape[1]).to(cfg.device)

        for a, b in zip(bounds, bounds[1:]):
            mb = self._pack(samples[a:b])
            logp_old = forward_logprobs(self.model, mb)[0] if self._recomputes_logp_old else None
            if ref_rows is not None:
                logp_ref = given(ref_rows, a, b, mb)
            else:
                logp_ref = forward_logprobs(self.ref_model, mb)[0] if self.ref_model is not None else None
            logp_teacher = forward_logprobs(self.teacher, mb)[0] if self.teacher is not None else None
            values = self.critic.values(mb) if self.critic is not None else None
            micros.append(_Micro(mb, logp_old, logp_ref, logp_teacher, values))
        for _ in range(passes - len(micros) if self.sharded else 0):  # join the other ranks' gathers
            if self._recomputes_logp_old:
                self._idle_pass(backward=False)
            if self.critic is not None:
                self.critic.idle_pass(self._idle_batch(), backward=False)
        return micros

    def _normalisers(self, micros: list[_Micro], samples: Sequence[Sample], passes: int = 0) -> _Mini:
        """The mini-batch's step-global token count (kept tokens for M2PO), sequence count and norm_len."""
        cfg = self.config
        tokens = sum(float((m.mb.loss_mask * (m.keep if m.keep is not None else 1.0)).sum()) for m in micros)
        counts = torch.tensor([tokens, float(len(samples))], dtype=torch.float64)
        max_len = torch.tensor([max([s.response_len for s in samples] + [0])], dtype=torch.float64)
        self._all_reduce(counts)
        self._all_reduce(max_len, dist.ReduceOp.MAX)
        norm_len = float(cfg.norm_len) if cfg.norm_len else float(max_len)
        return _Mini(micros, float(counts[0]), float(counts[1]), norm_len, passes)

    def _update(self, mini: _Mini) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Accumulate gradients over the micro-batches, all-reduce, clip, step.

        Returns the all-reduced metric sums, this rank's ratio extremes
        `[-min, max]` and the gradient norm before clipping.
        """
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=self.device)
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
        self, micro: _Micro, mini: _Mini
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This micro-batch's contribution to the mini-batch loss, its metric sums and ratio extremes."""
        logp, entropy = forward_logprobs(self.model, micro.mb, with_entropy=True)
        return self._loss_from(logp, entropy, micro, mini)

    def _loss_from(self, logp: torch.Tensor, entropy: torch.Tensor, micro: _Micro, mini: _Mini
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_micro_loss` given the update forward's log-probs and entropy (a backend with its own
        forward, such as Megatron's pipeline schedule, calls this from its loss function)."""
        cfg, mb = self.config, micro.mb
        logp_old = logp.detach() if micro.logp_old is None else micro.logp_old
        mask = mb.loss_mask if micro.keep is None else mb.loss_mask * micro.keep
        out = self._policy_loss(logp, logp_old, micro.advantages, mask=mb.loss_mask,
                                logp_rollout=mb.rollout_logprobs, **self.config.loss_kwargs)
        per_token = out.loss
        weight = None
        if cfg.tis_cap is not None:
            weight = tis_weight(logp_old, mb.rollout_logprobs, cfg.tis_cap)
            per_token = per_token * weight
        norms = {
            "global_tokens": mini.tokens,
            "global_seqs": mini.seqs,
            "norm_len": mini.norm_len,
        }
        pg_loss = self._agg(per_token, mask, **norms)
        loss, kl_loss, kl_sum = pg_loss, torch.zeros((), device=logp.device), torch.zeros((), device=logp.device)
        if micro.logp_ref is not None and cfg.use_kl_loss:
            kl = self._kl_fn(logp, micro.logp_ref)
            kl_loss = self._agg(kl, mask, **norms)
            loss = loss + cfg.kl_coef * kl_loss
            kl_sum = (kl.detach() * mask).sum()
        sums = self._metric_sums(pg_loss, kl_loss, kl_sum, out, entropy, weight, mask)
        return loss, sums, _ratio_extremes(out.ratio, mask)

    @staticmethod
    def _metric_sums(
        pg_loss, kl_loss, kl_sum, out, entropy, weight, mask
    ) -> torch.Tensor:
        """The micro-batch's entries of `_SUMS` (token sums for the token-mean diagnostics), float64 on the
        loss's device: no host copy per micro-batch.

        `out` is the policy loss's output: `clipped` marks the tokens where
        the clip (or dual clip, or M2PO's drop) is active, `ratio` the ratio
        the loss clips (GSPO: its sequence ratio, on every token of the row).
        """
        zero = torch.zeros((), device=mask.device)
        tis_sum = (weight * mask).sum() if weight is not None else zero
        values = [pg_loss.detach(), kl_loss.detach(), (out.clipped * mask).sum(), (entropy * mask).sum(), kl_sum,
                  tis_sum, (out.ratio.detach() * mask).sum(), mask.sum()]
        return torch.stack([v.to(torch.float64) for v in values])

    def _critic_update(self, mini: _Mini) -> torch.Tensor:
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

    def _metrics(self, totals: _Totals, lr: float, info: dict) -> dict:
        """The step's metrics, copied to the host once (every figure of every update in one transfer)."""
        updates = max(len(totals.grad_norms), 1)
        on_device = [torch.zeros(len(_SUMS), dtype=torch.float64) if totals.sums is None else totals.sums,
                     torch.full((2,), -math.inf, dtype=torch.float64) if totals.extremes is None else totals.extremes,
                     *(torch.as_tensor(g, dtype=torch.float64) for g in totals.grad_norms)]
        if totals.critic is not None:
            on_device.append(totals.critic)
        host = torch.cat([t.detach().to("cpu", torch.float64).reshape(-1) for t in on_device]).tolist()
        s = dict(zip(_SUMS, host[: len(_SUMS)]))
        extremes, grad_norms = host[len(_SUMS): len(_SUMS) + 2], host[len(_SUMS) + 2: len(_SUMS) + 2 + updates]
        tokens = max(s["tokens"], 1.0)
        metrics = {
            "loss": (s["pg_loss"] + self.config.kl_coef * s["kl_loss"]) / updates,
            "pg_loss": s["pg_loss"] / updates,
            "clipfrac": s["clipped"] / tokens,
            "ratio_mean": s["ratio"] / tokens if s["tokens"] else 1.0,
            "entropy": s["entropy"] / tokens,
            "grad_norm": sum(grad_norms[: len(totals.grad_norms)]) / updates,
            "lr": lr,
            "optimizer_steps": float(len(totals.grad_norms)),
            "num_tokens": s["tokens"] / self.config.num_epochs,  # learned tokens in the step
            **info,
        }
        if s["tokens"]:
            metrics.update(ratio_min=-extremes[0], ratio_max=extremes[1])
        if self.config.use_kl_loss:
            metrics.update(kl_loss=s["kl_loss"] / updates, kl=s["kl"] / tokens)
        if self.config.tis_cap is not None:
            metrics["tis_weight"] = s["tis"] / tokens
        if totals.critic is not None:
            metrics.update(critic_metrics(torch.tensor(host[-3:], dtype=torch.float64), totals.critic_updates))
        return metrics

    # ------------------------------------------------- GPU memory (colocate)
    def offload(self, parts: Sequence[str] = ("optimizer", "model")) -> None:
        """Hand the GPU back to engines that share it (colocate on GPU nodes, train/offload.py): with
        "optimizer" the gradients go, the optimizer's and the critic's state and the reference and teacher
        models to host memory (what a weight hand-over does not read), with "model" the policy's parameters;
        then the allocator's cache is returned to the driver. `reload` brings everything back."""
        unknown = set(parts) - {"optimizer", "model"}
        if unknown:
            raise ValueError(f"unknown parts {sorted(unknown)}: offload 'optimizer' and/or 'model'")
        if self._offloaded is None:
            self._offloaded = StorageOffload(self.device)
        if "optimizer" in parts:
            self.optimizer.zero_grad(set_to_none=True)
            tensors = optimizer_tensors(self.optimizer) + module_tensors(self.ref_model) + \
                module_tensors(self.teacher)
            if self.critic is not None:
                self.critic.optimizer.zero_grad(set_to_none=True)
                tensors += optimizer_tensors(self.critic.optimizer) + module_tensors(self.critic.model)
            self._offloaded.offload(tensors)
        if "model" in parts:
            self._offloaded.offload(module_tensors(self.model))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Everything `offload` handed back, on the trainer's device again."""
        if self._offloaded is not None:
            self._offloaded.reload()

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
