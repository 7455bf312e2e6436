"""What `relax convert-ckpt` does: find the checkpoint, export it, optionally verify it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax_core.checkpoint.layout import TRACKER_FILENAME, CheckpointError


def checkpoint_root(path: str | Path) -> Path:
    """Accept the checkpoint folder itself or a run directory holding `checkpoints/`."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if not (path / TRACKER_FILENAME).exists() and (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path


def check_source(ckpt: str | Path, iteration: int | None) -> None:
    """Raise `CheckpointError` naming the file if the checkpoint to convert is missing or damaged."""
    from relax_core.checkpoint import dcp_io, layout

    _, iter_dir = layout.resolve_iteration(checkpoint_root(ckpt), iteration)
    layout.read_meta(iter_dir)
    dcp_io.read_metadata(iter_dir)


def convert(ckpt: str | Path, out_dir: str | Path, *, iteration: int | None = None, verify: bool = False,
            overwrite: bool = False, trust_remote_code: bool = False) -> dict[str, Any]:
    """`trust_remote_code`: verifying may run the code the model ships (its checkpoint's `hf_config/` copy)."""
    from relax_core.checkpoint.hf_export import export_hf

    root = checkpoint_root(ckpt)
    written = export_hf(root, Path(out_dir).expanduser(), iteration, overwrite=overwrite)
    report: dict[str, Any] = {"out_dir": str(written), "iteration": iteration}
    if verify:
        from relax_core.checkpoint.hf_verify import verify_export

        report |= verify_export(root, written, iteration, trust_remote_code=trust_remote_code)
    if report["iteration"] is None:
        from relax_core.checkpoint.layout import read_tracker

        report["iteration"] = read_tracker(root)
    return report
