"""One RL training step, whatever the backend: the algorithm's part of a trainer.

The controller hands each data-parallel rank its shard of a step's `Sample`s;
`PolicyTrainer.train_step` cuts it into mini-batches, has the backend compute
the old (and reference, teacher, critic) numbers with the weights the step
starts from, computes per-token advantages with the algorithm's estimator over
the whole step (all ranks; step_advantages.py), has the backend take one
optimizer step per mini-batch and epoch (the loss of each micro-batch is
`loss_from`, here) and turns the sums of every update into the step's metrics.
The torch (FSDP2) backend (torch_backend.py) and the Megatron backend
(megatron/trainer.py) subclass `PolicyTrainer`; they differ only in how they
run forwards and backwards and reduce over their ranks.

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

With a critic (PPO) the step also reads its values before the update (they
feed GAE) and takes one critic optimizer step per mini-batch after the
policy's; a teacher (on-policy distillation) adds its log-probs.

Loss normalisers (token and sequence counts) are summed over every
micro-batch and rank of a mini-batch before the first backward, and gradients
are summed (not averaged) across ranks, so the update does not depend on how
the batch was split (see algorithms/aggregation.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from relax_core.algorithms import registry
from relax_core.algorithms.losses import tis_weight
from relax_core.config.algorithm_specs import get_spec
from relax_core.data.sample import Sample
from relax_core.train.batching import MicroBatch, micro_bounds, pack, shard_bounds
from relax_core.train.config import TorchTrainerConfig
from relax_core.train.offload import StorageOffload
from relax_core.train.step_advantages import StepResult, StepRows, pad_rows, step_advantages
from relax_core.train.step_metrics import Totals, metric_sums, ratio_extremes


@dataclass
class Micro:
    """A packed micro-batch with the per-step constants of its samples."""

    mb: MicroBatch
    logp_old: torch.Tensor | None  # [B, R]; None: take the update forward's own (see _on_policy)
    logp_ref: torch.Tensor | None  # [B, R]
    logp_teacher: torch.Tensor | None = None  # [B, R] (opd)
    values: torch.Tensor | None = None  # [B, R] critic values before the step (ppo)
    returns: torch.Tensor | None = None  # [B, R] gae returns, the critic's target
    advantages: torch.Tensor | None = None  # [B, R], set once the step's advantages are known
    keep: torch.Tensor | None = None  # [B, R] M2PO's kept tokens; None = all


@dataclass
class Mini:
    """The micro-batches of one optimizer step and the step-global normalisers."""

    micros: list[Micro]
    tokens: float
    seqs: float
    norm_len: float
    passes: int = 0  # sharded: forward/backward passes every rank runs (the most micro-batches of any rank)


class PolicyTrainer:
    """A trainer's step, data-parallel over a torch.distributed group; a backend subclasses it.

    What a backend provides: in its `__init__`, after `PolicyTrainer.__init__(config)`, `model` (the
    policy; the trainer worker reads its parameters), `ref_model` (when `_loads_reference`), `teacher`,
    `critic` (left None when there are none), `optimizer`, `scheduler` (`get_last_lr`, `step`), `group`
    (the data-parallel group; None: the default one) and `pad_id`; then the methods of "the backend's
    part" below. It may override `distributed` (megatron-core always has a group) and `_pool` (the rows
    a rank trains on besides its own: Megatron's model-parallel group trains on the rows of all its ranks).
    """

    def __init__(self, config: TorchTrainerConfig) -> None:
        self.config = cfg = config
        torch.manual_seed(cfg.seed)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.group: dist.ProcessGroup | None = None
        self.frozen: list[str] = []  # parameter names kept as loaded (not trained, not synced)
        self.ref_model = self.teacher = self.critic = None
        self.last_returns: list[list[float]] | None = None  # this rank's GAE returns of the last step
        self._offloaded: StorageOffload | None = None  # what `offload` handed back (colocate on GPU nodes)
        self._init_algorithm()

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

    # ------------------------------------------------------ the backend's part
    @property
    def sharded(self) -> bool:
        """Every rank runs as many passes as the busiest (`_passes`, `Mini.passes`): its collectives."""
        raise NotImplementedError

    def _prepare(self, samples: Sequence[Sample], ref_rows: Sequence[Sequence[float]] | None = None,
                 passes: int = 0) -> list[Micro]:
        """Pack one mini-batch and run its no-grad forwards with the weights the step starts from: logp_old
        when `_recomputes_logp_old`, the reference's unless `ref_rows` (`_given_rows`) has them, the
        teacher's, the critic's values; sharded, idle passes up to `passes`."""
        raise NotImplementedError

    def _update(self, mini: Mini) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | float]:
        """One policy optimizer step: forward and backward of each micro-batch (its loss from `loss_from`),
        the gradients summed over the ranks, clipped, stepped. Returns the `SUMS` (step_metrics.py)
        all-reduced, this rank's ratio extremes and the gradient norm before clipping."""
        raise NotImplementedError

    def _critic_update(self, mini: Mini) -> torch.Tensor:
        """One critic optimizer step on the mini-batch; its sums `[loss, clipped, tokens]` over the ranks."""
        raise NotImplementedError

    def _policy_logprobs(self, batches: list[MicroBatch], passes: int) -> list[torch.Tensor]:
        """`[B, R]` no-grad log-probs of the current policy for each batch (sharded: `passes` passes)."""
        raise NotImplementedError

    def _offload(self, store: StorageOffload, parts: Sequence[str]) -> None:
        """`offload`: the tensors of `parts` ("optimizer", "model") into `store`."""
        raise NotImplementedError

    def named_parameters_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, whole tensor in the compute dtype) of every trained weight, as the engines load them."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

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

    def _pool(self, samples: Sequence[Sample], *columns) -> tuple[tuple, Callable[[list], list]]:
        """The rows this rank trains on (`samples` and per-sample `columns`), and what gives back this
        rank's own part of per-row results: here its own rows, unchanged."""
        return (samples, *columns), lambda rows: rows

    def _passes(self, counts: list[int]) -> list[int]:
        """Sharded: the most micro-batches any rank has in each mini-batch (every rank runs that many)."""
        if not self.sharded:
            return counts
        most = self._all_reduce(torch.tensor(counts, dtype=torch.float64), dist.ReduceOp.MAX)
        return [int(n) for n in most.tolist()]

    # ------------------------------------------------------------- batches
    def _pack(self, samples: Sequence[Sample]) -> MicroBatch:
        return pack(samples, self.pad_id, self.config.device, packed=self.config.max_tokens_per_micro_batch is not None)

    def _micro_bounds(self, samples: Sequence[Sample]) -> list[int]:
        cfg = self.config
        return micro_bounds(samples, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)

    def _idle_batch(self) -> MicroBatch:
        """A one-token batch that learns nothing: what a rank runs in a pass the others run on real ones."""
        idle = Sample(prompt_ids=[self.pad_id], response_ids=[self.pad_id], rollout_logprobs=[0.0], loss_mask=[0])
        return self._pack([idle])

    def _given_rows(self, rows: Sequence[Sequence[float]], a: int, b: int, mb: MicroBatch) -> torch.Tensor:
        """Rows a..b of per-token numbers that came with the samples (the reference service's), as `[B, R]`."""
        return pad_rows([list(r) for r in rows[a:b]], mb.loss_mask.shape[1]).to(self.config.device)

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Log-prob (temperature 1) of every response token of every sample, under the current policy.
        Every rank calls it (with its own samples)."""
        (pooled,), own = self._pool(samples)
        bounds = self._micro_bounds(pooled)
        batches = [self._pack(pooled[a:b]) for a, b in zip(bounds, bounds[1:])]
        logps = self._policy_logprobs(batches, self._passes([len(batches)])[0])
        return own([row for mb, logp in zip(batches, logps) for row in mb.response_lists(logp)])

    # ------------------------------------------------- GPU memory (colocate)
    def offload(self, parts: Sequence[str] = ("optimizer", "model")) -> None:
        """Hand the GPU back to engines that share it (colocate on GPU nodes, train/offload.py): with
        "optimizer" what a weight hand-over does not read (gradients, the optimizer's and the critic's
        state, the reference and teacher models), with "model" the policy's parameters (`_offload` says
        which tensors those are); then the allocator's cache is returned to the driver. `reload` brings
        everything back."""
        unknown = set(parts) - {"optimizer", "model"}
        if unknown:
            raise ValueError(f"unknown parts {sorted(unknown)}: offload 'optimizer' and/or 'model'")
        if self._offloaded is None:
            self._offloaded = StorageOffload(self.device)
        self._offload(self._offloaded, parts)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Everything `offload` handed back, on the trainer's device again."""
        if self._offloaded is not None:
            self._offloaded.reload()

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
        `last_returns` holds this rank's own samples' returns afterwards.

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
        (samples, advantages, ref_logprobs), own = self._pool(samples, advantages, ref_logprobs)
        if cfg.reference_service and ref_logprobs is None and (cfg.use_kl_loss or self._kl_in_reward):
            raise ValueError("the reference log-probs come from the reference service: pass ref_logprobs")
        minis, step_info = self._minis(samples, advantages, ref_logprobs)
        step_info["logp_old_version"] = float(self.step)
        lr = self.scheduler.get_last_lr()[0]
        totals = Totals()
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
        if self.last_returns is not None:
            self.last_returns = own(self.last_returns)
        return totals.metrics(cfg, lr, step_info)

    def _minis(self, samples: Sequence[Sample], advantages: Sequence[float] | None,
               ref_logprobs: Sequence[Sequence[float]] | None = None) -> tuple[list[Mini], dict]:
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
    def _loads_reference(self) -> bool:
        """The reference model is loaded here: a KL is on or asked for, and no reference service sends it."""
        cfg = self.config
        return (cfg.use_kl_loss or cfg.use_reference or self._kl_in_reward) and not cfg.reference_service

    @property
    def _recomputes_logp_old(self) -> bool:
        """logp_old needs a forward of its own before the first update (not the update's own, detached)."""
        return self._needs_logp_old or not self._on_policy

    @property
    def _needs_logp_old(self) -> bool:
        """The estimator or the token selection reads logp_old before the update."""
        return self.spec.needs_logp_old or self._kl_in_reward or self._select is not None

    @property
    def _on_policy(self) -> bool:
        """One update per step: logp_old is the update forward's own log-prob, detached.

        The weights have not changed since the batch was packed, so a separate
        no-grad forward would give exactly the same numbers; skipping it saves
        a third of the step's compute.
        """
        return self.config.num_mini_batches == 1 and self.config.num_epochs == 1

    # ------------------------------------------------------- advantages, loss
    def _step_rows(self, samples: Sequence[Sample], micros: list[Micro]) -> StepRows:
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

    def _set_advantages(self, samples: Sequence[Sample], micros: list[Micro], given: Sequence[float] | None
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

    def _normalisers(self, micros: list[Micro], samples: Sequence[Sample], passes: int = 0) -> Mini:
        """The mini-batch's step-global token count (kept tokens for M2PO), sequence count and norm_len."""
        cfg = self.config
        tokens = sum(float((m.mb.loss_mask * (m.keep if m.keep is not None else 1.0)).sum()) for m in micros)
        counts = torch.tensor([tokens, float(len(samples))], dtype=torch.float64)
        max_len = torch.tensor([max([s.response_len for s in samples] + [0])], dtype=torch.float64)
        self._all_reduce(counts)
        self._all_reduce(max_len, dist.ReduceOp.MAX)
        norm_len = float(cfg.norm_len) if cfg.norm_len else float(max_len)
        return Mini(micros, float(counts[0]), float(counts[1]), norm_len, passes)

    def loss_from(self, logp: torch.Tensor, entropy: torch.Tensor, micro: Micro, mini: Mini
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This micro-batch's contribution to the mini-batch loss, its `SUMS` and ratio extremes, given the
        update forward's `[B, R]` log-probs and entropy (a backend's `_update` calls it after each forward;
        Megatron's from its pipeline schedule's loss function)."""
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
        norms = {"global_tokens": mini.tokens, "global_seqs": mini.seqs, "norm_len": mini.norm_len}
        pg_loss = self._agg(per_token, mask, **norms)
        loss, kl_loss, kl_sum = pg_loss, torch.zeros((), device=logp.device), torch.zeros((), device=logp.device)
        if micro.logp_ref is not None and cfg.use_kl_loss:
            kl = self._kl_fn(logp, micro.logp_ref)
            kl_loss = self._agg(kl, mask, **norms)
            loss = loss + cfg.kl_coef * kl_loss
            kl_sum = (kl.detach() * mask).sum()
        sums = metric_sums(pg_loss, kl_loss, kl_sum, out, entropy, weight, mask)
        return loss, sums, ratio_extremes(out.ratio, mask)
