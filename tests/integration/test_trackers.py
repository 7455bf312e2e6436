"""Experiment trackers as a user on a cluster without a network uses them (`logging.backends`).

A quick start with `logging.backends: [jsonl, wandb]` writes an offline W&B run
under RUN/wandb whose every step holds the metrics of metrics.jsonl, in the
project the recipe names, with the recipe as its config but no environment
variable's value, and no TensorBoard files (not listed); resumed, it
continues the same W&B run id. The run's records are read from the file wandb
wrote (tests/wandb_records.py), and no wandb process outlives the run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_local_run import QUICKSTART, relax  # noqa: E402
from wandb_records import history, run_info  # noqa: E402

WANDB = ["logging.backends=[jsonl,wandb]", "logging.wandb.project=relax-test", "rollout.prompts_per_step=4",
         "rollout.n_samples_per_prompt=4", "checkpoint.interval=2", "cluster.train.env={RELAX_TEST_TOKEN: hunter2}"]


def wandb_processes() -> set[int]:
    found = set()
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        if "wandb" in (proc.info["name"] or "") or any("wandb-core" in part for part in proc.info["cmdline"] or []):
            found.add(proc.info["pid"])
    return found


def test_an_offline_wandb_run_holds_every_step_and_a_resume_continues_it(tmp_path):
    before = wandb_processes()
    first = relax("submit", str(QUICKSTART), "train.steps=4", *WANDB, "--executor", "local", "--run-dir", "r",
                  cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run = tmp_path / "r"
    run_id = (run / "wandb_run_id").read_text().strip()
    assert not (run / "tensorboard").exists()  # not in logging.backends

    second = relax("submit", str(QUICKSTART), "train.steps=6", *WANDB, "--executor", "local", "--run-dir", "r",
                   cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "step 5/6" in second.stdout and "step 1/6" not in second.stdout

    files = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and [run_info(f) for f in files] == [(run_id, "relax-test")] * 2
    logged = [row for f in files for row in history(f)]
    jsonl = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [row["step"] for row in jsonl] == [1, 2, 3, 4, 5, 6]
    for mine, theirs in zip(jsonl, logged):
        assert theirs["reward_mean"] == pytest.approx(mine["reward_mean"])
        assert theirs["train_s"] == pytest.approx(mine["train_s"])
    # The recipe is the run's config, without the values of environment variables (tokens, often).
    assert all(b"RELAX_TEST_TOKEN" in f.read_bytes() and b"hunter2" not in f.read_bytes() for f in files)
    assert wandb_processes() <= before  # wandb's service ended with the run
