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

Unsharded, the parameters are float32 too and the forward runs under
autocast in the compute dtype (`prepare`). The policy and PPO's critic are
prepared alike.

Recomputation (`train.recompute_activations`) keeps only each decoder
layer's input for the backward pass and runs the layer again there; it
wraps the layer's `forward` in place, so parameter names (the HF names the
weight sync and checkpoints use) do not change, and works in eval mode
(dropout stays off, which HF's own gradient checkpointing does not allow).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

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


def build(load: Callable[..., torch.nn.Module], *, fsdp: bool, recompute: bool, group: dist.ProcessGroup | None,
          device: str, compute_dtype: torch.dtype,
          freeze: Callable[[torch.nn.Module], object] | None = None) -> torch.nn.Module:
    """A trained model, ready: `load(weights=..., device=...)` gives it in float32 (the master weights).

    Sharded over several ranks, only rank 0 reads the checkpoint, into host memory; the other ranks build
    the module with its parameters on the meta device, and once every rank has sharded it, rank 0's tensors
    are broadcast one by one into the shards (torch's `set_model_state_dict(broadcast_from_rank0)`). No rank
    holds the whole float32 model on its GPU, and the host holds it once, not once per rank. `freeze` (the
    encoders a recipe keeps as loaded) runs before sharding."""
    many = fsdp and dist.is_initialized() and dist.get_world_size(group) > 1
    rank0 = not many or dist.get_rank(group) == 0
    model = load(weights=rank0, device="cpu" if fsdp else device)
    full = model.state_dict() if many and rank0 else {}
    if freeze is not None:
        freeze(model)
    prepare(model, fsdp=fsdp, recompute=recompute, group=group, device=device, compute_dtype=compute_dtype)
    if many:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def prepare(model: torch.nn.Module, *, fsdp: bool, recompute: bool, group: dist.ProcessGroup | None, device: str,
            compute_dtype: torch.dtype) -> None:
    """Ready a trained model whose parameters are float32 master weights: recomputation, then FSDP2 (which
    gathers them in `compute_dtype`), or unsharded with a lower compute dtype, its forward under autocast
    (never pure low-precision weights: AdamW's small updates round away in bfloat16)."""
    if recompute:
        recompute_activations(model)
    if fsdp:
        ensure_process_group("nccl" if torch.device(device).type == "cuda" else "gloo")
        shard_model(model, group, device, compute_dtype)
    elif compute_dtype != torch.float32:
        model.forward = functools.partial(_autocast, model.forward, torch.device(device).type, compute_dtype)


def _autocast(forward, device_type: str, dtype: torch.dtype, *args, **kwargs):
    with torch.autocast(device_type, dtype=dtype):
        return forward(*args, **kwargs)


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
