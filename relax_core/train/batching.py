"""From a list of `Sample`s to padded tensors, and from logits back to log-probs.

Sits between the data a trainer receives (plain-Python `Sample`s, one per
response) and the model forward: splits a step's samples over data-parallel
ranks, mini-batches and micro-batches, right-pads each micro-batch of
prompt+response sequences, and gathers the log-prob of each response token
from the logits. Per-token tensors are kept in *response coordinates*
(`[batch, max_response_len]`, column j = response token j), so advantages,
old/rollout/reference log-probs and masks line up without offsets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from relax_core.rollout.types import Sample

T = TypeVar("T")


def shard(items: Sequence[T], rank: int, world_size: int) -> list[T]:
    """Contiguous, near-equal slice `rank` of `world_size` (sizes differ by at most 1)."""
    bounds = shard_bounds(len(items), world_size)
    return list(items[bounds[rank] : bounds[rank + 1]])


def shard_bounds(n: int, parts: int) -> list[int]:
    """Start offsets of `parts` contiguous chunks of `n` items, plus `n` at the end."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def chunks(items: Sequence[T], size: int) -> list[list[T]]:
    """Consecutive pieces of at most `size` items (the micro-batches)."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


@dataclass
class MicroBatch:
    """One padded micro-batch; per-token fields are `[B, R]`, R = longest response.

    Attributes:
        input_ids / attention_mask / position_ids: `[B, L]` model inputs,
            prompt+response right-padded to the longest sequence L.
        logit_index: `[B, R]` position whose logits predict response token j
            (prompt_len + j - 1).
        response_ids: `[B, R]` response tokens (pad where j >= response_len).
        valid: `[B, R]` True where response token j exists.
        loss_mask: `[B, R]` float, 1 where the token exists and its
            `Sample.loss_mask` is 1 (the tokens that are learned from).
        rollout_logprobs: `[B, R]` the engine's log-probs (0 at padding).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    logit_index: torch.Tensor
    response_ids: torch.Tensor
    valid: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor

    @property
    def num_tokens(self) -> float:
        return float(self.loss_mask.sum())

    def response_lists(self, values: torch.Tensor) -> list[list[float]]:
        """Per-sample Python lists of a `[B, R]` tensor, cut to each response length."""
        lengths = self.valid.sum(-1).tolist()
        return [row[:n] for row, n in zip(values.tolist(), lengths)]


def pack(
    samples: Sequence[Sample], pad_id: int = 0, device: str | torch.device = "cpu"
) -> MicroBatch:
    """Right-pad prompt+response of each sample into one micro-batch.

    Right padding keeps every real token at positions 0..len-1, so position
    ids are a plain arange and causal attention never looks at padding.
    """
    batch = len(samples)
    seq_len = max([len(s.prompt_ids) + s.response_len for s in samples] + [1])
    resp_len = max([s.response_len for s in samples] + [0])
    input_ids = torch.full((batch, seq_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, seq_len), dtype=torch.long)
    logit_index = torch.zeros((batch, resp_len), dtype=torch.long)
    response_ids = torch.full((batch, resp_len), pad_id, dtype=torch.long)
    valid = torch.zeros((batch, resp_len), dtype=torch.bool)
    loss_mask = torch.zeros((batch, resp_len), dtype=torch.float32)
    rollout = torch.zeros((batch, resp_len), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), s.response_len
        _check_sample(s, i)
        input_ids[i, : p + r] = torch.tensor(
            list(s.prompt_ids) + list(s.response_ids), dtype=torch.long
        )
        attention_mask[i, : p + r] = 1
        logit_index[i, :r] = torch.arange(p - 1, p + r - 1)
        response_ids[i, :r] = torch.tensor(s.response_ids, dtype=torch.long)
        valid[i, :r] = True
        loss_mask[i, :r] = torch.tensor(s.loss_mask, dtype=torch.float32)
        rollout[i, :r] = torch.tensor(
            s.rollout_logprobs or [0.0] * r, dtype=torch.float32
        )
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(batch, -1).contiguous()
    tensors = (
        input_ids,
        attention_mask,
        position_ids,
        logit_index,
        response_ids,
        valid,
        loss_mask,
        rollout,
    )
    return MicroBatch(*(t.to(device) for t in tensors))


def _check_sample(s: Sample, index: int) -> None:
    if not s.prompt_ids:
        raise ValueError(
            f"sample {index} has an empty prompt; a response needs at least one prompt token"
        )
    if len(s.loss_mask) != s.response_len:
        raise ValueError(
            f"sample {index}: loss_mask has {len(s.loss_mask)} entries for {s.response_len} response tokens"
        )
    if s.rollout_logprobs and len(s.rollout_logprobs) != s.response_len:
        raise ValueError(
            f"sample {index}: {len(s.rollout_logprobs)} rollout log-probs for {s.response_len} response tokens"
        )


def response_logprobs(
    logits: torch.Tensor, mb: MicroBatch, *, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (temperature 1) of each response token, and optionally the entropy.

    Only the `[B, R]` rows that predict response tokens go through the
    (float32) log-softmax, not the whole `[B, L]` sequence. The entropy is
    detached: it is a diagnostic, never part of the loss here.
    """
    vocab = logits.shape[-1]
    index = mb.logit_index.unsqueeze(-1).expand(-1, -1, vocab)
    rows = torch.gather(logits, 1, index).float()
    logp_all = torch.log_softmax(rows, dim=-1)
    logp = torch.gather(logp_all, -1, mb.response_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def forward_logprobs(
    model: torch.nn.Module, mb: MicroBatch, *, with_entropy: bool = False
):
    """Run the model on a micro-batch and return `response_logprobs` of its logits."""
    out = model(
        input_ids=mb.input_ids,
        attention_mask=mb.attention_mask,
        position_ids=mb.position_ids,
        use_cache=False,
    )
    return response_logprobs(out.logits, mb, with_entropy=with_entropy)
