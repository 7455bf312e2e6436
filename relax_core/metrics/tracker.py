"""Per-step metrics: `metrics.jsonl`, TensorBoard, W&B, ClearML, and the console progress line.

The controller calls `log(step, metrics)` once per training step. The JSONL
file is the source of truth (`relax status` and `relax plot` read it);
TensorBoard, W&B (`wandb_run.py`) and ClearML (`clearml_run.py`) get every
numeric value, the last two with the recipe as configuration (`public_recipe`); the driver
log gets one line per step, and so does the console, unless it is a terminal:
there one live line (rich) shows the step, a bar, the elapsed time, the ETA and
the latest figures, and what else the run prints appears above it.

A resumed run redoes the steps after its checkpoint, so `resume_from(K)` first
drops what the interrupted attempt logged past step K: metrics.jsonl is
rewritten atomically with the rows of steps <= K, and TensorBoard's writer
opens with `purge_step=K+1`, which hides the older events from that step on (`EventWriter`).
Each step is then in both exactly once.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
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


def public_recipe(recipe: dict[str, Any]) -> dict[str, Any]:
    """The recipe as a tracker's configuration, without the values of environment variables (`cluster.*.env`,
    `cluster.container.env`, their names kept): they may hold tokens, and an online tracker uploads it."""
    def scrub(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: sorted(v) if k == "env" and isinstance(v, dict) else scrub(v) for k, v in value.items()}
        return value

    return scrub(recipe)


class MetricsTracker:
    def __init__(self, metrics_file: Path, tensorboard_dir: Path | None, total_steps: int, console=None,
                 trackers: tuple = ()):
        """`trackers`: the remote trackers the recipe lists (`wandb_run.WandbRun`, `clearml_run.ClearMLRun`),
        each with `log(step, metrics)` and `close()`."""
        self.metrics_file = metrics_file
        self.trackers = tuple(trackers)
        self.tensorboard_dir = tensorboard_dir
        self.total_steps = total_steps
        self.console = console
        self._writer = None
        self._purge_step: int | None = None
        self._live: LiveLine | None = None

    def resume_from(self, step: int) -> None:
        """Forget what was logged after `step`: the run continues from there (see the module docstring)."""
        if self.metrics_file.exists():
            kept = [line for line in self.metrics_file.read_text().splitlines(keepends=True) if _step_of(line) <= step]
            tmp = self.metrics_file.with_name(f".{self.metrics_file.name}.{os.getpid()}.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.metrics_file)
        self._purge_step = step + 1

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **metrics}
        with self.metrics_file.open("a") as handle:  # when (epoch seconds): `relax status`'s rate and ETA
            handle.write(json.dumps(row | {"time": round(time.time(), 3)}) + "\n")
        writer = self._tensorboard()
        if writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    writer.add_scalar(key, value, step)
            writer.flush()
        for tracker in self.trackers:
            tracker.log(step, metrics)
        line = progress_line(row, self.total_steps)
        log.info(line)
        if self.console is None:
            return
        if self.console.is_terminal:
            self._live_line().show(step, line.partition(" | ")[2])
        else:
            self.console.print(line, highlight=False, markup=False)

    def _live_line(self) -> LiveLine:
        if self._live is None:
            self._live = LiveLine(self.console, self.total_steps)
        return self._live

    def _tensorboard(self):
        """The event writer, opened at the first step (after `resume_from`, which sets its purge step)."""
        if self._writer is None and self.tensorboard_dir is not None:
            self._writer = EventWriter(self.tensorboard_dir, purge_step=self._purge_step)
        return self._writer

    def close(self) -> None:
        if self._live is not None:
            self._live.close()
        if self._writer is not None:
            self._writer.close()
        for tracker in self.trackers:
            tracker.close()


class EventWriter:
    """Scalars into a TensorBoard event file, written by tensorboard's own event-file writer: torch's
    SummaryWriter does the same, and costs the driver an import of torch (2 to 4 s of CPU at start).

    `purge_step`: as torch's, a start marker at that step, from which TensorBoard drops what earlier files
    logged (a resumed run's redone steps appear once).
    """

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._file = EventFileWriter(str(log_dir))
        if purge_step is not None:
            self._file.add_event(Event(step=purge_step, file_version="brain.Event:2"))
            self._file.add_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
        self._file.add_event(Event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class LiveLine:
    """One progress line at the bottom of a terminal: step/total, a bar, elapsed, ETA, the latest figures."""

    def __init__(self, console, total_steps: int):
        from rich import progress as bar

        self._progress = bar.Progress(bar.TextColumn("step"), bar.MofNCompleteColumn(), bar.BarColumn(bar_width=24),
                                      bar.TimeElapsedColumn(), bar.TextColumn("eta"), bar.TimeRemainingColumn(),
                                      bar.TextColumn("{task.fields[figures]}", markup=False),
                                      console=console, transient=False)
        self._task = None
        self._total = total_steps

    def show(self, step: int, figures: str) -> None:
        if self._task is None:  # a resumed run starts its bar at the step it resumed from
            self._task = self._progress.add_task("train", total=self._total, completed=step - 1, figures="")
            self._progress.start()
        self._progress.update(self._task, completed=step, figures=figures)

    def close(self) -> None:
        self._progress.stop()


def _step_of(line: str) -> float:
    """A metrics row's step; a line cut short by a crash counts as past every step (it is dropped)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def progress_line(row: dict[str, Any], total_steps: int) -> str:
    parts = [f"step {row['step']}/{total_steps}"]
    parts += [fmt.format(row[key]) for key, fmt in PROGRESS_FIELDS if row.get(key) is not None]
    return " | ".join(parts + _reward_failures(row))


def _reward_failures(row: dict[str, Any]) -> list[str]:
    """`rerr N` (errors plus time-outs of the step's reward calls), only when some failed."""
    errors, timeouts = int(row.get("reward_errors") or 0), int(row.get("reward_timeouts") or 0)
    if not errors + timeouts:
        return []
    return [f"rerr {errors + timeouts}" + (f" ({timeouts} timed out)" if timeouts else "")]
