"""Per-token policy losses of the algorithm suite, behind one masked interface, and PPO's value loss.

The trainer calls the loss named by the algorithm's spec once per
micro-batch, then hands `out.loss` to the aggregator (aggregation.py). Every
loss here registers itself under its name (`@register_loss`) and has the
signature

    fn(logp, logp_old, advantages, *, mask, logp_rollout=None, **params) -> PolicyLossOutput

with `[B, T]` tensors (`advantages` per token, from estimators.py, or `[B, 1]`).
Inputs are replaced by 0 where `mask` is 0 *before* any arithmetic, so a
garbage (inf/NaN) log-prob on padding can never reach the value or the
gradient: masked tokens get exactly zero gradient. `mask` is also what
gspo's sequence ratio reduces over.

M2PO is the ppo_clip loss on the tokens a step-wide token selection keeps
(`m2_keep_mask`, registered with `@register_token_selection("m2")`): the
trainer runs the selection once over the whole step and aggregates with
`mask * keep`. Formulas: docs/algorithms.md, "Policy losses" and "The critic".
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from relax_core.algorithms import losses
from relax_core.algorithms.losses import PolicyLossOutput, importance_ratio
from relax_core.algorithms.registry import register_loss, register_token_selection

LOG_RATIO_CLAMP = losses.LOG_RATIO_CLAMP


def _zero_masked(mask: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    m = mask.bool()
    return [torch.where(m, t, torch.zeros((), dtype=t.dtype)) for t in tensors]


@register_loss("ppo_clip")
def ppo_clip(
    logp, logp_old, advantages, *, mask, logp_rollout=None, eps_low=0.2, eps_high=0.2, dual_clip_c=3.0
) -> PolicyLossOutput:
    """losses.ppo_clip (clip-higher, dual clip for `A<0`) behind the masked interface."""
    logp, logp_old, adv = _zero_masked(mask, logp, logp_old, advantages.expand_as(logp))
    return losses.ppo_clip(logp, logp_old, adv, eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c)


def sequence_log_ratio(logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`log s_i = mean_t (logp - logp_old)` over the masked tokens, clamped to [-20, 20]; 0 for an empty row."""
    m = mask.bool()
    diff = torch.where(m, logp - logp_old, torch.zeros_like(logp))
    mean = diff.sum(-1) / m.sum(-1).clamp(min=1)
    return mean.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@register_loss("gspo")
def gspo(
    logp, logp_old, advantages, *, mask, logp_rollout=None, eps_low=3e-4, eps_high=4e-4, dual_clip_c=None
) -> PolicyLossOutput:
    """GSPO: the sequence ratio `s_i` in token form `sg[s_i] exp(logp_t - sg[logp_t])`, PPO-clipped.

    The token form has value `s_i` on every token and gradient
    `s_i * grad logp_t`, so with `seq-mean-token-mean` aggregation the
    gradient equals the sequence-level objective's `-A_i grad s_i` (where
    unclipped). Clipping is per sequence (all tokens of a row share `s_i`),
    with the paper's small eps (3e-4 / 4e-4) and no dual clip by default.
    """
    logp, logp_old, adv = _zero_masked(mask, logp, logp_old, advantages.expand_as(logp))
    seq = sequence_log_ratio(logp, logp_old, mask).detach().unsqueeze(-1)
    token_log_ratio = seq + logp - logp.detach()
    return losses.ppo_clip(
        token_log_ratio, torch.zeros_like(logp), adv, eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c
    )


@register_loss("cispo")
def cispo(
    logp, logp_old, advantages, *, mask, logp_rollout=None, eps_low=1.0, eps_high=0.28
) -> PolicyLossOutput:
    """CISPO: `-sg[clip(r, 1-eps_low, 1+eps_high)] * A * logp_t`.

    Default `eps_low=1.0`: no lower bound on the weight, as in MiniMax-M1.

    The clipped importance weight carries no gradient and every token keeps
    the REINFORCE gradient `-w A grad logp_t` (no token is dropped, unlike
    PPO's clip). `clipped` marks tokens whose weight was clipped.
    """
    logp, logp_old, adv = _zero_masked(mask, logp, logp_old, advantages.expand_as(logp))
    ratio = importance_ratio(logp, logp_old).detach()
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    clipped = (weight != ratio).to(logp.dtype)
    return PolicyLossOutput(-weight * adv * logp, clipped, ratio)


@register_loss("sapo")
def sapo(
    logp, logp_old, advantages, *, mask, logp_rollout=None, tau_pos=1.0, tau_neg=1.05
) -> PolicyLossOutput:
    """SAPO: soft gate `f(r) = sigmoid(tau (r-1)) * 4/tau` instead of a hard clip; loss `-f(r) A`.

    `tau = tau_pos` where `A > 0`, else `tau_neg`. At `r = 1` the gate's slope
    is 1 (the unclipped PPO gradient); it decays smoothly away from 1. No
    token is hard-clipped, so `clipped` is all 0.
    """
    logp, logp_old, adv = _zero_masked(mask, logp, logp_old, advantages.expand_as(logp))
    ratio = importance_ratio(logp, logp_old)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return PolicyLossOutput(-gate * adv, torch.zeros_like(logp), ratio.detach())


@register_token_selection("m2")
def m2_keep_mask(
    logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor, m2_threshold: float = 0.04
) -> torch.Tensor:
    """M2PO's token selection: drop the largest `(logp_old - logp_rollout)^2` until the rest's mean <= threshold.

    Over all masked tokens of the given batch (call it on the whole step's
    batch so the selection does not depend on the micro-batch split). Ties
    are dropped from the later position first. Returns a bool `[B, T]` mask,
    False on masked and dropped tokens.
    """
    m = mask.bool()
    sq = ((logp_old - logp_rollout).to(torch.float64) ** 2)[m]
    order = torch.sort(sq, stable=True).indices
    prefix_mean = torch.cumsum(sq[order], 0) / torch.arange(1, sq.numel() + 1, dtype=torch.float64)
    n_keep = int((prefix_mean <= m2_threshold).sum())  # prefix means of sorted values never decrease
    keep_flat = torch.zeros_like(sq, dtype=torch.bool)
    keep_flat[order[:n_keep]] = True
    keep = torch.zeros_like(m)
    keep[m] = keep_flat
    return keep


class ValueLossOutput(NamedTuple):
    """Per-token critic loss (aggregate with token-mean) and where the clipped branch was active."""

    loss: torch.Tensor
    clipped: torch.Tensor


def value_loss(
    values: torch.Tensor, values_old: torch.Tensor, returns: torch.Tensor, *, mask: torch.Tensor,
    value_clip: float = 0.2,
) -> ValueLossOutput:
    """PPO critic: `0.5 max((V - ret)^2, (clip(V, V_old - eps_v, V_old + eps_v) - ret)^2)`."""
    values, values_old, returns = _zero_masked(mask, values, values_old, returns)
    clipped_v = values_old + torch.clamp(values - values_old, -value_clip, value_clip)
    plain, clipped = (values - returns) ** 2, (clipped_v - returns) ** 2
    return ValueLossOutput(0.5 * torch.maximum(plain, clipped), (clipped > plain).to(values.dtype))
