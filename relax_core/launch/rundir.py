"""The run directory: everything one run writes, in one place.

    runs/quickstart-20261129-101500/
        recipe.yaml          resolved recipe (written before anything starts)
        run.json             executor, state, pid / job id, times
        metrics.jsonl        one JSON object per step
        tensorboard/         TensorBoard event files
        logs/                driver.log, engine-*.log, ...
        checkpoints/         Megatron layout (iter_0000010/, latest_checkpointed_iteration.txt)
        secrets/             tokens (mode 0700 folder, 0600 files)

`relax status`, `relax logs` and a resumed run find everything from here.
Light imports only: the CLI uses this on the login node.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_core.errors import UserError

RUN_FILE = "run.json"
RECIPE_FILE = "recipe.yaml"
METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def recipe(self) -> Path:
        return self.path / RECIPE_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def secrets(self) -> Path:
        return self.path / "secrets"

    def create(self) -> "RunDir":
        for folder in (self.path, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        self.secrets.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.secrets, 0o700)
        return self

    def write_secret(self, name: str, value: str | None = None) -> Path:
        """Write a token readable by its owner only (mode 0600); returns its path."""
        path = self.secrets / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(value or secrets.token_urlsafe(32))
        os.chmod(path, 0o600)
        return path

    def secret(self, name: str) -> str:
        return (self.secrets / name).read_text().strip()

    def read_state(self) -> dict[str, Any]:
        try:
            return json.loads((self.path / RUN_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def update_state(self, **fields: Any) -> dict[str, Any]:
        """Merge `fields` into run.json: under a lock (the job's supervisor and driver both
        write it), through a temporary file of this process, renamed into place."""
        import fcntl

        with open(self.path / f".{RUN_FILE}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self.read_state() | fields
            tmp = self.path / f".{RUN_FILE}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(state, indent=2))
            os.replace(tmp, self.path / RUN_FILE)
        return state

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        rows = []
        for line in self.metrics.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line being written right now
                continue
        return rows


def new_run_dir(root: str | Path, name: str) -> RunDir:
    """A fresh, uniquely named run directory under `root` (not yet created)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(root).expanduser().resolve() / f"{name}-{stamp}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return RunDir(candidate)


def find_run(run: str | None, root: str | Path = "runs") -> RunDir:
    """The run a user means: a path, a run name under `root`, or the newest run."""
    if run:
        for candidate in (Path(run), Path(root) / run):
            if (candidate / RECIPE_FILE).exists():
                return RunDir(candidate.resolve())
        raise UserError(f"run '{run}': no run directory with a {RECIPE_FILE} there or under {root}/")
    runs = sorted(Path(root).glob(f"*/{RECIPE_FILE}"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise UserError(f"no runs under {Path(root).resolve()}; give the run directory as an argument")
    return RunDir(runs[-1].parent.resolve())
