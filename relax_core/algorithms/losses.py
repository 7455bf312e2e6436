"""The PPO clipped surrogate on unmasked tensors, its output type, and the off-policy correction.

Building blocks: the registered (masked) losses in policy_losses.py wrap
`ppo_clip` here after zeroing masked inputs, and the trainer multiplies
`tis_weight` into the per-token loss. Formulas: docs/algorithms.md,
"Policy losses" and "Off-policy correction".
"""

from __future__ import annotations

from typing import NamedTuple

import torch

LOG_RATIO_CLAMP = 20.0


class PolicyLossOutput(NamedTuple):
    """Per-token loss (before masking/aggregation) and diagnostics.

    `clipped` is 1.0 where the clipped branch was the active one (the token
    carries no gradient from the ratio); the trainer reports its masked mean
    as `clipfrac`. `ratio` is the (detached) importance ratio.
    """

    loss: torch.Tensor
    clipped: torch.Tensor
    ratio: torch.Tensor


def importance_ratio(logp: torch.Tensor, logp_old: torch.Tensor) -> torch.Tensor:
    """`r_t = exp(clamp(logp_t - logp_old_t, -20, 20))`."""
    return torch.exp(torch.clamp(logp - logp_old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def ppo_clip(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float | None = 3.0,
) -> PolicyLossOutput:
    """PPO clipped surrogate with clip-higher and dual clip.

    `max(-A r, -A clip(r, 1-eps_low, 1+eps_high))`; for `A < 0` additionally
    `min(that, -A c)` (dual clip, Ye et al. 2020), which caps the loss of a
    negative-advantage token whose ratio has grown large. `dual_clip_c=None`
    turns the dual clip off. `advantages` broadcasts against `logp`.
    """
    ratio = importance_ratio(logp, logp_old)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap.expand_as(loss), loss)
        is_clipped = is_clipped | dual
    return PolicyLossOutput(loss, is_clipped.to(logp.dtype), ratio.detach())


def tis_weight(
    logp_old: torch.Tensor, logp_rollout: torch.Tensor, cap: float = 2.0
) -> torch.Tensor:
    """Truncated importance weight `min(exp(logp_old - logp_rollout), C)`, no gradient.

    Multiplied into the per-token policy loss to correct for the engine's
    sampling distribution differing from the trainer's (numerics, staleness).
    """
    with torch.no_grad():
        return torch.clamp(torch.exp(logp_old - logp_rollout), max=cap).detach()
