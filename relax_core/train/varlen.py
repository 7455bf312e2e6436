"""Attention over packed rows, one sample at a time: never a `[T x T]` mask or score matrix for the row.

A packed micro-batch (`batching.pack(..., packed=True)`) is one row of several samples, its position ids
starting again at 0 with each. Transformers' own `sdpa` attention builds a block-causal boolean mask of
the whole row for it (`masking_utils.create_causal_mask` on packed position ids), `[T x T]`: 277 MB at
16k tokens, and with a mask SDPA on a GPU cannot use its flash kernel, and on a CPU runs its math kernel,
whose scores are `[heads x T x T]` floats. Here each sample of the row is attended by itself, causal and
unmasked, through transformers' `sdpa_attention_forward`, so SDPA picks its flash kernel on a GPU and
the memory of attention grows with the longest sample, not with the row (the variable-length attention
of flash-attn's `varlen` kernels, as a loop over the row's samples: the loop costs one kernel call per
sample and layer, a few dozen per micro-batch).

`use_varlen(model)` switches a causal LM to it: registered with transformers as the attention
implementation `relax_varlen` and its mask function, which builds no mask where the model has no padding
mask (a packed row, or one unpadded sequence) and SDPA's mask otherwise, so padded micro-batches, and
generation with a cache, run exactly as under `sdpa`. A model with sliding-window layers keeps `sdpa`
(the window would have to be applied per sample: not done).
"""

from __future__ import annotations

import torch

NAME = "relax_varlen"


def use_varlen(model: torch.nn.Module) -> bool:
    """Attend packed rows sample by sample in `model` (a transformers causal LM on `sdpa`); whether it now
    does. Models on another implementation (eager, flash-attn, flex) and those with sliding windows keep it."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return False
    _register()
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, varlen_mask)


def varlen_mask(batch_size: int, q_length: int, kv_length: int, *args, attention_mask=None, **kwargs):
    """No mask for rows without padding and without a cache (each packed sample is attended by itself in
    `varlen_attention`); SDPA's mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and q_length == kv_length:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, **kwargs)


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *args, position_ids: torch.Tensor | None = None, **kwargs):
    """Transformers' SDPA attention, run on each sample of a packed row by itself (`[B, H, T, D]` query,
    key and value; the output `[B, T, H, D]` as `sdpa_attention_forward` gives it)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = _sample_bounds(position_ids, query, key, attention_mask)
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    outputs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, *args,
                                      **kwargs)[0] for a, b in zip(bounds, bounds[1:])]
    return torch.cat(outputs, dim=1), None


def _sample_bounds(position_ids, query, key, attention_mask) -> list[int] | None:
    """Where each sample of a packed row starts (a position id that does not follow the one before it, as
    transformers' `find_packed_sequence_indices` reads them), plus the row's end; None when the row is one
    sequence or the attention is not over one unpadded row of its own keys."""
    if position_ids is None or attention_mask is not None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return None
    positions = position_ids.reshape(-1, position_ids.shape[-1])[0]
    if positions.shape[0] != query.shape[2]:
        return None
    starts = (torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1).tolist()
    if not starts:
        return None
    return [0, *starts, query.shape[2]]
