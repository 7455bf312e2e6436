"""Save and resume a training state as a Megatron-layout torch distributed checkpoint.

The trainer (torch backend now, Megatron backend later) hands over plain
state dicts (model, optimizer, scheduler, data cursor, step, policy
version, anything picklable) and gets them back in place after a restart;
RNG states of every rank are added and restored here. The controller calls
`save_checkpoint` every N steps and on SIGUSR1, and `load_checkpoint` on a
(re)start. `hf_export` reads the same files to write a Hugging Face model.

Crash safety: the DCP files are written to `CKPT/.tmp_iter_XXXXXXX/`,
renamed to `CKPT/iter_XXXXXXX/` once complete, and only then is the
tracker file replaced (atomically). Old iterations are pruned last.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_core.checkpoint import dcp_io, layout, rng
from relax_core.checkpoint.hf_files import ensure_hf_config
from relax_core.checkpoint.layout import CheckpointError
from relax_core.checkpoint.state_tree import PATHS_KEY, flatten, set_path

RNG_KEY = "rng"
RESERVED_KEYS = (RNG_KEY, PATHS_KEY)
_PROTECTED_NAMES = (layout.META_FILENAME, layout.DCP_METADATA_FILENAME)


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    iteration: int,
    state: Mapping[str, Any],
    *,
    keep_last: int | None = None,
    extra_files: Mapping[str, bytes | str] | None = None,
    hf_dir: str | os.PathLike | None = None,
    model_naming: str = "hf",
    save_rng: bool = True,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Write `CKPT/iter_{iteration:07d}/` and mark it latest; every rank of the group calls this.

    Args:
        state: top-level sections, e.g. {"model": ..., "optimizer": ...,
            "scheduler": ..., "data": {...}, "step": 7}. Values are nested
            dicts/lists of tensors and picklable objects, or objects with
            `state_dict()`/`load_state_dict()` (saved via their state dict).
            Model weights go under "model" (what `export_hf` reads). A section
            may be one rank's alone.
        keep_last: keep this many newest iterations (older ones are deleted
            after the new one is marked latest); None keeps all.
        extra_files: small files (name -> content) stored in the iteration dir.
        hf_dir: the HF model directory; its config/tokenizer files are copied
            to `CKPT/hf_config/` by the first save that names one.
        model_naming: how the "model" weights are named ("hf"; a Megatron
            backend will register its own), recorded for `export_hf`.
        save_rng: add every rank's python/numpy/torch RNG state.
        group: process group (default: the default group when initialised).

    Returns:
        The published iteration directory.
    """
    root = Path(ckpt_dir)
    name = layout.iteration_dirname(iteration)
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    plain, _ = _plain_state(state)
    _check_extra_files(extra_files)
    staging = layout.tmp_dir_for(root, name)
    _on_rank0(lambda: _prepare(root, staging), group)
    full = {**plain, RNG_KEY: rng.gather_all_ranks(group)} if save_rng else dict(plain)
    flat, paths = flatten(full)
    flat[PATHS_KEY] = _every_ranks_paths(paths, group)
    dcp_io.save_flat(staging, flat, group)
    meta = _meta(iteration, hf_dir, model_naming, group)
    _on_rank0(lambda: _finish(root, staging, iteration, meta, extra_files, hf_dir, keep_last), group)
    return layout.get_checkpoint_name(root, iteration)


def _every_ranks_paths(paths: dict, group: dist.ProcessGroup | None) -> dict:
    """The paths of every rank's entries: DCP keeps one rank's copy of the paths object, which must name
    the entries of a section only some ranks hold too."""
    if not dcp_io.distributed():
        return paths
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, paths, group=group)
    return {name: path for part in gathered for name, path in part.items()}


