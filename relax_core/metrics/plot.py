"""Training curves from a run's `metrics.jsonl`, drawn with matplotlib (`relax plot`).

For users on clusters where no TensorBoard server can be reached: one image
with a panel per quantity against the training step. Each panel shows the
logged values (thin) and, when there are enough steps, their moving average
(thick), whose window is a twentieth of the steps. A panel is left out when
the run logged none of its metrics (a run without a critic has no value loss).

matplotlib is imported only here, with its file-only backend (Agg): no
display is needed, and nothing else of Relax pays for the import.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from relax_core.errors import UserError

FORMATS = (".png", ".pdf", ".svg")  # what --out may end with (matplotlib picks the format by suffix)


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]  # metrics drawn in this panel, those the run logged
    ylabel: str = ""


PANELS = (
    Panel("reward", ("reward_mean",)),
    Panel("response length", ("response_len_mean",), "tokens"),
    Panel("throughput", ("tokens_per_s",), "tokens/s"),
    Panel("staleness", ("staleness_max",), "policy versions"),
    Panel("losses", ("loss", "pg_loss", "value_loss", "kl_loss")),
    Panel("step time", ("step_s", "rollout_s", "train_s"), "s"),
)


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl; UserError when there is none yet or a line is not JSON."""
    if not path.exists():
        raise UserError(f"{path}: no metrics yet (the run has not finished a step)")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{number}: not a JSON line ({exc.msg}); is it a metrics.jsonl?") from None
    if not rows:
        raise UserError(f"{path}: no metrics yet (the run has not finished a step)")
    return rows


def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of each value and the `window - 1` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def figure(rows: list[dict]):
    """A matplotlib Figure with one panel per quantity the rows hold."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    panels = [(p, [k for k in p.keys if any(isinstance(r.get(k), (int, float)) for r in rows)]) for p in PANELS]
    panels = [(p, keys) for p, keys in panels if keys]
    if not panels:
        raise UserError(f"none of {', '.join(k for p in PANELS for k in p.keys)} in the metrics: nothing to plot")
    columns = 2 if len(panels) > 1 else 1
    nrows = -(-len(panels) // columns)
    fig = Figure(figsize=(6 * columns, 3.2 * nrows), layout="constrained")
    window = max(1, len(rows) // 20)
    for index, (panel, keys) in enumerate(panels):
        axes = fig.add_subplot(nrows, columns, index + 1)
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            steps, values = [s for s, _ in points], [v for _, v in points]
            raw = axes.plot(steps, values, linewidth=0.8, alpha=0.45 if window > 1 else 1.0, label=key)[0]
            if window > 1:
                axes.plot(steps, moving_average(values, window), color=raw.get_color(), linewidth=2,
                          label=f"{key} (mean of {window})")
        axes.set_title(panel.title)
        axes.set_xlabel("step")
        if panel.ylabel:
            axes.set_ylabel(panel.ylabel)
        axes.grid(alpha=0.3)
        if len(keys) > 1 or window > 1:
            axes.legend(fontsize="small")
    return fig


def plot_run(metrics: Path, out: Path, title: str) -> Path:
    """Draw the curves of `metrics` into `out` (written whole or not at all); returns `out`."""
    if out.suffix.lower() not in FORMATS:
        raise UserError(f"--out {out}: give a file ending in {', '.join(FORMATS)}")
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give a file name such as {out / 'curves.png'}")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: no directory {out.parent}")
    fig = figure(read_metrics(metrics))
    fig.suptitle(title)
    fd, partial = tempfile.mkstemp(prefix=f".{out.name}.", suffix=out.suffix, dir=out.parent)
    os.close(fd)
    try:
        fig.savefig(partial, dpi=110)
        os.replace(partial, out)
    finally:
        Path(partial).unlink(missing_ok=True)
    return out
