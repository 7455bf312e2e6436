"""What the updates of one training step add up to, and the step's metrics from it.

Each micro-batch's loss (`PolicyTrainer.loss_from`, step.py) adds its token sums (`SUMS`) and the
range of its ratio to the update's, on the trainer's device; each update's sums are all-reduced over
the data-parallel ranks and added to the step's `Totals`, which are copied to the host once, when the
step ends, and turned into token-means and means over the updates (`Totals.metrics`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from relax_core.train.config import TorchTrainerConfig
from relax_core.train.critic import critic_metrics

# Order of the per-update metric sums that are all-reduced in one tensor.
SUMS = ("pg_loss", "kl_loss", "clipped", "entropy", "kl", "tis", "ratio", "tokens")


@dataclass
class Totals:
    """What a step's updates add up to, kept on the trainer's device until the step ends (one host copy
    then, not one per micro-batch): policy metric sums, grad norms, the ratio's range, critic sums."""

    sums: torch.Tensor | None = None  # float64 [len(SUMS)]
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

    def metrics(self, config: TorchTrainerConfig, lr: float, info: dict) -> dict:
        """The step's metrics, copied to the host once (every figure of every update in one transfer)."""
        updates = max(len(self.grad_norms), 1)
        on_device = [torch.zeros(len(SUMS), dtype=torch.float64) if self.sums is None else self.sums,
                     torch.full((2,), -math.inf, dtype=torch.float64) if self.extremes is None else self.extremes,
                     *(torch.as_tensor(g, dtype=torch.float64) for g in self.grad_norms)]
        if self.critic is not None:
            on_device.append(self.critic)
        host = torch.cat([t.detach().to("cpu", torch.float64).reshape(-1) for t in on_device]).tolist()
        s = dict(zip(SUMS, host[: len(SUMS)]))
        extremes, grad_norms = host[len(SUMS): len(SUMS) + 2], host[len(SUMS) + 2: len(SUMS) + 2 + updates]
        tokens = max(s["tokens"], 1.0)
        metrics = {
            "loss": (s["pg_loss"] + config.kl_coef * s["kl_loss"]) / updates,
            "pg_loss": s["pg_loss"] / updates,
            "clipfrac": s["clipped"] / tokens,
            "ratio_mean": s["ratio"] / tokens if s["tokens"] else 1.0,
            "entropy": s["entropy"] / tokens,
            "grad_norm": sum(grad_norms[: len(self.grad_norms)]) / updates,
            "lr": lr,
            "optimizer_steps": float(len(self.grad_norms)),
            "num_tokens": s["tokens"] / config.num_epochs,  # learned tokens in the step
            **info,
        }
        if s["tokens"]:
            metrics.update(ratio_min=-extremes[0], ratio_max=extremes[1])
        if config.use_kl_loss:
            metrics.update(kl_loss=s["kl_loss"] / updates, kl=s["kl"] / tokens)
        if config.tis_cap is not None:
            metrics["tis_weight"] = s["tis"] / tokens
        if self.critic is not None:
            metrics.update(critic_metrics(torch.tensor(host[-3:], dtype=torch.float64), self.critic_updates))
        return metrics


def ratio_extremes(ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[-min, max]` of the ratio over the masked tokens (-inf, -inf when there are none), float64 on the
    ratio's device (no host copy: a selection by the mask would need one for its size)."""
    picked = mask.bool()
    ratio = ratio.detach().to(torch.float64)
    none = torch.full_like(ratio, -math.inf)
    return torch.stack([torch.where(picked, -ratio, none).amax(), torch.where(picked, ratio, none).amax()]) \
        if ratio.numel() else torch.full((2,), -math.inf, dtype=torch.float64, device=ratio.device)


def metric_sums(pg_loss, kl_loss, kl_sum, out, entropy, weight, mask) -> torch.Tensor:
    """The micro-batch's entries of `SUMS` (token sums for the token-mean diagnostics), float64 on the
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
