"""Loss aggregation: from a per-token loss to the scalar that is back-propagated.

The trainer splits a step's batch over data-parallel ranks and micro-batches
and accumulates gradients. Every aggregator here therefore returns one
micro-batch's *contribution*: normalisers (token count, sequence count) are
the step's global totals passed in by the trainer, so the contributions of all
micro-batches on all ranks sum to the step's loss whatever the split. Called
without totals, an aggregator uses the micro-batch's own counts, i.e. gives the
stand-alone value. Formulas: docs/algorithms.md, "Aggregation".

All take `loss` and `mask` shaped `[num_seqs, num_tokens]`; masked positions
are selected out with `torch.where` (not multiplied), so an inf/NaN at a
padding position can neither leak into the value nor into the gradient.
"""

from __future__ import annotations

import torch

from relax_core.algorithms.registry import register_loss_agg


def masked(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The loss where `mask` is set, exactly 0 (and gradient 0) elsewhere."""
    return torch.where(mask.bool(), loss, torch.zeros_like(loss))


@register_loss_agg("token-mean")
def token_mean(
    loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    global_tokens: float | None = None,
    **_: object,
) -> torch.Tensor:
    """`sum(L m) / sum(m)`, the denominator summed over the whole step."""
    total = float(mask.sum()) if global_tokens is None else float(global_tokens)
    return masked(loss, mask).sum() / max(total, 1.0)


@register_loss_agg("seq-mean-token-sum")
def seq_mean_token_sum(
    loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    global_seqs: float | None = None,
    **_: object,
) -> torch.Tensor:
    """Mean over sequences of `sum_t L m`."""
    seqs = loss.shape[0] if global_seqs is None else float(global_seqs)
    return masked(loss, mask).sum() / max(seqs, 1.0)


@register_loss_agg("seq-mean-token-mean")
def seq_mean_token_mean(
    loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    global_seqs: float | None = None,
    **_: object,
) -> torch.Tensor:
    """Mean over sequences of `sum_t L m / sum_t m`; an all-masked sequence counts as 0."""
    seqs = loss.shape[0] if global_seqs is None else float(global_seqs)
    per_seq = masked(loss, mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / max(seqs, 1.0)


@register_loss_agg("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    global_seqs: float | None = None,
    norm_len: float | None = None,
    **_: object,
) -> torch.Tensor:
    """`sum(L m) / (num_seqs * norm_len)` (Dr. GRPO); `norm_len` defaults to the padded length."""
    seqs = loss.shape[0] if global_seqs is None else float(global_seqs)
    length = loss.shape[-1] if norm_len is None else float(norm_len)
    return masked(loss, mask).sum() / max(seqs * length, 1.0)
