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

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from relax_core.data.sample import Sample

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


def micro_bounds(samples: Sequence[Sample], size: int, max_tokens: int | None = None) -> list[int]:
    """Start offsets of consecutive micro-batches, plus `len(samples)` at the end.

    Each holds at most `size` samples and, with `max_tokens`, at most that many
    prompt+response tokens (a longer sample goes alone): the token budget
    of packed micro-batches (`pack(..., packed=True)`), where a batch of
    short responses takes more samples per pass than one of long ones.
    """
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    bounds, count, tokens = [0], 0, 0
    for i, s in enumerate(samples):
        length = len(s.prompt_ids) + s.response_len
        if count and (count == size or (max_tokens is not None and tokens + length > max_tokens)):
            bounds.append(i)
            count, tokens = 0, 0
        count, tokens = count + 1, tokens + length
    if count:
        bounds.append(len(samples))
    return bounds


@dataclass
class MicroBatch:
    """One padded micro-batch; per-token fields are `[B, R]`, R = longest response.

    Attributes:
        input_ids / attention_mask / position_ids: `[B, L]` model inputs,
            prompt+response right-padded to the longest sequence L; packed,
            `[1, T]`: the sequences one after another (T = their total
            length), position ids restarting at 0 for each, no attention
            mask (transformers then keeps each sequence to itself).
        logit_index: `[B, R]` position whose logits predict response token j
            (prompt_len + j - 1; packed, counted from the start of the row).
        response_ids: `[B, R]` response tokens (pad where j >= response_len).
        valid: `[B, R]` True where response token j exists.
        loss_mask: `[B, R]` float, 1 where the token exists and its
            `Sample.loss_mask` is 1 (the tokens that are learned from).
        rollout_logprobs: `[B, R]` the engine's log-probs (0 at padding).
        multimodal: each row's processor tensors (`Sample.multimodal`, {}
            for a text row) when any row has media; None for a text batch.
            The forward turns them into the model's vision/audio inputs and
            its M-RoPE position ids (`models/multimodal.py: model_inputs`).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    logit_index: torch.Tensor
    response_ids: torch.Tensor
    valid: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    packed: bool = False
    multimodal: list[dict] | None = None

    def at_logits(self, per_position: torch.Tensor) -> torch.Tensor:
        """`[B, R, X]`: the rows of a `[B, L, X]` (packed: `[1, T, X]`) model output that predict
        each response token."""
        if self.packed:
            return per_position[0][self.logit_index]
        index = self.logit_index.unsqueeze(-1).expand(-1, -1, per_position.shape[-1])
        return torch.gather(per_position, 1, index)

    @property
    def num_tokens(self) -> float:
        return float(self.loss_mask.sum())

    def response_lists(self, values: torch.Tensor) -> list[list[float]]:
        """Per-sample Python lists of a `[B, R]` tensor, cut to each response length."""
        lengths = self.valid.sum(-1).tolist()
        return [row[:n] for row, n in zip(values.tolist(), lengths)]


def pack(
    samples: Sequence[Sample], pad_id: int = 0, device: str | torch.device = "cpu", *, packed: bool = False
) -> MicroBatch:
    """Right-pad prompt+response of each sample into one micro-batch (`packed`: one row, no padding).

    Right padding keeps every real token at positions 0..len-1, so position
    ids are a plain arange and causal attention never looks at padding.
    A batch with media is always padded (M-RoPE positions are computed per
    row from its image and audio grids, which a packed row would mix).
    """
    for i, s in enumerate(samples):
        _check_sample(s, i)
    multimodal = [s.multimodal or {} for s in samples] if any(s.multimodal for s in samples) else None
    packed = packed and multimodal is None
    lengths = [len(s.prompt_ids) + s.response_len for s in samples]
    sequences = [list(s.prompt_ids) + list(s.response_ids) for s in samples]
    if packed:  # sample i starts where sample i-1 ended
        starts = [sum(lengths[:i]) for i in range(len(samples))]
        input_ids = torch.tensor([[t for seq in sequences for t in seq]], dtype=torch.long)
        position_ids = torch.tensor([[j for n in lengths for j in range(n)]], dtype=torch.long)
        attention_mask = None
    else:  # sample i is row i
        starts = [0] * len(samples)
        seq_len = max(lengths + [1])
        input_ids = _padded(sequences, seq_len, pad_id, torch.long)
        attention_mask = _padded([[1] * n for n in lengths], seq_len, 0, torch.long)
        position_ids = torch.arange(seq_len).unsqueeze(0).expand(len(samples), -1).contiguous()
        attention_mask = attention_mask.to(device)
    per_response = _response_fields(samples, starts, pad_id)
    return MicroBatch(input_ids.to(device), attention_mask, position_ids.to(device),
                      *(t.to(device) for t in per_response), packed=packed, multimodal=multimodal)


def _response_fields(samples: Sequence[Sample], starts: list[int], pad_id: int) -> tuple[torch.Tensor, ...]:
    """`[B, R]` logit_index, response_ids, valid, loss_mask and rollout log-probs; `starts`: where each
    sample's sequence begins in its row of the model input."""
    resp_len = max([s.response_len for s in samples] + [0])
    logit_index = _padded([range(start + len(s.prompt_ids) - 1, start + len(s.prompt_ids) + s.response_len - 1)
                           for s, start in zip(samples, starts)], resp_len, 0, torch.long)
    response_ids = _padded([s.response_ids for s in samples], resp_len, pad_id, torch.long)
    valid = _padded([[True] * s.response_len for s in samples], resp_len, False, torch.bool)
    loss_mask = _padded([s.loss_mask for s in samples], resp_len, 0.0, torch.float32)
    rollout = _padded([s.rollout_logprobs or [0.0] * s.response_len for s in samples], resp_len, 0.0,
                      torch.float32)
    return logit_index, response_ids, valid, loss_mask, rollout


