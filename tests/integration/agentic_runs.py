"""A short multi-turn run through `relax submit`, as a user starts one, for the agentic tests.

`two_step_run(folder, name, rollout)` writes the quick start's recipe with the chat template on, 2 prompts x 2
samples, 2 steps and `rollout` merged into its rollout section, runs it on the local executor in `folder`, and
returns its metrics.jsonl rows (the run must succeed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def two_step_run(folder: Path, name: str, rollout: dict, **top) -> list[dict]:
    recipe = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    recipe["name"] = name
    recipe["data"]["apply_chat_template"] = True
    recipe["rollout"] |= {"prompts_per_step": 2, "n_samples_per_prompt": 2} | rollout
    recipe["train"] |= {"steps": 2, "micro_batch_size": 4}
    recipe["checkpoint"] = {"interval": 2}
    recipe |= top
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    env = os.environ | {"COLUMNS": "200", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "relax_cli.main", "submit", f"{name}.yaml", "--executor", "local",
                           "--run-dir", f"runs/{name}"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (folder / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    return rows
