"""The Megatron model behind the interface the torch backend's batching uses.

`CausalLM(model, vocab)(input_ids=, attention_mask=, position_ids=)` returns
an object with `.logits` `[B, L, vocab]`, as an HF causal LM does, so
`train/batching.forward_logprobs` (and with it every loss, estimator and
metric of the torch backend) runs unchanged on a Megatron model:

- the mask: Megatron takes a boolean `[B, 1, L, L]` (True = may not attend),
  made causal here, with right padding masked; a packed row (no attention
  mask, positions restarting at 0 per sample) gets a block-diagonal causal
  mask, so each sample sees only itself, as with flash-attention's varlen
  kernels (megatron-core's THD format needs those kernels: GPU only);
- the logits: vocab-parallel slices gathered over the TP group (a
  differentiable gather) and cut to the real vocabulary (Megatron pads it).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def attention_mask_(attention: torch.Tensor | None, position_ids: torch.Tensor) -> torch.Tensor:
    """Megatron's `[B, 1, L, L]` boolean mask (True = masked)."""
    batch, length = position_ids.shape
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    if attention is None:  # packed: sample k of the row spans the positions from its 0 to the next 0
        sample = torch.cumsum((position_ids == 0).long(), dim=1)  # [B, L]
        same = sample.unsqueeze(2) == sample.unsqueeze(1)
        allowed = causal.unsqueeze(0) & same
    else:
        keys = attention.bool().unsqueeze(1)  # [B, 1, L]
        allowed = causal.unsqueeze(0) & keys  # right padding: every query still sees position 0
    return (~allowed).unsqueeze(1)


class CausalLM(torch.nn.Module):
    """A (last-stage, PP=1) Megatron GPTModel answering like an HF causal LM."""

    def __init__(self, model: torch.nn.Module, vocab_size: int):
        super().__init__()
        self.model = model
        self.vocab_size = vocab_size
        self.config = SimpleNamespace(vocab_size=vocab_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = False) -> SimpleNamespace:
        from relax_core.train.megatron import compat

        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        mask = attention_mask_(attention_mask, position_ids)
        with compat.on_device():
            logits = self.model(input_ids, position_ids, mask)
        return SimpleNamespace(logits=full_logits(logits, self.vocab_size))


def full_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[B, L, V]` from this TP rank's vocab slice (GPTModel returns `[B, L, V/TP]`)."""
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]
