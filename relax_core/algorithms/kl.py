"""Per-token KL estimators between the policy and the frozen reference model.

The trainer computes `logp_ref` with the reference model and, when the recipe
enables a KL loss term, adds `kl_coef * aggregate(k(logp, logp_ref))` to the
policy loss. Formulas: docs/algorithms.md, "KL to the reference"
(Schulman's k1/k2/k3 estimators of KL(pi || pi_ref), sampled from pi).
"""

from __future__ import annotations

import torch

from relax_core.algorithms.registry import register_kl

K3_CLAMP = 10.0


@register_kl("k1")
def k1(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """`logp - logp_ref` (unbiased, high variance, can be negative)."""
    return logp - logp_ref


@register_kl("k2")
def k2(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """`0.5 (logp - logp_ref)^2` (biased, low variance, non-negative)."""
    return 0.5 * (logp - logp_ref) ** 2


@register_kl("k3", aliases=("low_var_kl",))
def k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """low_var_kl: `exp(logp_ref - logp) - (logp_ref - logp) - 1`, clamped to [-10, 10].

    The clamp bounds the estimate (and its gradient) when the policy has moved
    far from the reference on a token; clamping the log-ratio too keeps
    `exp` finite so masked padding positions can never produce inf/NaN.
    """
    log_ratio = torch.clamp(logp_ref - logp, -20.0, 20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -K3_CLAMP, K3_CLAMP)
