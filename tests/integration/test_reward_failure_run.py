"""Whole local runs whose rewards fail: `relax submit` as a user runs it.

- A plug-in reward fails on a quarter of step 2's samples (below the recipe's
  threshold: the run goes on, and the progress line shows `rerr`), then on
  every sample from step 3 on: the run stops there with exit 1 and a message
  naming the reward and its first error, instead of training on zeros.
- A data set whose `data.reward_key` column names a reward that does not
  exist stops the start (exit 2, naming the value) before any engine starts.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import pytest
import yaml
from relax_runs import relax as relax_cli

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"

FLAKY = '''from relax_core.rewards.registry import reward

calls = 0


@reward("flaky_judge", in_process=True)
def flaky_judge(response, label, metadata):
    """Fails on every 4th call of step 2 (calls 129-256) and on every call after it."""
    global calls
    calls += 1
    if calls > 256 or (calls > 128 and calls % 4 == 0):
        raise ConnectionError(f"judge unreachable (call {calls})")
    return float(response == label)
'''


relax = partial(relax_cli, timeout=600)  # whole runs: longer than a command's 120 s


@pytest.mark.full(covered_by="tests/unit/test_reward_failures.py::"
                              "test_the_first_error_named_is_that_of_the_reward_that_failed_most")
def test_a_run_whose_reward_keeps_failing_stops_naming_the_reward_and_its_first_error(tmp_path: Path):
    (tmp_path / "judges").mkdir()
    (tmp_path / "judges" / "flaky.py").write_text(FLAKY)
    raw = yaml.safe_load(QUICKSTART.read_text())  # 16 prompts x 8 samples: 128 samples a step
    raw["reward"] = {"name": "flaky_judge", "plugin_dirs": ["judges"], "max_error_frac": 0.5, "error_window": 128}
    raw["train"]["steps"] = 6
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    proc = relax("submit", str(tmp_path / "recipe.yaml"), "--executor", "local", "--run-dir", "run", cwd=tmp_path)

    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    error = " ".join(proc.stderr.split())  # the console wraps long lines
    # The window is checked as each prompt group is scored, so the run stops inside step 3, once more than
    # half of the last 128 samples failed, without waiting for the rest of the step.
    failed = re.search(r"RewardFailureError: reward 'flaky_judge': (\d+) of the last 128 samples failed", error)
    assert failed and 64 < int(failed.group(1)) <= 128, error
    assert "first error: ConnectionError: judge unreachable (call 132) (at flaky.py:12 in flaky_judge)" in error
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward_errors"]) for r in rows] == [(1, 0), (2, 32)]  # 32 of 128: below, it went on
    assert "rerr 32" in next(line for line in proc.stdout.splitlines() if line.startswith("step 2/6"))
    assert "rerr" not in next(line for line in proc.stdout.splitlines() if line.startswith("step 1/6"))
    state = json.loads((tmp_path / "run" / "run.json").read_text())
    assert state["state"] == "failed" and "flaky_judge" in state["error"]


def test_a_reward_name_no_reward_has_in_the_routing_column_stops_the_start(tmp_path: Path):
    lines = [{"prompt": "ab", "label": "ab", "task": task} for task in ("copy", "cpoy", "copy", None)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["data"] = {"source": "file", "path": str(tmp_path / "data.jsonl"), "reward_key": "task"}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    proc = relax("submit", str(tmp_path / "recipe.yaml"), "--executor", "local", "--run-dir", "run", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "data.reward_key: column 'task' names rewards that do not exist: 'cpoy'" in " ".join(proc.stderr.split())
    assert not (tmp_path / "run").exists()  # refused before the run directory, Ray or any engine
