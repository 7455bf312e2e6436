"""PPO's critic: the policy's architecture with a scalar value head, trained next to the policy.

In `colocate` and `hybrid` it lives inside `TorchTrainer` (same process,
same data-parallel group): the trainer asks it for `values` of a packed
micro-batch before the step (they feed GAE, algorithms/estimators.py:gae)
and takes one critic optimizer `step` per mini-batch after the policy's
(the clipped value loss, algorithms/policy_losses.py:value_loss, token-mean
over the mini-batch). It has its own AdamW; the trainer all-reduces its
gradients exactly as the policy's and saves it under the "critic" key of its
state dict. In `fully_async` the same `Critic` runs as a service of its own
(services/critic.py), taking the same optimizer steps on the same
mini-batches, and its state is saved under the same key.

`V_t`, the value of the state before response token t, is read from the
hidden state at the position whose logits predict token t (the micro-batch's
`logit_index`), as the policy's log-prob of token t is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from relax_core.algorithms.aggregation import token_mean
from relax_core.algorithms.policy_losses import value_loss
from relax_core.train.batching import MicroBatch
from relax_core.train.optim import build_optimizer


class ValueModel(torch.nn.Module):
    """HF base model (no LM head) + `Linear(hidden, 1)`; the head starts at 0, so V = 0 before training."""

    def __init__(self, path: str | Path, dtype: str, trust_remote_code: bool = False) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the causal LM's lm_head is expectedly unused: no load report
        try:
            self.body = AutoModel.from_pretrained(str(path), dtype=getattr(torch, dtype),
                                                  trust_remote_code=trust_remote_code)
        finally:
            hf_logging.set_verbosity(level)
        self.head = torch.nn.Linear(self.body.config.hidden_size, 1, dtype=getattr(torch, dtype))
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

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
        dtype / device: as the policy's.
        weight_decay / betas / adam_eps: AdamW settings (the policy's).
        trust_remote_code: let the model directory's own code run (`model.trust_remote_code`).
    """

    def __init__(self, path: str | Path, *, lr: float, value_clip: float, dtype: str, device: str,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8,
                 trust_remote_code: bool = False):
        self.model = ValueModel(path, dtype, trust_remote_code).to(device).eval()  # eval: no dropout, as the policy
        self.value_clip = value_clip
        self.optimizer = build_optimizer(self.model.named_parameters(), lr=lr, weight_decay=weight_decay,
                                         betas=tuple(betas), eps=adam_eps)

    @classmethod
    def from_config(cls, policy_path: str | Path, cfg) -> Critic:
        """The critic a `TorchTrainerConfig` describes: its body from `critic_path`, else the policy's."""
        return cls(cfg.critic_path or policy_path, lr=cfg.critic_lr, value_clip=cfg.critic_value_clip,
                   dtype=cfg.dtype, device=cfg.device, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas),
                   adam_eps=cfg.adam_eps, trust_remote_code=cfg.trust_remote_code)

    @torch.no_grad()
    def values(self, mb: MicroBatch) -> torch.Tensor:
        return self.model(mb)

    def loss(self, mb: MicroBatch, values_old: torch.Tensor, returns: torch.Tensor,
             global_tokens: float) -> tuple[torch.Tensor, float]:
        """This micro-batch's share of the step's token-mean value loss, and its clipped-token count."""
        out = value_loss(self.model(mb), values_old, returns, mask=mb.loss_mask, value_clip=self.value_clip)
        clipped = float((out.clipped * mb.loss_mask).sum())
        return token_mean(out.loss, mb.loss_mask, global_tokens=global_tokens), clipped

    def step(self, micros: Sequence[tuple[MicroBatch, torch.Tensor, torch.Tensor]], global_tokens: float,
             grad_clip: float, reduce: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """One optimizer step on a mini-batch's micro-batches `(mb, values_old, returns)`, whose learned
        tokens number `global_tokens` (over every rank); `reduce(sums)` sums the gradients and `sums` over
        the data-parallel ranks before the clip (the trainer's). Returns the sums [loss, clipped, tokens]."""
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(3, dtype=torch.float64)
        for mb, values_old, returns in micros:
            loss, clipped = self.loss(mb, values_old, returns, global_tokens)
            loss.backward()
            sums += torch.tensor([float(loss.detach()), clipped, mb.num_tokens], dtype=torch.float64)
        if reduce is not None:
            reduce(sums)
        max_norm = grad_clip if grad_clip > 0 else float("inf")
        torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        self.optimizer.step()
        return sums

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "model" in state:
            self.model.load_state_dict(state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])


def critic_metrics(sums: torch.Tensor, updates: int) -> dict[str, float]:
    """A step's critic metrics from its optimizer steps' summed [loss, clipped, tokens]: the mean value loss
    per update and the fraction of learned tokens where the value clip was active."""
    loss, clipped, tokens = sums.tolist()
    return {"value_loss": loss / max(updates, 1), "vf_clipfrac": clipped / max(tokens, 1.0)}
