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

import contextlib
from collections.abc import Iterator
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


def attention_inputs(mb) -> tuple[torch.Tensor | None, object | None]:
    """(attention mask, packed-sequence parameters) of a micro-batch for `GPTModel.forward`, attended by
    `attention.SegmentAttention`: a packed row as megatron-core's THD layout (`PackedSeqParams`, where
    each sample starts from its position ids going back to 0); right-padded rows with no mask (causal
    attention never shows a real token the padding after it); otherwise Megatron's `[B, 1, L, L]` mask."""
    if mb.attention_mask is None and mb.input_ids.shape[0] == 1:
        return None, packed_seq_params(mb.position_ids[0])
    if mb.attention_mask is None or right_padded(mb.attention_mask):
        return None, None
    return attention_mask_(mb.attention_mask, mb.position_ids), None


def right_padded(attention: torch.Tensor) -> bool:
    """Every row's real tokens first, then only padding."""
    keep = attention.bool()
    return bool((keep[:, 1:] <= keep[:, :-1]).all())


def packed_seq_params(positions: torch.Tensor):
    """megatron-core's `PackedSeqParams` (THD) of one packed row whose position ids restart at 0 with each
    sample."""
    from megatron.core.packed_seq_params import PackedSeqParams

    starts = torch.nonzero(positions == 0).flatten()
    ends = torch.cat([starts[1:], torch.tensor([positions.numel()], device=positions.device)])
    cu = torch.cat([starts[:1], ends]).to(torch.int32)
    longest = int((ends - starts).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


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


class HeadResult(SimpleNamespace):
    """What `response_head` computed during one forward: `[B, R]` log-probs and entropy (None without it),
    or both None on a stage without the output layer."""

    logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


@contextlib.contextmanager
def response_head(model: torch.nn.Module, mb, *, vocab_size: int, with_entropy: bool) -> Iterator[HeadResult]:
    """While inside, the (last-stage) model's output layer computes the log-probs and entropy of `mb`'s
    response tokens from its hidden states, vocabulary-parallel and in chunks of tokens
    (`loss_head.VocabParallelHead`), into the result, in place of the logits: no rank holds `[tokens x
    V/TP]` logits, and neither prompt nor padding positions go through it. The model's own output is then
    a placeholder to ignore. A stage without the output layer (pipeline parallelism) runs as it is."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
    from megatron.core.utils import get_attr_wrapped_model

    from relax_core.train.loss_head import ResponseRows, _scatter, vocab_parallel_logprobs

    result = HeadResult()
    if not get_attr_wrapped_model(model, "post_process"):
        yield result
        return
    layer = get_attr_wrapped_model(model, "output_layer")
    rows = ResponseRows(mb.logit_index, mb.valid, mb.packed)
    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()

    def forward(hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        weight = layer.weight if weight is None else weight  # tied embeddings: the embedding's
        picked = copy_to_tensor_model_parallel_region(rows(hidden.transpose(0, 1)))  # [s, b, h] -> [N, h]
        logp, entropy = vocab_parallel_logprobs(picked, weight, mb.response_ids[mb.valid],
                                                vocab_start=rank * weight.shape[0], vocab_end=vocab_size,
                                                group=group, with_entropy=with_entropy)
        shape = tuple(mb.valid.shape)
        result.logp = _scatter(logp, shape, mb.valid)
        result.entropy = _scatter(entropy, shape, mb.valid) if entropy is not None else None
        return hidden.new_zeros(hidden.shape[0], hidden.shape[1], 1), None

    layer.forward = forward  # an instance attribute: nn.Module.__call__ looks it up before the class's
    try:
        yield result
    finally:
        del layer.forward
