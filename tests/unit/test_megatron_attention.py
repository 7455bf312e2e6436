"""The Megatron backend's core attention (train/megatron/attention.py) against megatron-core's own
`DotProductAttention`, the module it replaces in the local spec: the same outputs for a masked batch, for
right-padded rows given no mask, and for a packed row in the THD layout (megatron-core's: a block-diagonal
causal mask of the whole row)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

HEADS, GROUPS, DIM = 4, 2, 16


@pytest.fixture(scope="module")
def modules():
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from relax_core.train.megatron.attention import SegmentAttention

    patch = pytest.MonkeyPatch()  # megatron-core's score buffer on `torch.cuda.current_device()`: the CPU here
    patch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    # its attention dropout (p = 0) runs under a fork of the CUDA generator: no generator to fork on the CPU
    patch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: SimpleNamespace(fork=contextlib.nullcontext))
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    buffer = ps._GLOBAL_MEMORY_BUFFER is None  # DotProductAttention's scores go into megatron-core's buffer
    if buffer:
        ps._set_global_memory_buffer()
    try:
        config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                                   num_query_groups=GROUPS, kv_channels=DIM, attention_dropout=0.0,
                                   attention_softmax_in_fp32=True, masked_softmax_fusion=False,
                                   use_cpu_initialization=True)
        groups = ProcessGroupCollection(tp=dist.new_group([0]))
        theirs = DotProductAttention(config, 1, AttnMaskType.causal, "self", pg_collection=groups)
        ours = SegmentAttention(config, 1, AttnMaskType.causal, "self", pg_collection=groups)
        yield theirs, ours
    finally:
        patch.undo()
        if buffer:
            ps.destroy_global_memory_buffer()
        if created:
            dist.destroy_process_group()


def qkv(length: int, batch: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(length, batch, HEADS, DIM, generator=gen),
            torch.randn(length, batch, GROUPS, DIM, generator=gen),
            torch.randn(length, batch, GROUPS, DIM, generator=gen))


def causal_mask(lengths: list[int], width: int) -> torch.Tensor:
    """megatron-core's `[B, 1, L, L]`, True = may not attend: causal, padding keys masked."""
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    keys = torch.tensor([[j < n for j in range(width)] for n in lengths])
    return ~(causal.unsqueeze(0) & keys.unsqueeze(1)).unsqueeze(1)


def test_a_masked_batch_attends_as_megatron_cores(modules):
    theirs, ours = modules
    q, k, v = qkv(7, 2)
    mask = causal_mask([7, 5], 7)
    assert torch.allclose(ours(q, k, v, mask), theirs(q, k, v, mask), atol=1e-5)


def test_right_padded_rows_need_no_mask_for_their_real_tokens(modules):
    theirs, ours = modules
    q, k, v = qkv(9, 3, seed=1)
    lengths = [9, 4, 6]
    unmasked, masked = ours(q, k, v, None), theirs(q, k, v, causal_mask(lengths, 9))
    for row, n in enumerate(lengths):
        assert torch.allclose(unmasked[:n, row], masked[:n, row], atol=1e-5), row


def test_a_packed_row_in_thd_attends_each_sample_by_itself(modules):
    from megatron.core.packed_seq_params import PackedSeqParams

    theirs, ours = modules
    lengths = [5, 1, 8, 3]
    total = sum(lengths)
    q, k, v = qkv(total, 1, seed=2)
    cu = torch.tensor([0, 5, 6, 14, 17], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=8, max_seqlen_kv=8)
    thd = ours(q.squeeze(1), k.squeeze(1), v.squeeze(1), None, packed_seq_params=packed)  # as attention.py hands it
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    block = ~((sample.unsqueeze(0) == sample.unsqueeze(1)) & torch.ones(total, total, dtype=torch.bool).tril())
    reference = theirs(q, k, v, block.view(1, 1, total, total))
    assert thd.shape == (total, HEADS * DIM)
    assert torch.allclose(thd, reference.squeeze(1), atol=1e-5)


def test_the_position_ids_of_a_packed_row_give_its_thd_bounds():
    from relax_core.train.megatron.forward import packed_seq_params

    params = packed_seq_params(torch.tensor([0, 1, 2, 0, 0, 1, 2, 3]))
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 3, 4, 8]
    assert params.max_seqlen_q == params.max_seqlen_kv == 4
