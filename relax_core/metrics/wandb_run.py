"""A run's Weights & Biases run (`logging.backends: [wandb]`), one across resumes and requeues.

- Offline by default: compute nodes of many clusters have no route out, so
  the W&B run is written under RUN/wandb/ (`offline-run-<time>-<id>/`) and
  uploaded later with `wandb sync`; `WANDB_MODE=online` in the driver's
  environment streams it instead (wandb's own variable).
- One id for the Relax run: it is drawn at the first start and kept in
  RUN/wandb_run_id, and every later attempt (a resume, a Slurm requeue)
  passes it to `wandb.init(id=..., resume="allow")`, so its steps land in the
  same W&B run instead of a new one per attempt (on Slurm, the usual pain).
- Steps are Relax's: every metric is plotted against the logged `step`
  metric (`define_metric`), not W&B's own counter, which only grows and
  would drop a resumed run's steps. Steps that an interrupted attempt logged
  after its checkpoint are in that attempt's files and appear twice once
  both are synced; metrics.jsonl and TensorBoard drop them.
- wandb is imported only here, at the first step, and its console capture
  is off (the driver's own log lines stay as they are).
- Nothing that may hold a token is recorded: the config is the recipe with
  the values of its environment variables removed (their names kept:
  `tracker.public_recipe`), and W&B's metadata record (the command line, with
  the overrides) is off.
"""

from __future__ import annotations

import math
import os
import secrets
import string
from pathlib import Path
from typing import Any

ID_FILE = "wandb_run_id"
ID_CHARS = string.ascii_lowercase + string.digits


class WandbRun:
    """Started at the first `log`; `close` finishes it."""

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]):
        self.run_dir, self.project, self.config = run_dir, project, config
        self._run = None

    def run_id(self) -> str:
        """The Relax run's W&B id: the one kept in the run directory, else a new one, kept there."""
        path = self.run_dir / ID_FILE
        if path.exists():
            return path.read_text().strip()
        run_id = "".join(secrets.choice(ID_CHARS) for _ in range(8))  # W&B's own ids look the same
        partial = path.with_name(f".{ID_FILE}.{os.getpid()}")
        partial.write_text(run_id + "\n")
        os.replace(partial, path)
        return run_id

    def _start(self):
        import wandb

        self._run = wandb.init(
            project=self.project, dir=str(self.run_dir), id=self.run_id(), resume="allow", config=self.config,
            mode=os.environ.get("WANDB_MODE", "offline"),
            # No metadata record: it holds the driver's command line (the overrides, values of environment
            # variables included), which an online run would upload. System metrics are still sampled.
            settings=wandb.Settings(console="off", silent=True, x_disable_meta=True),
        )
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        return self._run

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        run = self._run or self._start()
        values = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        run.log({**values, "step": step})

    def close(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.finish()
