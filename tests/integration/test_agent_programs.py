"""`rollout.agent` in a whole run: agent programs (written here, using the `openai` client) train through the
OpenAI-compatible endpoint Relax serves, in the rollout service of `mode=fully_async` (real Ray, TransferQueue,
engine, trainer); one program that hangs is killed at `rollout.agent.timeout_s` with its child, counted, and
the run goes on. The recording of calls as tokens and masks: test_multiturn.py."""

from __future__ import annotations

import sys

import pytest
from agentic_runs import two_step_run
from test_multiturn import AGENT, gone


@pytest.mark.full(covered_by="tests/integration/test_multiturn.py::test_agent_programs_calls_are_recorded_with_masks_and_a_hung_one_is_killed")
def test_agent_programs_train_two_steps_and_a_hung_one_is_killed_and_counted(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    agent = {"command": f"{sys.executable} agent.py", "timeout_s": 20}
    rows = two_step_run(tmp_path, "agents", {"max_new_tokens": 40, "agent": agent}, mode="fully_async")
    assert sum(r["agent/timeouts"] for r in rows) == 1.0  # the one hung program, of 8
    assert sum(r["agent/failures"] for r in rows) == 0.0
    assert all(r["agent/calls_mean"] >= 1.5 for r in rows)  # 2 calls each (none for the hung one)
    assert all(r["model_token_frac"] < 1.0 for r in rows)  # the second call's user message: mask 0
    assert [r["policy_version"] for r in rows] == [1, 2]
    for pid in map(int, (tmp_path / "hang.lock").read_text().split()):
        assert gone(pid), f"the hung program's process {pid} outlived its time limit"
