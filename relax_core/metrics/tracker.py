"""Per-step metrics: `metrics.jsonl`, TensorBoard, and the console progress line.

The controller calls `log(step, metrics)` once per training step. The JSONL
file is the source of truth (`relax status` reads it); TensorBoard gets every
numeric value; the console gets one line per step.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROGRESS_FIELDS = (
    ("reward_mean", "reward {:.3f}"),
    ("response_len_mean", "len {:.1f}"),
    ("tokens_per_s", "{:,.0f} tok/s"),
    ("rollout_s", "rollout {:.2f}s"),
    ("train_s", "train {:.2f}s"),
    ("sync_s", "sync {:.2f}s"),
    ("policy_version", "v{}"),
    ("staleness_mean", "staleness {:.2f}"),  # the asynchronous modes only
    ("queue_depth", "queue {:.0f}"),
)


class MetricsTracker:
    def __init__(self, metrics_file: Path, tensorboard_dir: Path | None, total_steps: int, console=None):
        self.metrics_file = metrics_file
        self.total_steps = total_steps
        self.console = console
        self._writer = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(tensorboard_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **metrics}
        with self.metrics_file.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()
        line = progress_line(row, self.total_steps)
        log.info(line)
        if self.console is not None:
            self.console.print(line, highlight=False, markup=False)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def progress_line(row: dict[str, Any], total_steps: int) -> str:
    parts = [f"step {row['step']}/{total_steps}"]
    parts += [fmt.format(row[key]) for key, fmt in PROGRESS_FIELDS if row.get(key) is not None]
    return " | ".join(parts)
