"""`relax plot`: a run's curves as an image, for clusters where no TensorBoard server can be reached.

The metrics are written in the schema the driver logs (the keys of a quick-start
step); the curves drawn must be those numbers, and a mistake (a file name
matplotlib cannot write, no metrics yet, a damaged metrics file) exits 2 and
leaves the user's files as they were.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image
from relax_runs import relax

from relax_core.metrics.plot import figure


def quickstart_rows(steps: int) -> list[dict]:
    """Steps as the driver logs them: reward rising, response length 2, no critic (no value loss)."""
    return [{"step": s, "reward_mean": min(1.0, 0.05 + s / 100), "response_len_mean": 2.0,
             "tokens_per_s": 4000.0 + 10 * (s % 7), "staleness_max": s % 2, "loss": -0.01 * s,
             "pg_loss": -0.02 * s, "step_s": 0.1, "rollout_s": 0.03, "train_s": 0.06, "entropy": 2.9}
            for s in range(1, steps + 1)]


def lines_of(fig) -> dict[str, dict[str, list]]:
    return {ax.get_title(): {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
            for ax in fig.axes}


def test_the_panels_hold_the_logged_values_and_their_moving_average():
    rows = quickstart_rows(40)
    panels = lines_of(figure(rows))
    assert list(panels) == ["reward", "response length", "throughput", "staleness", "losses", "step time"]
    assert panels["reward"]["reward_mean"] == [r["reward_mean"] for r in rows]
    # 40 steps: a window of 2 steps; the first point is its own mean.
    smooth = panels["reward"]["reward_mean (mean of 2)"]
    assert smooth[0] == rows[0]["reward_mean"]
    assert smooth[10] == pytest.approx((rows[9]["reward_mean"] + rows[10]["reward_mean"]) / 2)
    assert set(panels["losses"]) == {"loss", "pg_loss", "loss (mean of 2)", "pg_loss (mean of 2)"}  # no critic


def test_a_short_run_is_drawn_without_smoothing_and_unknown_metrics_are_not_panels():
    rows = [{"step": 1, "reward_mean": 0.1, "grad_norm": 3.0}, {"step": 2, "reward_mean": 0.4, "grad_norm": 2.0}]
    assert lines_of(figure(rows)) == {"reward": {"reward_mean": [0.1, 0.4]}}


def make_run(root: Path, rows: list[dict] | None) -> Path:
    run = root / "runs" / "qs"
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text("name: qs\n")
    if rows is not None:
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_relax_plot_writes_the_image_and_refuses_mistakes_touching_nothing(tmp_path):
    run = make_run(tmp_path, quickstart_rows(150))
    done = relax("plot", "qs", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    with Image.open(run / "curves.png") as image:  # 2 columns x 3 rows of panels at 110 dpi
        assert image.format == "PNG" and image.size == (1320, 1056)
    made = (run / "curves.png").read_bytes()

    other = relax("plot", str(run), "--out", str(tmp_path / "curves.svg"), cwd=tmp_path)
    assert other.returncode == 0 and (tmp_path / "curves.svg").read_text().lstrip().startswith("<?xml")

    wrong_suffix = relax("plot", "qs", "--out", str(tmp_path / "curves.txt"), cwd=tmp_path)
    assert wrong_suffix.returncode == 2 and ".png" in wrong_suffix.stderr
    assert not (tmp_path / "curves.txt").exists()

    (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() + "{not json\n")
    damaged = relax("plot", "qs", cwd=tmp_path)
    assert damaged.returncode == 2 and "metrics.jsonl:151" in damaged.stderr
    assert (run / "curves.png").read_bytes() == made  # the earlier image is kept
    assert sorted(p.name for p in run.iterdir()) == ["curves.png", "metrics.jsonl", "recipe.yaml"]


def test_a_run_without_steps_yet_is_refused_naming_it(tmp_path):
    make_run(tmp_path, None)
    refused = relax("plot", "qs", cwd=tmp_path)
    assert refused.returncode == 2 and "no metrics yet" in refused.stderr