def load_checkpoint(
    ckpt_dir: str | os.PathLike,
    state_template: dict[str, Any],
    iteration: int | None = None,
    *,
    restore_rng: bool = True,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Load the latest (or the given) iteration into `state_template` in place.

    Tensors of the template are filled in place, other values replaced;
    entries the template lacks inside one of its sections (e.g. the Adam
    moments of a fresh optimizer's `state_dict()`) are created with their
    saved key types. Top-level objects with `load_state_dict` get it called.
    Sections of the checkpoint absent from the template are not read.
    Every rank of the group calls this.

    Returns:
        The iteration loaded.

    Raises:
        CheckpointError: missing directory or tracker, damaged files, or a
            template that does not match the checkpoint.
    """
    iteration, iter_dir = layout.resolve_iteration(ckpt_dir, iteration)
    layout.read_meta(iter_dir)
    metadata = dcp_io.read_metadata(iter_dir)
    saved_paths = read_saved_paths(iter_dir, metadata, collective=True, group=group)
    plain, statefuls = _plain_state(state_template)
    flat, paths = flatten(plain)
    sections = set(plain) | ({RNG_KEY} if restore_rng else set())
    for name, path in saved_paths.items():
        if path[0][0] in sections and name not in flat:
            flat[name], paths[name] = dcp_io.empty_entry(metadata, name), path
    dcp_io.check_targets(iter_dir, metadata, flat)
    dcp_io.load_flat(iter_dir, flat, collective=True, group=group)
    _write_back(state_template, plain, statefuls, flat, paths, restore_rng, group)
    return iteration


def read_saved_paths(iter_dir: Path, metadata, *, collective: bool, group: dist.ProcessGroup | None = None) -> dict:
    """Name -> original path of every entry, as stored by `save_checkpoint`."""
    holder: dict[str, Any] = {PATHS_KEY: None}
    dcp_io.check_targets(iter_dir, metadata, holder)
    dcp_io.load_flat(iter_dir, holder, collective=collective, group=group)
    return holder[PATHS_KEY]


def _write_back(template, plain, statefuls, flat, paths, restore_rng, group) -> None:
    loaded_rng: dict[str, Any] = {}
    for name, value in flat.items():
        section = paths[name][0][0]
        set_path(loaded_rng if section == RNG_KEY else plain, paths[name], value)
    for key, obj in statefuls.items():
        obj.load_state_dict(plain[key])
    for key in plain.keys() - statefuls.keys():
        template[key] = plain[key]
    if restore_rng and loaded_rng:
        rng.restore_own(loaded_rng[RNG_KEY], group)


def _plain_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state with objects replaced by their state dicts, and those objects by key."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of sections, got {type(state).__name__}")
    for key in state:
        if not isinstance(key, str) or key in RESERVED_KEYS:
            raise ValueError(f"state key {key!r} is not allowed (keys are str; {RESERVED_KEYS} are reserved)")
    statefuls = {k: v for k, v in state.items() if _is_stateful(v)}
    plain = {k: (v.state_dict() if k in statefuls else v) for k, v in state.items()}
    return plain, statefuls


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _check_extra_files(extra_files: Mapping[str, bytes | str] | None) -> None:
    for name in extra_files or {}:
        if "/" in name or name in ("", ".", "..") or name in _PROTECTED_NAMES or name.endswith(".distcp"):
            raise ValueError(f"extra file name {name!r} must be a plain file name not used by the checkpoint")


def _on_rank0(fn: Callable[[], None], group: dist.ProcessGroup | None) -> None:
    """Run `fn` on rank 0 only; if it fails, every rank raises (instead of waiting forever)."""
    if not dcp_io.distributed():
        fn()
        return
    failure: BaseException | None = None
    if dist.get_rank(group) == 0:
        try:
            fn()
        except BaseException as err:  # re-raised below, after telling the other ranks
            failure = err
    message = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    dist.broadcast_object_list(message, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    if failure is not None:
        raise failure
    if message[0] is not None:
        raise CheckpointError(f"rank 0 failed while writing the checkpoint: {message[0]}")


def _prepare(root: Path, staging: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    layout.clear_stale_tmp(root)
    staging.mkdir()


def _meta(iteration: int, hf_dir, model_naming: str, group) -> dict[str, Any]:
    world = dist.get_world_size(group) if dcp_io.distributed() else 1
    return {
        "format_version": layout.FORMAT_VERSION,
        "iteration": iteration,
        "world_size": world,
        "model_key": "model",
        "model_naming": model_naming,
        "hf_config_dir": layout.HF_CONFIG_DIRNAME if hf_dir is not None else None,
        "hf_source": os.fspath(Path(hf_dir).resolve()) if hf_dir is not None else None,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
    }


def _finish(root: Path, staging: Path, iteration: int, meta, extra_files, hf_dir, keep_last) -> None:
    """Rank 0, after all DCP files exist: extras, publish, mark latest, prune (in that order)."""
    for name, content in (extra_files or {}).items():
        (staging / name).write_bytes(content.encode() if isinstance(content, str) else content)
    if hf_dir is not None:
        ensure_hf_config(root, hf_dir)
    elif (root / layout.HF_CONFIG_DIRNAME).is_dir():
        meta["hf_config_dir"] = layout.HF_CONFIG_DIRNAME  # copied by an earlier save
    layout.write_meta(staging, meta)
    layout.publish_dir(staging, layout.get_checkpoint_name(root, iteration))
    layout.write_tracker(root, iteration)
    layout.prune(root, keep_last, latest=iteration)
