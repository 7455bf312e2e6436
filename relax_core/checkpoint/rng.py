"""Random-number-generator state of every rank, as tensors a checkpoint can hold.

A resumed run must draw the same random numbers (dropout, sampling, data
shuffles) as one that never stopped, so a checkpoint holds the python,
numpy, torch (and CUDA, when present) generator states. They are turned
into int tensors and plain numbers rather than pickled tuples, so they do
not depend on pickle compatibility of numpy objects. Like Megatron, each
rank's state is gathered so every rank saves the same list (one entry per
rank) and a rank restores its own entry.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def capture() -> dict[str, Any]:
    """This process's generator states."""
    py_version, py_internal, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python_version": py_version,
        "python_state": torch.tensor(py_internal, dtype=torch.int64),
        "python_gauss": py_gauss,
        "numpy_kind": np_kind,
        "numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def restore(state: dict[str, Any]) -> None:
    """Set this process's generators to `state` (as made by `capture`)."""
    torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    py_internal = tuple(int(v) for v in state["python_state"].tolist())
    random.setstate((state["python_version"], py_internal, state["python_gauss"]))
    np_keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(
        (state["numpy_kind"], np_keys, state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"])
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"].cpu()))


def gather_all_ranks(group: dist.ProcessGroup | None = None) -> list[dict[str, Any]]:
    """Every rank's `capture()`, in rank order (a one-element list without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [capture()]
    states: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, capture(), group=group)
    return states


def restore_own(states: list[dict[str, Any]], group: dist.ProcessGroup | None = None) -> None:
    """Restore this rank's entry of `gather_all_ranks()`'s list.

    When the world size changed since saving, rank r takes entry r mod n, so
    resuming on fewer or more ranks still works (with shared streams).
    """
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    restore(states[rank % len(states)])
