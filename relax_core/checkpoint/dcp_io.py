"""Thin, checked access to torch.distributed.checkpoint (DCP) files of one iteration dir.

Everything Relax reads or writes inside `iter_XXXXXXX/` goes through here:
the flat state saved by `dcp.save_checkpoint`, the in-place loads of
`dcp.load_checkpoint`, and the partial (model-only) loads of `hf_export`.
Before reading, the `.metadata` file and every data file it lists are
checked (present, long enough), so a damaged checkpoint fails with a
`CheckpointError` naming the file instead of a deep unpickling error.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from relax_core.checkpoint.layout import DCP_METADATA_FILENAME, CheckpointError


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # DCP warns on every single-process call that it assumes single-process intent: that is the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*(disabled|unavailable|uninitialized).*")
        yield


def save_flat(directory: Path, flat: dict[str, Any], group: dist.ProcessGroup | None = None) -> None:
    """Write a flat {name: tensor | object} mapping; every rank of the group must call it."""
    writer = dcp.FileSystemWriter(directory, sync_files=True)
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    with _quiet():
        dcp.save(flat, storage_writer=writer, planner=planner, process_group=group, no_dist=not distributed())


def read_metadata(iter_dir: Path) -> Metadata:
    """The DCP metadata of `iter_dir`, after checking the data files it lists."""
    path = iter_dir / DCP_METADATA_FILENAME
    if not path.is_file():
        raise CheckpointError(f"missing {path}: the checkpoint is incomplete or was damaged")
    try:
        metadata = dcp.FileSystemReader(iter_dir).read_metadata()
    except Exception as err:  # unpickling a truncated file raises many types
        raise CheckpointError(f"unreadable {path} ({type(err).__name__}): the file is truncated or corrupted") from err
    _check_data_files(iter_dir, metadata)
    return metadata


def _check_data_files(iter_dir: Path, metadata: Metadata) -> None:
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        path = iter_dir / relative
        if not path.is_file():
            raise CheckpointError(f"missing {path}, which {iter_dir / DCP_METADATA_FILENAME} lists")
        actual = path.stat().st_size
        if actual < size:
            raise CheckpointError(f"{path} is truncated: {actual} bytes, but the checkpoint needs at least {size}")


def empty_entry(metadata: Metadata, name: str) -> Any:
    """A load target for `name` when the caller has none: an empty tensor of the saved shape, or None."""
    entry = metadata.state_dict_metadata[name]
    if isinstance(entry, TensorStorageMetadata):
        return torch.empty(entry.size, dtype=entry.properties.dtype)
    return None


def check_targets(iter_dir: Path, metadata: Metadata, flat: dict[str, Any]) -> None:
    """Every target exists in the checkpoint with a compatible kind and shape."""
    saved = metadata.state_dict_metadata
    missing = sorted(set(flat) - set(saved))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"{iter_dir / DCP_METADATA_FILENAME} has no entries {shown} ({len(missing)} missing)")
    for name, target in flat.items():
        entry = saved[name]
        if isinstance(target, torch.Tensor) and isinstance(entry, BytesStorageMetadata):
            raise CheckpointError(f"{iter_dir}: entry {name} is saved as an object, but a tensor is expected")
        if isinstance(target, torch.Tensor) and tuple(entry.size) != tuple(target.shape):
            raise CheckpointError(
                f"{iter_dir}: entry {name} has shape {tuple(entry.size)} in the checkpoint, "
                f"but {tuple(target.shape)} here (a different model?)"
            )


def load_flat(
    iter_dir: Path, flat: dict[str, Any], *, collective: bool, group: dist.ProcessGroup | None = None
) -> None:
    """Load entries in place: tensors are copied into, objects replace the values of `flat`.

    Args:
        collective: True when every rank of the process group loads together
            (resume); False for a load in one process only (export), which
            must not wait on the other ranks.
    """
    reader = dcp.FileSystemReader(iter_dir)
    # Both flattenings off: `flat` is flat already, and with sharded-tensor flattening on,
    # DCP would load objects into a copy of `flat` rather than into `flat` itself.
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    no_dist = not (collective and distributed())
    try:
        with _quiet():
            dcp.load(flat, storage_reader=reader, planner=planner, process_group=group, no_dist=no_dist)
    except Exception as err:
        raise CheckpointError(f"failed to read the checkpoint in {iter_dir}: {type(err).__name__}: {err}") from err
