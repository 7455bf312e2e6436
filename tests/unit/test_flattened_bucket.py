"""A weight-sync bucket as one byte tensor (weights/sync.flattened), taken apart by the CPU engine's loader."""

from __future__ import annotations

import torch
import torch.distributed as dist

from relax_core.rollout.cpu_engine.weight_loader import WeightLoader
from relax_core.weights.sync import flattened


def test_one_dtype_is_one_tensor_of_the_bucket_bytes_in_order():
    a, b = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), torch.full((5,), -2.5, dtype=torch.bfloat16)
    flat = flattened([a, b])
    assert flat.dtype == torch.uint8 and flat.numel() == 2 * 11
    assert torch.equal(flat[:12].view(torch.bfloat16).reshape(2, 3), a)
    assert torch.equal(flat[12:].view(torch.bfloat16), b)


def test_an_offset_that_breaks_an_element_size_falls_back_to_one_broadcast_per_tensor():
    odd = torch.ones(3, dtype=torch.bfloat16)  # 6 bytes: a float32 after it would start at byte 6
    assert flattened([odd, torch.ones(2, dtype=torch.float32)]) is None
    assert flattened([torch.ones(2, dtype=torch.float32), odd]) is not None  # 8 bytes, then bf16: aligned
    assert flattened([odd]) is None  # a single tensor goes as it is


def test_the_cpu_engine_loads_a_flattened_bucket_into_its_parameters():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _load_one_bucket()
    finally:
        if created:
            dist.destroy_process_group()


def _load_one_bucket():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 4, bias=False))
    new = {name: torch.randn_like(t) for name, t in model.state_dict().items()}
    names = list(new)
    loader = WeightLoader(model)
    # one rank: the broadcast from rank 0 leaves the buffer as the sender filled it, so fill it the same way
    real = dist.broadcast

    def sender(tensor, src, group):
        tensor.copy_(flattened([new[n] for n in names]))
        return real(tensor, src=src, group=group)

    dist.broadcast = sender
    try:
        loader.receive_flattened(dist.group.WORLD, names, ["float32"] * len(names), [list(new[n].shape) for n in names])
    finally:
        dist.broadcast = real
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, new[name]), name


def test_buckets_of_small_tensors_go_flattened_over_gloo_large_ones_tensor_by_tensor():
    """Over gloo each collective has a fixed cost: many small tensors go as one byte tensor, large ones as they
    are (no packing copy); over NCCL every bucket is flattened; `flatten` given overrides both."""
    from relax_core.weights.sync import FLAT_BELOW_BYTES, WeightBroadcaster

    small = [("a", torch.zeros(64, 64)), ("b", torch.zeros(64))]  # 16 KiB and 256 B
    large = [("w", torch.zeros(FLAT_BELOW_BYTES // 2, 2)), ("n", torch.zeros(16))]  # ~1 MiB: 512 KiB a tensor

    def flat(bucket, **kwargs) -> list[bool]:
        sender = WeightBroadcaster([], "127.0.0.1", bucket_bytes=64 << 20, **kwargs)
        return [b.flat is not None for b in sender._buckets(bucket)]

    assert flat(small) == [True] and flat(large) == [False]
    assert WeightBroadcaster([], "127.0.0.1", backend="nccl")._flat_pays([t for _, t in large])  # no CUDA here
    assert flat(small, flatten=False) == [False] and flat(large, flatten=True) == [True]
    packed = next(WeightBroadcaster([], "127.0.0.1")._buckets(small))
    assert packed.names == ["a", "b"] and packed.flat.numel() == (64 * 64 + 64) * 4  # the bytes, in order
