"""`rollout.agent` in a whole run: agent programs (written here, using the `openai` client) train through the
OpenAI-compatible endpoint Relax serves, in the rollout service of `mode=fully_async` (real Ray, TransferQueue,
engine, trainer); one program that hangs is killed at `rollout.agent.timeout_s` with its child, counted, and
the run goes on. The recording of calls as tokens and masks: test_multiturn.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_multiturn import AGENT, gone

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_agent_programs_train_two_steps_and_a_hung_one_is_killed_and_counted(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    recipe = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    recipe["name"] = "agents"
    recipe["data"]["apply_chat_template"] = True
    recipe["rollout"] |= {"prompts_per_step": 2, "n_samples_per_prompt": 2, "max_new_tokens": 40,
                          "agent": {"command": f"{sys.executable} agent.py", "timeout_s": 20}}
    recipe["train"] |= {"steps": 2, "micro_batch_size": 4}
    recipe["mode"] = "fully_async"
    recipe["checkpoint"] = {"interval": 2}
    (tmp_path / "agents.yaml").write_text(yaml.safe_dump(recipe))
    env = os.environ | {"COLUMNS": "200", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "relax_cli.main", "submit", "agents.yaml", "--executor", "local",
                           "--run-dir", "runs/agents"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs/agents/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert sum(r["agent/timeouts"] for r in rows) == 1.0  # the one hung program, of 8
    assert sum(r["agent/failures"] for r in rows) == 0.0
    assert all(r["agent/calls_mean"] >= 1.5 for r in rows)  # 2 calls each (none for the hung one)
    assert all(r["model_token_frac"] < 1.0 for r in rows)  # the second call's user message: mask 0
    assert [r["policy_version"] for r in rows] == [1, 2]
    for pid in map(int, (tmp_path / "hang.lock").read_text().split()):
        assert gone(pid), f"the hung program's process {pid} outlived its time limit"
