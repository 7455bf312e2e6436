"""Next-token sampling for a batch of rows with per-row parameters.

Called by the scheduler (`batcher.py`) once per forward pass on the logits of
the last position of every running sequence.

Log-probs follow SGLang's default (`SGLANG_RETURN_ORIGINAL_LOGPROB` unset): the
reported log-prob of a sampled token is taken from
`log_softmax(logits / temperature)`, i.e. after temperature scaling but before
top-k / top-p / min-p truncation (the truncated distribution is not
renormalised for reporting). Greedy rows (temperature 0) use temperature 1, so
they report `log_softmax(logits)`. With `SGLANG_RETURN_ORIGINAL_LOGPROB=1` in
the engine's environment, `log_softmax(logits)` is reported for every row, as
SGLang does. At temperature 1 the two agree, which is what RL recipes use.

A model that reads media never samples a media marker (`<|image_pad|>`,
`<|vision_start|>`, ...: `banned`): in a response such a token would be read
as a placeholder by the processor's forward in the trainer, which then finds
more placeholders than images. Real checkpoints do not emit them; a tiny
random one does. The reported log-prob stays the model's own (unmasked), so
it equals the trainer's; only the draw skips them.

Each sampled row draws its uniform number from its own `torch.Generator`, so
a request with a fixed `sampling_seed` gets the same tokens whatever else is
in the batch (up to floating-point differences of batched matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowSampling:
    """How one sequence samples its next token."""

    temperature: float
    top_k: int  # -1 disables
    top_p: float
    min_p: float
    greedy: bool
    generator: torch.Generator | None


def sample_next(
    logits: torch.Tensor, rows: list[RowSampling], original_logprob: bool = False, banned: list[int] | None = None
) -> tuple[list[int], list[float]]:
    """Sample one token per row of `logits` [B, V], never one of `banned`.

    Returns:
        The sampled token ids and their log-probs (see the module docstring).
    """
    logits = logits.float()
    temps = [1.0 if r.greedy else r.temperature for r in rows]
    scaled = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps).unsqueeze(-1)
    drawn_from, argmax_of = scaled, logits
    if banned:
        drawn_from, argmax_of = scaled.clone(), logits.clone()
        drawn_from[:, banned] = argmax_of[:, banned] = float("-inf")
    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    if len(sampled) == len(rows):  # the usual RL batch: no greedy row, no scatter
        tokens = _sample_rows(torch.softmax(drawn_from, dim=-1), rows)
    else:
        tokens = argmax_of.argmax(dim=-1)
        if sampled:
            index = torch.tensor(sampled)
            tokens[index] = _sample_rows(torch.softmax(drawn_from[index], dim=-1), [rows[i] for i in sampled])
    # log_softmax at the sampled token only: no [B, V] log-prob tensor.
    base = logits if original_logprob else scaled
    chosen = base.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - base.logsumexp(dim=-1)
    return tokens.tolist(), chosen.tolist()


def _sample_rows(probs: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    vocab = probs.shape[-1]
    uniform = torch.stack([torch.rand((), generator=r.generator) for r in rows])
    if not any(_truncates(r, vocab) for r in rows):
        return _inverse_cdf(probs, uniform).clamp(max=vocab - 1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    sorted_probs = _truncate(sorted_probs, rows)
    picked = _inverse_cdf(sorted_probs, uniform).clamp(max=vocab - 1)
    return order.gather(-1, picked.unsqueeze(-1)).squeeze(-1)


def _truncates(row: RowSampling, vocab: int) -> bool:
    return 0 < row.top_k < vocab or row.top_p < 1.0 or row.min_p > 0.0


def _truncate(sorted_probs: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Zero the tail of each row's sorted distribution (top-k, top-p, min-p)."""
    vocab = sorted_probs.shape[-1]
    top_k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows])
    top_p = torch.tensor([r.top_p for r in rows])
    min_p = torch.tensor([r.min_p for r in rows])
    rank = torch.arange(vocab).unsqueeze(0)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = rank >= top_k.unsqueeze(-1)
    drop |= mass_before > top_p.unsqueeze(-1)
    drop |= sorted_probs < (min_p * sorted_probs[:, 0]).unsqueeze(-1)
    return sorted_probs.masked_fill(drop, 0.0)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    # Unnormalised CDF: scaling u by the row total renormalises implicitly;
    # right=True skips zero-probability entries at u == 0.
    cdf = probs.cumsum(dim=-1)
    target = (uniform * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)
