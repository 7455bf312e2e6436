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

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

# Spare columns a new buffer gets at least (it gets as many as it has live ones, if more).
MIN_SPARE_COLUMNS = 32


class ModelRunner:
    """Calls the causal LM and counts forward passes."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        # transformers 5.x renamed `past_key_values` to `cache`.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.forward_passes = 0

    def last_logits(self, input_ids, mask, positions, cache) -> torch.Tensor:
        """Logits [B, V] of the last position of each row; extends `cache`."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        self.forward_passes += 1
        return out.logits[:, -1, :]


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
        if any(type(layer) is not DynamicLayer for layer in cache.layers):
            raise NotImplementedError("the CPU engine supports full-attention KV caches only")
        batch = cls()
        keys, values = [la.keys for la in cache.layers], [la.values for la in cache.layers]
        if len(unique) < len(prompts):
            index = torch.tensor(rows)
            keys, values = [k[index] for k in keys], [v[index] for v in values]
            mask, logits = mask[index], logits[index]
        batch._fill([(keys, values, mask)])
        return batch, logits

    def decode(self, runner: ModelRunner, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One forward of the last token of every row; returns logits [B, V]."""
        if self.end == self.mask.shape[1]:
            self._fill([self._live()])  # out of spare columns: copy into a bigger buffer
        self.mask[:, self.end] = 1
        ids = torch.tensor(tokens).unsqueeze(-1)
        pos = torch.tensor(positions).unsqueeze(-1)
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
