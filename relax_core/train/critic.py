"""PPO's critic: the policy's architecture with a scalar value head, trained next to the policy.

It lives inside the trainer ranks in every mode (same process, same data-parallel group), and it is
built and trained the way the policy is (train/sharding.py): float32 master weights, computed in the
recipe's dtype, sharded with FSDP2 over the ranks when the policy is (so a 4B critic costs each of
8 ranks an eighth of its weights, gradients and AdamW moments), each decoder layer recomputed in the
backward pass when the recipe asks. The trainer asks it for `values` of a packed micro-batch before
the step, with the critic the step starts from (they feed GAE, algorithms/estimators.py:gae), and
takes one critic optimizer `step` per mini-batch after the policy's (the clipped value loss,
algorithms/policy_losses.py:value_loss, token-mean over the mini-batch). Sharded, every rank runs as
many passes as the busiest one (FSDP's gathers are collectives), as the policy does. Its state is
saved under the "critic" key of the trainer's (sharded tensors, as the policy's).

`V_t`, the value of the state before response token t, is read from the
hidden state at the position whose logits predict token t (the micro-batch's
`logit_index`), as the policy's log-prob of token t is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from relax_core.algorithms.aggregation import token_mean
from relax_core.algorithms.policy_losses import value_loss
from relax_core.train import sharding
from relax_core.train.batching import MicroBatch
from relax_core.train.optim import build_optimizer


class ValueModel(torch.nn.Module):
    """HF base model (no LM head) + `Linear(hidden, 1)`; the head starts at 0, so V = 0 before training.

    `weights=False`: the body built without its checkpoint, its parameters on the meta device (a sharded
    critic's ranks other than 0; sharding.build fills them from rank 0)."""

    def __init__(self, path: str | Path, dtype: str, trust_remote_code: bool = False, *, weights: bool = True,
                 device: str = "cpu") -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModel
        from transformers.utils import logging as hf_logging

        from relax_core.models.multimodal import empty_parameters

        torch_dtype = getattr(torch, dtype)
        if weights:
            level = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # the causal LM's lm_head is expectedly unused: no load report
            try:
                self.body = AutoModel.from_pretrained(str(path), dtype=torch_dtype, trust_remote_code=trust_remote_code)
            finally:
                hf_logging.set_verbosity(level)
        else:
            config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
            with empty_parameters():
                self.body = AutoModel.from_config(config, dtype=torch_dtype, trust_remote_code=trust_remote_code)
        self._no_split_modules = self.body._no_split_modules  # the decoder layers: sharding's units
        self.head = torch.nn.Linear(self.body.config.hidden_size, 1, dtype=torch_dtype)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        if weights:
            self.to(device)

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        """`[B, R]` float32 values at the response positions."""
        hidden = self.body(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                           position_ids=mb.position_ids, use_cache=False).last_hidden_state
        return self.head(mb.at_logits(hidden)).squeeze(-1).float()


class Critic:
    """The value model and its optimizer.

    Args:
        path: HF directory its body is initialised from (the policy's by default).
        lr: its AdamW learning rate.
        value_clip: eps_v of the clipped value loss.
        dtype: the compute dtype (its parameters are float32 master weights).
        device: as the policy's.
        fsdp / recompute: shard it over `group` with FSDP2 / recompute its layers, as the policy.
        group: the data-parallel group (None: the default one).
        weight_decay / betas / adam_eps: AdamW settings (the policy's).
        trust_remote_code: let the model directory's own code run (`model.trust_remote_code`).
    """

    def __init__(self, path: str | Path, *, lr: float, value_clip: float, dtype: str, device: str,
                 fsdp: bool = False, recompute: bool = False, group: dist.ProcessGroup | None = None,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8,
                 trust_remote_code: bool = False):
        self.sharded, self.group = fsdp, group
        load = functools.partial(ValueModel, path, "float32", trust_remote_code)
        self.model = sharding.build(load, fsdp=fsdp, recompute=recompute, group=group, device=device,
                                    compute_dtype=getattr(torch, dtype)).eval()  # eval: no dropout, as the policy
        self.value_clip = value_clip
        self.optimizer = build_optimizer(self.model.named_parameters(), lr=lr, weight_decay=weight_decay,
                                         betas=tuple(betas), eps=adam_eps)

    @classmethod
    def from_config(cls, policy_path: str | Path, cfg, group: dist.ProcessGroup | None = None) -> Critic:
        """The critic a `TorchTrainerConfig` describes: its body from `critic_path`, else the policy's; built,
        sharded and recomputed as the policy is."""
        return cls(cfg.critic_path or policy_path, lr=cfg.critic_lr, value_clip=cfg.critic_value_clip,
                   dtype=cfg.dtype, device=cfg.device, fsdp=cfg.fsdp, recompute=cfg.recompute_activations,
                   group=group, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas), adam_eps=cfg.adam_eps,
                   trust_remote_code=cfg.trust_remote_code)

    @torch.no_grad()
    def values(self, mb: MicroBatch) -> torch.Tensor:
        return self.model(mb)

    def idle_pass(self, idle: MicroBatch, *, backward: bool) -> None:
        """A pass that learns nothing, so a sharded rank with fewer micro-batches joins the others' gathers."""
        values = self.model(idle)
        if backward:
            (values.sum() * 0.0).backward()

    def loss(self, mb: MicroBatch, values_old: torch.Tensor, returns: torch.Tensor,
             global_tokens: float) -> tuple[torch.Tensor, torch.Tensor]:
        """This micro-batch's share of the step's token-mean value loss, and its clipped-token count (on the
        device: no host copy per micro-batch)."""
        out = value_loss(self.model(mb), values_old, returns, mask=mb.loss_mask, value_clip=self.value_clip)
        clipped = (out.clipped * mb.loss_mask).sum()
        return token_mean(out.loss, mb.loss_mask, global_tokens=global_tokens), clipped

    def step(self, micros: Sequence[tuple[MicroBatch, torch.Tensor, torch.Tensor]], global_tokens: float,
             grad_clip: float, reduce: Callable[[torch.Tensor], None] | None = None, *, passes: int = 0,
             idle: MicroBatch | None = None) -> torch.Tensor:
        """One optimizer step on a mini-batch's micro-batches `(mb, values_old, returns)`, whose learned
        tokens number `global_tokens` (over every rank). Unsharded, `reduce(sums)` sums the gradients and
        `sums` over the data-parallel ranks before the clip (the trainer's); sharded, FSDP reduce-scattered
        the gradients in each backward, this rank runs `passes` passes in all (idle ones over `idle`), and
        `reduce` sums only `sums`. Returns the sums [loss, clipped, tokens], float64 on the device."""
        self.optimizer.zero_grad(set_to_none=True)
        device = next(self.model.parameters()).device
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        for mb, values_old, returns in micros:
            loss, clipped = self.loss(mb, values_old, returns, global_tokens)
            loss.backward()
            sums += torch.stack([loss.detach().double(), clipped.double(), mb.loss_mask.sum().double()])
        if self.sharded:
            for _ in range(passes - len(micros)):
                self.idle_pass(idle, backward=True)
        if reduce is not None:
            reduce(sums)
        params = self.parameters()
        max_norm = grad_clip if grad_clip > 0 else float("inf")
        if self.sharded:
            sharding.clip_grad_norm(params, max_norm, self.group)
        else:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        return sums

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def state_dict(self) -> dict:
        """Model and optimizer state; sharded, this rank's shards keyed by parameter name (as the policy's)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model, optimizer = get_state_dict(self.model, self.optimizer)
            return {"model": model, "optimizer": optimizer}
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(self.model, self.optimizer, model_state_dict=state.get("model", {}),
                           optim_state_dict=state.get("optimizer", {}))
            return
        if "model" in state:
            self.model.load_state_dict(state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])


def critic_metrics(sums: torch.Tensor, updates: int) -> dict[str, float]:
    """A step's critic metrics from its optimizer steps' summed [loss, clipped, tokens]: the mean value loss
    per update and the fraction of learned tokens where the value clip was active."""
    loss, clipped, tokens = sums.tolist()
    return {"value_loss": loss / max(updates, 1), "vf_clipfrac": clipped / max(tokens, 1.0)}
