"""Engine side of the weight sync: receive broadcast tensors into the model.

`/update_weights_from_distributed` lists names, dtypes and shapes; the trainer
(rank 0 of the weight-update group, see `relax_core.weights.sync`) then
broadcasts one tensor per name in that order, or (`load_format:
"flattened_bucket"`) the bucket's bytes as one tensor (`receive_flattened`). `WeightLoader.receive` posts the
matching `torch.distributed.broadcast(src=0)` calls, exactly as SGLang's model
runner does, and copies the tensors into the model. It runs on the scheduler
thread (`Batcher.call`), so no forward pass sees half-updated weights.
`WeightLoader.load` does the copying, also for tensors handed over by
reference (`/update_weights_from_tensor`, `relax_core.rollout.weight_wire`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class WeightLoader:
    """Maps Hugging Face parameter names to the live tensors of the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        # state_dict(keep_vars=True) holds the Parameters themselves, with both
        # names of tied weights, so either name updates the shared tensor.
        self.tensors = model.state_dict(keep_vars=True)

    def receive(self, group: dist.ProcessGroup, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        """Receive every tensor, then load them; raises ValueError on a mismatch.

        All broadcasts are received even when a name is unknown, so the
        trainer never hangs on an engine that rejects part of an update.
        """
        self.load([self._receive_one(group, *spec) for spec in zip(names, dtypes, shapes)])

    def receive_flattened(self, group: dist.ProcessGroup, names: list[str], dtypes: list[str],
                          shapes: list[list[int]]) -> None:
        """`load_format="flattened_bucket"`: one broadcast of the bucket's bytes, the tensors one after another
        in the order of `names` (SGLang 0.5.23's `FlattenedTensorBucket.empty` and `reconstruct_tensors`,
        sglang/srt/weight_sync/tensor_bucket.py:86-137, which tests/sglang_real.py runs against the trainer)."""
        specs, offset = [], 0
        for name, dtype, shape in zip(names, dtypes, shapes):
            dtype_ = parse_dtype(dtype)
            if offset % dtype_.itemsize:
                raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype_}")
            size = torch.Size(shape).numel() * dtype_.itemsize
            specs.append((name, dtype_, shape, offset, size))
            offset += size
        flat = torch.empty(offset, dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=group)
        self.load([(name, flat[start:start + size].view(dtype_).reshape(shape))
                   for name, dtype_, shape, start, size in specs])

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the model by name (also those handed over by reference,
        `/update_weights_from_tensor`); raises ValueError on a mismatch, after loading the rest."""
        problems = [msg for msg in (self._load(name, t) for name, t in named) if msg]
        if problems:
            raise ValueError("; ".join(problems))

    def _receive_one(self, group, name: str, dtype: str, shape: list[int]) -> tuple[str, torch.Tensor]:
        dtype_ = parse_dtype(dtype)
        target = self.tensors.get(name)
        # Receive straight into the parameter when it fits, else into a buffer.
        buffer = target.data if _fits(target, dtype_, shape) else torch.empty(shape, dtype=dtype_)
        dist.broadcast(buffer, src=0, group=group)
        return name, buffer

    def _load(self, name: str, tensor: torch.Tensor) -> str | None:
        target = self.tensors.get(name)
        if target is None:
            return f"unknown parameter {name!r}"
        if target.shape != tensor.shape:
            return f"{name}: shape {list(tensor.shape)} != model's {list(target.shape)}"
        if tensor.data_ptr() != target.data_ptr():
            with torch.no_grad():
                target.data.copy_(tensor)
        return None


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16 (SGLang's dtype strings)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _fits(target: torch.Tensor | None, dtype: torch.dtype, shape: list[int]) -> bool:
    return target is not None and target.dtype == dtype and list(target.shape) == list(shape) and target.is_contiguous()
