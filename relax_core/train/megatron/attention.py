"""The Megatron backend's core attention: torch's SDPA, one sample at a time on packed rows.

megatron-core's local layer spec attends with `DotProductAttention`: a `baddbmm` of the scores into a
`[B x heads x L x L]` buffer, an fp32 softmax under an explicit `[B, 1, L, L]` mask, and no packed
sequences (it asserts `packed_seq_params is None`; only Transformer Engine's attention takes them).
`SegmentAttention` takes its place in the spec (`model.layer_spec`; it has no parameters, so the model's
parameter names, its checkpoints and their Hugging Face conversion do not change) and calls
`torch.nn.functional.scaled_dot_product_attention`, which picks its flash kernel on a GPU and its
memory-efficient one on a CPU:

- a packed micro-batch (megatron-core's THD layout: `packed_seq_params.qkv_format == "thd"`, the
  query `[tokens, heads, head_dim]`, `cu_seqlens_q` where each sample starts) is attended one sample
  at a time, causal and unmasked: the memory of attention grows with the longest sample, never with
  the row (flash-attn's variable-length kernels, as a loop over the row's samples; megatron-core
  applies RoPE per sample itself, `rope_utils._apply_rotary_pos_emb_thd`);
- a right-padded micro-batch comes without a mask (the trainer passes none): causal attention never lets
  a real token see the padding after it, so no mask is needed for any token the loss reads;
- a mask when one is given (`[B, 1, Lq, Lk]`, True = may not attend, megatron-core's convention), as
  SDPA's boolean mask.

Grouped-query attention is SDPA's (`enable_gqa`): keys and values are not repeated per head. A plain
`torch.nn.Module` with no parameters, as megatron-core's checkpointing treats any such module: this file
imports megatron-core only when a model is built (a checkout without the megatron extra imports it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class SegmentAttention(torch.nn.Module):
    """A drop-in for megatron-core's `DotProductAttention` (same constructor and forward signature)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__()
        self.config = config
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism needs Transformer Engine's attention")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(f"{tp} tensor-parallel ranks do not divide the heads and key/value groups")
        self.attn_mask_type = attn_mask_type
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        if config.apply_query_key_layer_scaling:
            self.softmax_scale /= max(1, layer_number)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SegmentAttention takes no attention bias")
        causal = (attn_mask_type or self.attn_mask_type).name == "causal"  # megatron-core's AttnMaskType
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._thd(query, key, value, packed_seq_params, causal)
        if packed_seq_params is not None:
            raise ValueError(f"packed sequences in the {packed_seq_params.qkv_format!r} layout: only 'thd'")
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        allowed = None if attention_mask is None else ~attention_mask
        out = self._sdpa(q, k, v, allowed, causal and allowed is None and q.shape[2] == k.shape[2])
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def _thd(self, query, key, value, packed, causal: bool) -> torch.Tensor:
        """Each sample of the packed row (`[tokens, heads, d]`) by itself."""
        starts_q = _bounds(packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None
                           else packed.cu_seqlens_q)
        starts_k = _bounds(packed.cu_seqlens_kv_padded if packed.cu_seqlens_kv_padded is not None
                           else packed.cu_seqlens_kv)
        outputs = []
        for (qa, qb), (ka, kb) in zip(zip(starts_q, starts_q[1:]), zip(starts_k, starts_k[1:])):
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query[qa:qb], key[ka:kb], value[ka:kb]))
            outputs.append(self._sdpa(q, k, v, None, causal and qb - qa == kb - ka)[0].transpose(0, 1))
        out = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        return out.reshape(out.shape[0], -1)

    def _sdpa(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=causal,
            scale=self.softmax_scale, enable_gqa=self.groups != self.heads)


def _bounds(cu_seqlens: torch.Tensor) -> list[int]:
    return [int(x) for x in cu_seqlens.tolist()]
