"""FSDP2 sharding and activation recomputation for the torch backend.

    fully_shard(each decoder layer); fully_shard(the model)     (torch.distributed.fsdp)

Every data-parallel rank then holds 1/world of each parameter, of its
gradient and of the optimizer's moments; a layer's full weights exist only
while it runs (all-gathered in its forward, freed after, gathered again for
its backward), so a model larger than one device trains. Parameters stay in
float32 (the master weights) and are gathered in the compute dtype (bf16 on
GPUs: `MixedPrecisionPolicy`); gradients are reduce-scattered in float32 and
summed, not averaged, over ranks, as the unsharded trainer's all-reduce sums
them (the loss is normalised by step-global counts, algorithms/aggregation.py).

FSDP's collectives run inside forward and backward, so every rank must run
the same number of passes over the policy: `TorchTrainer` pads a rank with
fewer micro-batches with passes over a one-token batch that learns nothing.

Recomputation (`train.recompute_activations`) keeps only each decoder
layer's input for the backward pass and runs the layer again there; it
wraps the layer's `forward` in place, so parameter names (the HF names the
weight sync and checkpoints use) do not change, and works in eval mode
(dropout stays off, which HF's own gradient checkpointing does not allow).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the modules of the classes HF lists as `_no_split_modules` (also once
    sharded: FSDP2 renames a unit's class `FSDP<name>`)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__.removeprefix("FSDP") in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder-layer class (_no_split_modules); "
                         "it cannot be sharded or recomputed layer by layer")
    return layers


def language_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of the language model: `decoder_layers` less the vision and audio encoders' blocks."""
    from relax_core.models.multimodal import towers

    encoders = [model.get_submodule(prefix) for prefix in towers(model).values()]
    inside = {id(m) for encoder in encoders for m in encoder.modules()}
    return [layer for layer in decoder_layers(model) if id(layer) not in inside]


def recompute_activations(model: torch.nn.Module) -> int:
    """Make every decoder layer recompute its activations in the backward pass; returns how many."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = functools.partial(_checkpointed, layer.forward)
    return len(layers)


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # log-probs without a backward: nothing to save
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def ensure_process_group(backend: str) -> None:
    """A one-process group when none exists (FSDP2 needs one, also on a single rank)."""
    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def shard_model(model: torch.nn.Module, group: dist.ProcessGroup | None, device: str,
                compute_dtype: torch.dtype) -> None:
    """FSDP2 over `group` (None: the default group): each decoder layer of the language model a unit, the
    rest the root's. The vision and audio encoders' blocks stay in the root unit: a rank whose micro-batch
    has no image does not run them, and a unit of their own would then wait for its all-gather on the
    ranks whose micro-batch does (the root's parameters are gathered by every forward)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, torch.device(device).type)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    units = [*language_layers(model), model]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    for unit in units:  # each unit reduces its own gradients
        unit.set_gradient_divide_factor(1.0)  # sum over ranks, as the unsharded trainer's all-reduce
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, group: dist.ProcessGroup | None) -> float:
    """`torch.nn.utils.clip_grad_norm_` over sharded gradients: the norm of the whole gradient (each
    rank's shards' squares summed, then over ranks), every shard scaled by the same clip coefficient."""
    grads = [p.grad.to_local() for p in params if p.grad is not None]
    device = params[0].device if params else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        squares += g.detach().double().pow(2).sum()
    dist.all_reduce(squares, group=group)
    norm = float(squares.sqrt())
    coef = min(max_norm / (norm + 1e-6), 1.0)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    return norm


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter or gradient norm; a collective when sharded."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
