"""The running batch of the CPU engine: one left-padded KV cache for all rows.

The scheduler (`batcher.py`) keeps every running sequence as one row of a
`KVBatch`. Rows are left-padded to a common length so a decode step is a
single forward pass of shape [B, 1]; a 2-D attention mask hides the padding
and explicit position ids keep each row's positions (RoPE) the same as in an
unpadded forward. New requests are prefilled together in their own
`KVBatch` (identical prompts once) and then merged in (continuous batching); finished rows are
dropped and all-padding columns trimmed, so attention never reads more
columns than the longest live row needs.

Keys and values of all layers live in one buffer per kind,
[layers, rows, kv_heads, capacity, head_dim], with spare columns on the
right. A decode step writes its one new column in place (`_SlabLayer`) and
the model attends over a view of the live columns, instead of concatenating
the whole cache of every layer, as `DynamicCache` does, at every step. The
buffer is copied only when rows join (merge), leave (keep) or the spare
columns run out (then the spare doubles), so that cost is amortised.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

# Spare columns a new buffer gets at least (it gets as many as it has live ones, if more).
MIN_SPARE_COLUMNS = 32


class ModelRunner:
    """Calls the model and counts forward passes.

    For a multimodal model (`media_inputs` given: `relax_core.models.multimodal.model_inputs`)
    positions are M-RoPE's: a text row's are its token index on every axis, a
    multimodal row's are computed at prefill and continue at decode as token index +
    the row's rope delta (see `positions`).
    """

    def __init__(self, model: torch.nn.Module, media_inputs: Callable | None = None) -> None:
        self.model = model
        self.media_inputs = media_inputs
        params = inspect.signature(model.forward).parameters
        # transformers 5.x renamed `past_key_values` to `cache`.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # Not every model takes it (Qwen3-Omni's thinker computes all logits).
        self._keep_kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.forward_passes = 0

    def last_logits(self, input_ids, mask, positions, cache, **media) -> torch.Tensor:
        """Logits [B, V] of the last position of each row; extends `cache`."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **self._keep_kw,
            **media,
            **{self._cache_kw: cache},
        )
        self.forward_passes += 1
        return out.logits[:, -1, :]

    def positions(self, index: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Position ids of decode tokens at token `index` [B, 1] of rows with rope `deltas` [B].

        A text model takes `index`; an M-RoPE model (transformers' Qwen3-VL / Omni
        layout) takes 4 rows: the token index (for the attention mask), then the
        temporal, height and width positions, all index + delta once past the media.
        """
        if self.media_inputs is None:
            return index
        shifted = index + deltas.unsqueeze(-1)
        return torch.stack([index, shifted, shifted, shifted])


class KVBatch:
    """KV cache and attention mask of a set of sequences, left-padded, with spare columns."""

    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self.keys: torch.Tensor | None = None  # [layers, B, kv_heads, capacity, head_dim]
        self.values: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None  # [B, capacity], 1 = real token
        self.start = self.end = 0  # live columns: [start, end)
        self.cache: DynamicCache | None = None  # its layers write into keys / values

    @property
    def size(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    @classmethod
    def prefill(cls, runner: ModelRunner, prompts: list[list[int]], pad_id: int) -> tuple[KVBatch, torch.Tensor]:
        """Run the prompts through the model in one left-padded forward.

        Identical prompts (a group's n samples) are run once and their keys and
        values copied to each of their rows, as SGLang's prefix cache shares them.
        """
        first_of: dict[tuple[int, ...], int] = {}
        rows = [first_of.setdefault(tuple(p), len(first_of)) for p in prompts]
        unique = [list(p) for p in first_of]
        width = max(len(p) for p in unique)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in unique])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in unique])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = runner.last_logits(ids, mask, positions, cache)
        keys, values = _cache_tensors(cache)
        if len(unique) < len(prompts):
            index = torch.tensor(rows)
            keys, values = [k[index] for k in keys], [v[index] for v in values]
            mask, logits = mask[index], logits[index]
        batch = cls()
        batch._fill([(keys, values, mask)])
        return batch, logits

    @classmethod
    def prefill_media(cls, runner: ModelRunner, prompt: list[int], tensors: dict) -> tuple[KVBatch, torch.Tensor, int]:
        """Run one multimodal prompt through the full model (vision / audio towers,
        deepstack features, M-RoPE positions); returns its batch, logits [1, V] and rope delta."""
        ids = torch.tensor([prompt])
        inputs = runner.media_inputs(runner.model, ids, torch.ones_like(ids), [tensors])
        positions = inputs.pop("position_ids")  # [4, 1, L]: token index, then t / h / w
        delta = int(positions[1:].max()) + 1 - len(prompt)  # get_rope_index's rope delta
        cache = DynamicCache()
        logits = runner.last_logits(inputs.pop("input_ids"), inputs.pop("attention_mask"), positions, cache, **inputs)
        keys, values = _cache_tensors(cache)
        batch = cls()
        batch._fill([(keys, values, torch.ones_like(ids))])
        return batch, logits, delta

    @classmethod
    def concat(cls, parts: list[KVBatch]) -> KVBatch:
        """The rows of `parts` in order (a part may repeat: its rows are copied again)."""
        if len(parts) == 1:
            return parts[0]
        batch = cls()
        batch._fill([p._live() for p in parts])
        return batch

    def decode(self, runner: ModelRunner, tokens: list[int], positions: list[int], deltas: list[int]) -> torch.Tensor:
        """One forward of the last token of every row (at token index `positions`,
        rope `deltas`, see `ModelRunner.positions`); returns logits [B, V]."""
        if self.end == self.mask.shape[1]:
            self._fill([self._live()])  # out of spare columns: copy into a bigger buffer
        self.mask[:, self.end] = 1
        ids = torch.tensor(tokens).unsqueeze(-1)
        pos = runner.positions(torch.tensor(positions).unsqueeze(-1), torch.tensor(deltas))
        logits = runner.last_logits(ids, self.mask[:, self.start : self.end + 1], pos, self.cache)
        self.end += 1
        return logits

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order), then trim all-padding columns."""
        if not rows:
            self._clear()
            return
        index, cols = torch.tensor(rows), slice(self.start, None)
        self.keys, self.values = self.keys[:, index, :, cols], self.values[:, index, :, cols]
        self.mask = self.mask[index, cols]
        self.start, self.end = 0, self.end - self.start
        self.start = int(self.mask[:, : self.end].any(dim=0).to(torch.int8).argmax())
        self._bind()

    def merge(self, other: KVBatch) -> None:
        """Append the rows of `other` after this batch's rows (into an empty batch: take its buffers)."""
        if not other.size:
            return
        if self.size:
            self._fill([self._live(), other._live()])
        else:
            self.keys, self.values, self.mask = other.keys, other.values, other.mask
            self.start, self.end = other.start, other.end
            self._bind()

    def _live(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cols = slice(self.start, self.end)
        return self.keys[..., cols, :], self.values[..., cols, :], self.mask[:, cols]

    def _fill(self, parts: list[tuple]) -> None:
        """Copy `parts` (keys and values by layer, and mask, of some left-padded rows) into new buffers.

        The rows are stacked in order and right-aligned at column `end`; the
        padding on their left is zero, so attention over it stays finite.
        """
        width = max(mask.shape[1] for _, _, mask in parts)
        rows = sum(mask.shape[0] for _, _, mask in parts)
        first = parts[0][0][0]  # [b, kv_heads, w, head_dim]
        layers, capacity = len(parts[0][0]), width + max(MIN_SPARE_COLUMNS, width)
        shape = (layers, rows, first.shape[1], capacity, first.shape[3])
        self.keys, self.values = first.new_zeros(shape), first.new_zeros(shape)
        self.mask = parts[0][2].new_zeros(rows, capacity)
        row = 0
        for keys, values, mask in parts:
            n, w = mask.shape
            target = (slice(row, row + n), slice(None), slice(width - w, width))
            for layer in range(layers):
                self.keys[layer][target] = keys[layer]
                self.values[layer][target] = values[layer]
            self.mask[row : row + n, width - w : width] = mask
            row += n
        self.start, self.end = 0, width
        self._bind()

    def _bind(self) -> None:
        cache = DynamicCache()
        cache.layers = [_SlabLayer(self, i) for i in range(self.keys.shape[0])]
        self.cache = cache


def _cache_tensors(cache: DynamicCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise NotImplementedError("the CPU engine supports full-attention KV caches only")
    return [la.keys for la in cache.layers], [la.values for la in cache.layers]


class _SlabLayer(DynamicLayer):
    """One layer of a `KVBatch` as transformers sees it: `update` writes the new
    columns in place at `end` and returns a view of the live ones."""

    def __init__(self, batch: KVBatch, index: int) -> None:
        super().__init__()
        self.batch, self.index = batch, index
        self.device = batch.keys.device
        self.is_initialized = True
        self._view(batch.end)

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.batch.end + key_states.shape[-2]
        self.batch.keys[self.index, :, :, self.batch.end : end] = key_states
        self.batch.values[self.index, :, :, self.batch.end : end] = value_states
        self._view(end)
        return self.keys, self.values

    def _view(self, end: int) -> None:
        cols = slice(self.batch.start, end)
        self.keys = self.batch.keys[self.index, :, :, cols]
        self.values = self.batch.values[self.index, :, :, cols]
