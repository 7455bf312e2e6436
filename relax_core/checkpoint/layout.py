"""Megatron's on-disk checkpoint layout: names, the latest marker, atomic publishing.

A checkpoint root looks exactly like one of Megatron-LM's (names taken from
`megatron/training/checkpointing.py`: `get_checkpoint_name`,
`get_checkpoint_tracker_filename`, `read_metadata`)::

    CKPT/latest_checkpointed_iteration.txt   # the iteration number, e.g. "100"
    CKPT/iter_0000100/                        # torch.distributed.checkpoint files
        .metadata  __0_0.distcp  ...  relax_meta.json
    CKPT/hf_config/                           # Relax: HF config + tokenizer, copied once

Writers (`dcp.save_checkpoint`) fill a hidden temporary directory, rename it
into place, and only then replace the tracker file, so the tracker never
names a partial checkpoint. This module is stdlib only: the CLI imports
`CheckpointError` from here without pulling in torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from relax_core.errors import UserError

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
META_FILENAME = "relax_meta.json"
HF_CONFIG_DIRNAME = "hf_config"
DCP_METADATA_FILENAME = ".metadata"
FORMAT_VERSION = 1
TMP_PREFIX = ".tmp_"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(UserError):
    """A checkpoint cannot be used as asked; the message names the offending file.

    Raised for what a user can get wrong (a missing directory, a tracker that
    names no checkpoint, truncated or missing DCP files); the CLI maps it to
    exit code 2.
    """


def iteration_dirname(iteration: int) -> str:
    """`iter_0000100` for 100, as Megatron's `'iter_{:07d}'.format(iteration)`."""
    if not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be an int >= 0, got {iteration!r}")
    return f"iter_{iteration:07d}"


def get_checkpoint_name(ckpt_dir: str | Path, iteration: int) -> Path:
    """The directory of one iteration (Megatron's `get_checkpoint_name(..., return_base_dir=True)`)."""
    return Path(ckpt_dir) / iteration_dirname(iteration)


def get_checkpoint_tracker_filename(ckpt_dir: str | Path) -> Path:
    """The file that names the latest complete iteration."""
    return Path(ckpt_dir) / TRACKER_FILENAME


def require_ckpt_root(ckpt_dir: str | Path) -> Path:
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist (or is not a directory)")
    return root


def read_tracker(ckpt_dir: str | Path) -> int:
    """The iteration the tracker file names (Megatron's `read_metadata`, without 'release')."""
    tracker = get_checkpoint_tracker_filename(require_ckpt_root(ckpt_dir))
    if not tracker.is_file():
        raise CheckpointError(f"no tracker file {tracker}: {ckpt_dir} holds no complete checkpoint")
    text = tracker.read_text().strip()
    if not text.isdigit():
        # Megatron also accepts 'release'; Relax never writes release checkpoints.
        raise CheckpointError(f"tracker file {tracker} should hold an iteration number, found {text[:40]!r}")
    return int(text)


def find_latest(ckpt_dir: str | Path) -> int | None:
    """The latest complete iteration, or None when `ckpt_dir` has no tracker (or does not exist).

    Raises:
        CheckpointError: the tracker is unreadable or names a missing iteration directory.
    """
    root = Path(ckpt_dir)
    if not get_checkpoint_tracker_filename(root).is_file():
        return None
    iteration = read_tracker(root)
    require_iteration_dir(root, iteration)
    return iteration


def require_iteration_dir(ckpt_dir: str | Path, iteration: int) -> Path:
    path = get_checkpoint_name(ckpt_dir, iteration)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} for iteration {iteration} does not exist")
    return path


def resolve_iteration(ckpt_dir: str | Path, iteration: int | None) -> tuple[int, Path]:
    """The iteration to read (the tracker's when None) and its directory, both checked."""
    root = require_ckpt_root(ckpt_dir)
    if iteration is None:
        iteration = read_tracker(root)
    return iteration, require_iteration_dir(root, iteration)


def list_iterations(ckpt_dir: str | Path) -> list[int]:
    """Iterations that have a published directory, ascending (temporary dirs excluded)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = (_ITER_RE.match(p.name) for p in root.iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


def tmp_dir_for(ckpt_dir: str | Path, name: str) -> Path:
    """The hidden staging directory a writer fills before renaming it to `name`."""
    return Path(ckpt_dir) / f"{TMP_PREFIX}{name}"


def clear_stale_tmp(ckpt_dir: str | Path) -> None:
    """Remove staging dirs left by a crashed save (only one trainer writes a root)."""
    for path in Path(ckpt_dir).glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable (a rename is only as safe as its directory entry)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write to a temporary sibling, fsync, then os.replace: readers see old or new, never half."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    with open(tmp, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_tracker(ckpt_dir: str | Path, iteration: int) -> None:
    atomic_write(get_checkpoint_tracker_filename(ckpt_dir), f"{iteration}\n")


def publish_dir(staging: Path, final: Path) -> None:
    """Rename a finished staging dir into place, replacing an older copy of the same iteration.

    A same-iteration re-save (e.g. a checkpoint right after a resume) swaps the
    directories with two renames; the old copy is deleted afterwards.
    """
    fsync_dir(staging)
    trash = final.with_name(f"{TMP_PREFIX}old_{final.name}")
    if final.exists():
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
    os.rename(staging, final)
    fsync_dir(final.parent)
    shutil.rmtree(trash, ignore_errors=True)


def prune(ckpt_dir: str | Path, keep_last: int | None, latest: int) -> list[int]:
    """Delete iteration dirs older than the `keep_last` newest at or below `latest`.

    Directories above `latest` (published by a save that crashed before the
    tracker was written) are left alone: the next save of that iteration
    replaces them. Returns the deleted iterations.
    """
    if keep_last is None:
        return []
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    candidates = [it for it in list_iterations(ckpt_dir) if it <= latest]
    doomed = candidates[:-keep_last]
    for it in doomed:
        shutil.rmtree(get_checkpoint_name(ckpt_dir, it))
    return doomed


def write_meta(iter_dir: Path, meta: dict[str, Any]) -> None:
    (iter_dir / META_FILENAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def read_meta(iter_dir: Path) -> dict[str, Any]:
    """The `relax_meta.json` of one iteration dir."""
    path = iter_dir / META_FILENAME
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"missing {path}: not a Relax checkpoint (or saved incompletely)") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"unreadable {path}: {err}") from err
    if meta.get("format_version") != FORMAT_VERSION:
        found = meta.get("format_version")
        raise CheckpointError(f"{path} has format_version {found!r}; this Relax reads {FORMAT_VERSION}")
    return meta
