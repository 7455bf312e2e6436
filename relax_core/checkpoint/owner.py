"""Which run a checkpoint directory belongs to: `CKPT/relax_run.json`.

    {"run_id": "...", "run_dir": "/abs/runs/quickstart-...", "fingerprint": "...", "created": "..."}

A run writes it when it first uses its checkpoint directory. A run only ever
resumes from a directory it owns, so a fresh run whose `checkpoint.dir` points
at a folder shared with another run is refused instead of silently continuing
that run (or overwriting its checkpoints). The run id lives in run.json and
survives moving the run directory. Stdlib only: `relax submit` checks this on
the login node.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from relax_core.checkpoint.layout import CheckpointError, atomic_write, find_latest, list_iterations

OWNER_FILENAME = "relax_run.json"


def read_owner(ckpt_dir: str | Path) -> dict[str, Any] | None:
    path = Path(ckpt_dir) / OWNER_FILENAME
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"unreadable {path}: {err}; it says which run owns {ckpt_dir}") from err


def holds_checkpoints(ckpt_dir: str | Path) -> bool:
    return find_latest(ckpt_dir) is not None or bool(list_iterations(ckpt_dir))


def check_owner(ckpt_dir: str | Path, run_id: str | None, run_dir: Path) -> None:
    """Refuse a checkpoint directory that holds another run's checkpoints.

    `run_id`: the run's id, None for a run that does not exist yet. A directory without an
    identity file is the run's own when it lies inside the run directory (runs made before
    identity files); elsewhere, checkpoints there belong to a run nobody can name.
    """
    owner = read_owner(ckpt_dir)
    if owner is not None and owner.get("run_id") == run_id:
        return
    if owner is not None and holds_checkpoints(ckpt_dir):
        raise CheckpointError(
            f"checkpoint.dir {ckpt_dir} holds the checkpoints of another run ({owner.get('run_dir')}); "
            f"resume that run with --run-dir {owner.get('run_dir')}, or give this one its own checkpoint.dir")
    inside = Path(ckpt_dir).resolve().is_relative_to(run_dir.resolve())
    if owner is None and not inside and holds_checkpoints(ckpt_dir):
        raise CheckpointError(
            f"checkpoint.dir {ckpt_dir} already holds checkpoints (iterations {list_iterations(ckpt_dir)}) "
            f"that no Relax run claims ({OWNER_FILENAME} is missing); give this run its own checkpoint.dir")


def claim(ckpt_dir: str | Path, run_id: str, run_dir: Path, fingerprint: str) -> None:
    """Check the directory (as `check_owner`) and record this run as its owner, once."""
    check_owner(ckpt_dir, run_id, run_dir)
    root = Path(ckpt_dir)
    owner = read_owner(root)
    if owner is not None and owner.get("run_id") == run_id:
        return
    root.mkdir(parents=True, exist_ok=True)
    atomic_write(root / OWNER_FILENAME, json.dumps({
        "run_id": run_id, "run_dir": str(run_dir.resolve()), "fingerprint": fingerprint,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2) + "\n")
