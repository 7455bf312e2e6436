"""Advantage estimators behind one batch interface, per-sample and per-token alike.

The trainer computes advantages once per step, over the whole step's batch
(all data-parallel ranks), before any loss. Every estimator registered under
the registry kind "estimator" has the same signature:

    fn(batch: AdvantageBatch, **params) -> AdvantageResult

`AdvantageBatch` holds `[B, T]` tensors aligned with the response tokens and
their loss mask (plus `[B]` outcome rewards and group ids); each estimator
reads only the fields its algorithm needs (see `AlgorithmSpec` and the
docstrings below). The result is always per token, `[B, T]`, exactly 0 where
the mask is 0, so the trainer treats sequence-level estimators (grpo family:
one value broadcast to the sample's tokens) and token-level ones
(reinforce_pp, gae, opd) the same way. `returns` is set only by `gae` (the
critic's regression target). Formulas: docs/algorithms.md.

Convention for masked positions inside a response (multi-turn tool tokens):
they carry no reward and no discount; a discounted return or GAE recursion
passes through them unchanged, so an outcome reward still reaches earlier
turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from relax_core.algorithms import advantages as outcome
from relax_core.algorithms.registry import register_estimator

WHITEN_EPS = 1e-8


@dataclass
class AdvantageBatch:
    """The step's batch as estimators see it. `[B]` per sample, `[B, T]` per response token.

    Attributes:
        rewards: outcome reward `R_i` per sample, `[B]`.
        group_ids: samples of one prompt share an id, `[B]`.
        mask: loss mask `m_t`, `[B, T]` (1 on generated response tokens).
        kl: per-token KL to the reference (the recipe's estimator applied to
            `logp_old, logp_ref`), `[B, T]`; only for KL-in-reward.
        values: critic values `V_t` of the rollout policy, `[B, T]` (gae).
        logp: `logp_old` of the sampled tokens, `[B, T]` (opd).
        logp_teacher: teacher log-probs of the same tokens, `[B, T]` (opd).
    """

    rewards: torch.Tensor
    group_ids: Sequence[int] | torch.Tensor
    mask: torch.Tensor
    kl: torch.Tensor | None = None
    values: torch.Tensor | None = None
    logp: torch.Tensor | None = None
    logp_teacher: torch.Tensor | None = None


@dataclass
class AdvantageResult:
    """Per-token advantages `[B, T]` (0 on masked tokens) and, for gae, the returns."""

    advantages: torch.Tensor
    returns: torch.Tensor | None = None


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`(x - mean) / sqrt(var + 1e-8)` with mean/var over the masked tokens of the batch.

    The variance is unbiased (Bessel, as verl's `masked_whiten`). When every
    masked value is the same (including 0 or 1 token) the result is exactly 0,
    not rounding noise divided by 1e-4. Masked positions are exactly 0.
    """
    m = mask.bool()
    valid = x[m]
    if valid.numel() == 0 or bool(valid.max() == valid.min()):
        return torch.zeros_like(x)
    count = valid.numel()
    mean = valid.mean()
    var = ((valid - mean) ** 2).sum() / max(count - 1, 1)
    out = (x - mean) / torch.sqrt(var + WHITEN_EPS)
    return torch.where(m, out, torch.zeros_like(out))


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, T]` zeros with `R_i` on the last masked token of each row (none if the row is empty)."""
    m = mask.bool()
    positions = torch.arange(m.shape[-1]).expand_as(m)
    last = torch.where(m, positions, torch.full_like(positions, -1)).max(-1).values
    onehot = (positions == last.unsqueeze(-1)) & m
    return torch.where(onehot, rewards.unsqueeze(-1), torch.zeros((), dtype=rewards.dtype))


def _broadcast(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), per_sample.unsqueeze(-1), torch.zeros((), dtype=per_sample.dtype))


@register_estimator("grpo")
def grpo(batch: AdvantageBatch) -> AdvantageResult:
    """advantages.grpo (group-normalised `R_i`) broadcast to the sample's tokens."""
    return AdvantageResult(_broadcast(outcome.grpo(batch.rewards, batch.group_ids), batch.mask))


@register_estimator("dr_grpo")
def dr_grpo(batch: AdvantageBatch) -> AdvantageResult:
    """advantages.dr_grpo (`R_i - mean_g R`) broadcast to the sample's tokens."""
    return AdvantageResult(_broadcast(outcome.dr_grpo(batch.rewards, batch.group_ids), batch.mask))


@register_estimator("rloo")
def rloo(batch: AdvantageBatch) -> AdvantageResult:
    """advantages.rloo (leave-one-out baseline) broadcast to the sample's tokens."""
    return AdvantageResult(_broadcast(outcome.rloo(batch.rewards, batch.group_ids), batch.mask))


def token_rewards(batch: AdvantageBatch, kl_coef: float) -> torch.Tensor:
    """`r_t = -kl_coef * kl_t` on masked tokens, plus `R_i` on the last one (KL-in-reward)."""
    r = last_token_rewards(batch.rewards, batch.mask)
    if kl_coef and batch.kl is not None:
        r = r - kl_coef * torch.where(batch.mask.bool(), batch.kl, torch.zeros_like(batch.kl))
    return r


def discounted_returns(r: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """`G_t = sum_{k>=t} gamma^(k-t) r_k` over masked tokens; masked positions pass G through."""
    m = mask.bool()
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[-1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        out[:, t] = running
    return torch.where(m, out, torch.zeros_like(out))


@register_estimator("reinforce_pp")
def reinforce_pp(batch: AdvantageBatch, *, gamma: float = 1.0, kl_coef: float = 0.0) -> AdvantageResult:
    """REINFORCE++: token rewards `-kl_coef*kl_t` (+ `R_i` on the last token), discounted return, whitened.

    `kl_coef` is the recipe's KL coefficient (beta) with KL in the reward;
    `batch.kl` must then be set. Whitening is over all tokens of the batch.
    """
    returns = discounted_returns(token_rewards(batch, kl_coef), batch.mask, gamma)
    return AdvantageResult(whiten(returns, batch.mask))


@register_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline(batch: AdvantageBatch) -> AdvantageResult:
    """`A_i = R_i - mean_g R` broadcast to tokens, then whitened over all tokens of the batch."""
    centred = outcome.dr_grpo(batch.rewards, batch.group_ids)
    return AdvantageResult(whiten(_broadcast(centred, batch.mask), batch.mask))


@register_estimator("gae")
def gae(
    batch: AdvantageBatch, *, gamma: float = 1.0, lam: float = 0.95, kl_coef: float = 0.0
) -> AdvantageResult:
    """GAE (PPO): `delta_t = r_t + gamma V_{t+1} - V_t`, `A_t = delta_t + gamma lam A_{t+1}`.

    Token rewards as in `token_rewards` (`R_i` on the last token, optional
    KL-in-reward). `V` after the last response token is 0 (episode end);
    masked positions are skipped (their V and A pass through). Returns
    `A + V` (raw A, before whitening) and the whitened A.
    """
    r, m, values = token_rewards(batch, kl_coef), batch.mask.bool(), batch.values
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[-1])):
        delta = r[:, t] + gamma * next_value - values[:, t]
        a_t = delta + gamma * lam * next_adv
        next_adv = torch.where(m[:, t], a_t, next_adv)
        next_value = torch.where(m[:, t], values[:, t], next_value)
        adv[:, t] = a_t
    adv = torch.where(m, adv, torch.zeros_like(adv))
    returns = torch.where(m, adv + values, torch.zeros_like(adv))
    return AdvantageResult(whiten(adv, batch.mask), returns)


@register_estimator("opd")
def opd(batch: AdvantageBatch) -> AdvantageResult:
    """On-policy distillation: `A_t = -(logp_t - logp_teacher_t)`, the per-token reverse KL to the teacher.

    `logp` is the sampling policy's (`logp_old`, no gradient); not whitened,
    so the advantage keeps its meaning as a log-ratio.
    """
    diff = batch.logp_teacher - batch.logp
    return AdvantageResult(torch.where(batch.mask.bool(), diff, torch.zeros_like(diff)).detach())
