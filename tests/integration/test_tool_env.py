"""The built-in tool environment: calls run in worker processes with a time limit; every way a call can go
wrong becomes the call's answer, and the trajectory goes on.

- `ToolEnv.step` on the four faults (malformed call, unknown tool, a tool that raises, one that hangs): each
  gets an `error: ...` observation as a `tool` message, the trajectory is not done, and the counts are in `info`;
  the hung call's worker process is killed at the time limit and a fresh one serves the next call;
- a whole run (`relax submit`, real Ray, engine, trainer) whose model's turns are such calls completes every
  step, with the faults counted in its metrics.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pytest
import yaml
from agentic_runs import REPO, two_step_run

from relax_core.rollout.tools import ToolEnv, close_pools, parse_calls, tool_schema

TOOLS = '''
import time

def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

def boom(x: int) -> int:
    """Always fails."""
    raise ValueError(f"no good: {x}")

def hang(seconds: float = 3600) -> str:
    """Never answers in time."""
    time.sleep(seconds)
    return "late"
'''


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_parse_calls_reads_qwens_form_and_names_what_is_malformed():
    assert parse_calls("thinking " + call("add", a=1, b=2)) == [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert parse_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>') == [
        {"name": "add", "arguments": {"a": 1}}]  # arguments as a JSON string
    bad = parse_calls("<tool_call>{not json}</tool_call><tool_call>{\"arguments\": {}}</tool_call><tool_call>{")
    assert [type(c) for c in bad] == [str, str, str]
    assert "not JSON" in bad[0] and '"name"' in bad[1] and "no closing" in bad[2]
    assert parse_calls("the answer is 3") == []


def test_every_faulty_call_is_answered_with_an_error_and_the_trajectory_goes_on(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS)
    env = ToolEnv(tools=str(tmp_path / "tools.py"), timeout_s=2.0, workers=1)
    assert sorted(t["function"]["name"] for t in env.tools) == ["add", "boom", "hang"]
    assert env.tools[0]["function"]["parameters"]["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}
    assert tool_schema("hang", lambda seconds=1.0: "")["function"]["parameters"]["required"] == []
    loop = asyncio.new_event_loop()
    try:
        from relax_core.rollout.tools import _pool

        def step(text: str):
            return loop.run_until_complete(env.step(text))

        obs, reward, done, info = step(call("add", a=12, b=7))
        assert obs == [{"role": "tool", "content": "19"}] and reward == 0.0 and not done
        cases = {
            "malformed": ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "tool_malformed",
                          "error: malformed tool call: the call is not JSON"),
            "unknown": (call("multiply", a=2, b=3), "tool_unknown", "error: unknown tool 'multiply'; the tools are: "
                                                                    "add, boom, hang"),
            "raises": (call("boom", x=4), "tool_errors", "error: boom failed: ValueError: no good: 4"),
        }
        for text, counter, message in cases.values():
            obs, reward, done, info = step(text)
            assert not done and reward == 0.0 and info[counter] == 1 and info["tool_calls"] == 1
            assert obs[0]["role"] == "tool" and obs[0]["content"].startswith(message), obs
        pool = _pool(env.path, env.workers)
        hung_worker = next(iter(pool._workers - {pool._spare}))
        start = time.monotonic()
        obs, reward, done, info = step(call("hang"))
        waited = time.monotonic() - start
        assert not done and info["tool_timeouts"] == 1
        assert obs[0]["content"] == "error: hang did not finish within 2 s and was stopped"
        assert 2.0 <= waited < 10.0
        assert hung_worker.process.poll() is not None  # the worker that ran it is gone (killed)
        assert step(call("add", a=1, b=1))[0] == [{"role": "tool", "content": "2"}]  # a fresh worker serves
        obs, reward, done, info = step("The answer is 19.")
        assert obs is None and reward is None and done  # the final answer: the reward hub scores it
    finally:
        close_pools()
        loop.close()


SCRIPTED = '''
from relax_core.rollout.tools import ToolEnv

CALLS = [
    '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',
    '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>',
    '<tool_call>{"name": "boom", "arguments": {"x": 4}}</tool_call>',
    '<tool_call>{"name": "hang", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 7}}</tool_call>',
]

class Scripted(ToolEnv):
    """The built-in tool environment, handed one faulty call per turn whatever the tiny model wrote."""
    def reset(self, sample):
        self.turn = 0
        return super().reset(sample)

    async def step(self, response):
        text = CALLS[self.turn] if self.turn < len(CALLS) else "done"
        self.turn += 1
        return await super().step(text)
'''


@pytest.mark.full(covered_by="tests/integration/test_agent_quickstart.py::test_the_agentic_quickstart_doubles_its_reward")
def test_a_run_whose_tool_calls_fail_every_way_completes_every_step(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS)
    (tmp_path / "scripted.py").write_text(SCRIPTED)
    env = {"path": "scripted.py", "name": "Scripted", "max_turns": 6, "max_tokens_per_turn": 2,
           "args": {"tools": str(tmp_path / "tools.py"), "timeout_s": 2.0, "workers": 1}}
    rows = two_step_run(tmp_path, "tools", {"max_new_tokens": 400, "env": env},
                        model=dict(yaml.safe_load((REPO / "recipes/quickstart.yaml").read_text())["model"],
                                   alphabet="abcd0123456789"))
    for r in rows:  # each of the 4 trajectories a step met every fault, then a working call and its answer
        assert r["env/tool_malformed"] == r["env/tool_unknown"] == r["env/tool_errors"] == 1.0
        assert r["env/tool_timeouts"] == 1.0 and r["env/tool_calls"] == 5.0
        assert r["turns_mean"] == 6.0
    leftover = subprocess.run(["pgrep", "-f", "relax_core.rollout.tool_worker"], capture_output=True, text=True)
    assert leftover.stdout == "", "tool workers outlived the run"
