"""The running batch of the CPU engine: one left-padded KV cache for all rows.

The scheduler (`batcher.py`) keeps every running sequence as one row of a
`KVBatch`. Rows are left-padded to a common length so a decode step is a
single forward pass of shape [B, 1]; a 2-D attention mask hides the padding
and explicit position ids keep each row's positions (RoPE) the same as in an
unpadded forward. New requests are prefilled together in their own
`KVBatch` and then merged in (continuous batching); finished rows are
dropped and all-padding columns trimmed, so the cache never holds more than
the longest live row needs.
"""

from __future__ import annotations

import inspect

import torch


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
    """KV cache and attention mask of a set of sequences, left-padded."""

    def __init__(self, cache=None, mask: torch.Tensor | None = None) -> None:
        self.cache = cache
        self.mask = mask  # [B, L], 1 = real token

    @property
    def size(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    @classmethod
    def prefill(cls, runner: ModelRunner, prompts: list[list[int]], pad_id: int) -> tuple[KVBatch, torch.Tensor]:
        """Run the prompts through the model in one left-padded forward."""
        from transformers.cache_utils import DynamicCache

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = runner.last_logits(ids, mask, positions, cache)
        return cls(cache, mask), logits

    def decode(self, runner: ModelRunner, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One forward of the last token of every row; returns logits [B, V]."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.size, 1)], dim=1)
        ids = torch.tensor(tokens).unsqueeze(-1)
        pos = torch.tensor(positions).unsqueeze(-1)
        return runner.last_logits(ids, self.mask, pos, self.cache)

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order), then trim all-padding columns."""
        if not rows:
            self.cache, self.mask = None, None
            return
        index = torch.tensor(rows)
        self.mask = self.mask[index]
        for layer in self._layers(self.cache):
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self._trim()

    def merge(self, other: KVBatch) -> None:
        """Append the rows of `other` after this batch's rows."""
        if other.size == 0:
            return
        if self.size == 0:
            self.cache, self.mask = other.cache, other.mask
            return
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.mask = torch.cat([_left_pad(self.mask, width, -1), _left_pad(other.mask, width, -1)])
        for mine, theirs in zip(self._layers(self.cache), self._layers(other.cache)):
            mine.keys = torch.cat([_left_pad(mine.keys, width, -2), _left_pad(theirs.keys, width, -2)])
            mine.values = torch.cat([_left_pad(mine.values, width, -2), _left_pad(theirs.values, width, -2)])

    def _trim(self) -> None:
        start = int(self.mask.any(dim=0).to(torch.int8).argmax())
        if start == 0:
            return
        self.mask = self.mask[:, start:]
        for layer in self._layers(self.cache):
            layer.keys, layer.values = layer.keys[..., start:, :], layer.values[..., start:, :]

    @staticmethod
    def _layers(cache) -> list:
        from transformers.cache_utils import DynamicLayer

        layers = cache.layers
        if any(type(layer) is not DynamicLayer for layer in layers):
            raise NotImplementedError("the CPU engine supports full-attention KV caches only")
        return layers


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