def _padded(rows, width: int, fill, dtype: torch.dtype) -> torch.Tensor:
    """`[len(rows), width]` of `dtype`, each row right-padded with `fill`: one tensor built from Python
    lists (a copy per row costs more than a small step's arithmetic)."""
    return torch.tensor([list(row) + [fill] * (width - len(row)) for row in rows], dtype=dtype).reshape(
        len(rows), width)


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
    rows = mb.at_logits(logits).float()
    logp_all = torch.log_softmax(rows, dim=-1)
    logp = torch.gather(logp_all, -1, mb.response_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def forward_logprobs(
    model: torch.nn.Module, mb: MicroBatch, *, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the model on a micro-batch: the `[B, R]` log-probs of its response tokens, and their entropy.

    The output layer of a causal LM runs in chunks of response tokens inside the loss
    (`loss_head.fused_forward`), so no `[tokens x vocabulary]` tensor is made; a model that changes its
    logits after the output layer (a soft-cap, a scale) gives `response_logprobs` of its logits.

    A sharded model that learns through its vision or audio encoder also runs the encoders this
    micro-batch does not use, times zero (`multimodal.unused_encoders`): every rank's backward then
    reduces the same gradients, whichever media its rows have."""
    from relax_core.train.loss_head import fused_forward

    head = _fused_head(model, mb.input_ids.device)
    inputs = _model_inputs(model, mb)
    with _encoders_run(model, mb):
        if head is not None:
            out = fused_forward(model, head, inputs, mb, with_entropy=with_entropy)
            if out is None:
                raise RuntimeError(f"{type(model).__name__} changed its output layer's result on this batch only")
            return out
        logits = model(**inputs, use_cache=False).logits
    return response_logprobs(logits, mb, with_entropy=with_entropy)


def _model_inputs(model: torch.nn.Module, mb: MicroBatch) -> dict:
    if mb.multimodal is not None:
        from relax_core.models.multimodal import model_inputs

        return model_inputs(model, mb.input_ids, mb.attention_mask, mb.multimodal)
    return {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask, "position_ids": mb.position_ids}


def _encoders_run(model: torch.nn.Module, mb: MicroBatch):
    if torch.is_grad_enabled() and _sharded_with_encoders(model):
        from relax_core.models.multimodal import batch_media, encoders_always_run
        from relax_core.train.sharding import language_layers

        return encoders_always_run(model, batch_media(mb.multimodal or []), language_layers(model)[0])
    return contextlib.nullcontext()


def _fused_head(model: torch.nn.Module, device: torch.device):
    """The output layer the chunked loss head stands in for, or None (then the model's logits are used).
    Checked once per model with a one-token forward (every rank of a sharded model makes its first call
    together, as every later one)."""
    from relax_core.train.loss_head import FUSED, fused_forward, output_layer

    if not hasattr(model, FUSED):
        head = output_layer(model)
        fused = head is not None
        if fused:
            probe = pack([Sample(prompt_ids=[0], response_ids=[0], rollout_logprobs=[0.0], loss_mask=[0])],
                         device=device)
            with torch.no_grad():
                fused = fused_forward(model, head, _model_inputs(model, probe), probe, with_entropy=False) is not None
        setattr(model, FUSED, fused)
    return output_layer(model) if getattr(model, FUSED) else None


def _sharded_with_encoders(model: torch.nn.Module) -> bool:
    """FSDP2 wraps it (asked of the module: its parameters are plain tensors while a forward left them
    gathered, as the root unit's are after the head's one-token check)."""
    from torch.distributed.fsdp import FSDPModule

    from relax_core.models.multimodal import towers

    return isinstance(model, FSDPModule) and bool(towers(model))
