"""Handing a trainer's GPU memory back and taking it again (colocate on GPU nodes, controller/colocate.py).

    offload:  every storage behind the given tensors -> a host copy, then the storage resized to 0 bytes
    reload:   the storage resized back, the host copy written into it

A storage, not a tensor, is the unit: megatron-core's parameters and gradients
are views into one flat buffer per bucket, FSDP2's parameters views into its
padded shards, and every view of a storage sees it emptied and refilled, so
nothing that refers to a parameter (the optimizer, gradient hooks, the
buckets) has to be told. Storages on another device than the trainer's are left alone; those
whose contents do not matter across the hand-back (gradients, which the next
step zeroes first) are emptied without a copy. verl moves megatron-core's
buffers the same way (its `offload_megatron_model_to_cpu`); FSDP1 resizes its
flat parameters' storages to free them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class StorageOffload:
    """Which storages of `device` (the trainer's) this trainer emptied, and their host copies."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device).type
        self._held: dict[int, tuple[torch.UntypedStorage, torch.Tensor | None, int]] = {}

    def offload(self, tensors: Iterable[torch.Tensor], *, keep: bool = True) -> None:
        """Empty the storage of every tensor of the trainer's device in `tensors` (a copy of its bytes kept on
        the host unless `keep` is False: contents the next step overwrites before it reads them). Others (the
        CPU step counts of torch's Adam) stay as they are."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            nbytes = storage.nbytes()
            if storage.device.type != self.device or nbytes == 0:
                continue
            key = storage.data_ptr()
            if key in self._held:
                continue
            if not storage.resizable():  # the caching allocator's always are; a memory-mapped file's are not
                raise RuntimeError(f"a {tuple(tensor.shape)} tensor's storage cannot be handed back (it is not the "
                                   "allocator's: a memory-mapped checkpoint file?)")
            copy = None
            if keep:
                copy = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                copy.copy_(_bytes(storage), non_blocking=True)
            self._held[key] = (storage, copy, nbytes)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies are made before their sources go
        for storage, _, _ in self._held.values():
            storage.resize_(0)

    def reload(self) -> None:
        """Every emptied storage at its size again, with its bytes (or zeros, for those offloaded without)."""
        for storage, copy, nbytes in self._held.values():
            storage.resize_(nbytes)
            if copy is not None:
                _bytes(storage).copy_(copy, non_blocking=True)
            else:
                _bytes(storage).zero_()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._held.clear()

    @property
    def held_bytes(self) -> int:
        """Bytes this trainer handed back and will take again."""
        return sum(nbytes for _, _, nbytes in self._held.values())


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def module_tensors(module: torch.nn.Module | None) -> list[torch.Tensor]:
    """A module's parameters and buffers (their local shards when sharded)."""
    if module is None:
        return []
    out = []
    for tensor in [*module.parameters(), *module.buffers()]:
        local = getattr(tensor, "_local_tensor", None)  # a DTensor's own storage is its local shard's
        out.append(local if local is not None else tensor)
    return out


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """An optimizer's state tensors (Adam's moments, fused Adam's step count), local shards when sharded."""
    out = []
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = getattr(value, "_local_tensor", None)
                out.append(local if local is not None else value)
    return out


def megatron_optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """megatron-core's optimizer state: each inner torch optimizer's parameters (in bf16 runs the float32
    master copies; in float32 runs the model's own, which the caller leaves out) and its Adam state."""
    out: list[torch.Tensor] = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        out += [p for group in inner.optimizer.param_groups for p in group["params"]]
        out += optimizer_tensors(inner.optimizer)
    return out


def megatron_grad_buffers(ddp) -> list[torch.Tensor]:
    """megatron-core's `DistributedDataParallel` gradient buffers (every `main_grad` is a view into one)."""
    return [buffer.grad_data for buffer in [*ddp.buffers, *getattr(ddp, "expert_parallel_buffers", [])]]
