"""The built-in tool-use environment: the model calls Python functions in Qwen's `<tool_call>` form.

    rollout:
      env: {name: tools, max_turns: 4, args: {tools: tools.py, timeout_s: 5}}

Every public function of the `tools` file (relative to the recipe) is a tool;
its signature and docstring become the JSON schema the chat template shows
the model (`tools=`). A model turn holding one or more calls

    <tool_call>
    {"name": "add", "arguments": {"a": 12, "b": 7}}
    </tool_call>

gets one `tool` message per call with the function's result (text, or JSON
for other values), and the model takes another turn. The functions run in
worker processes (`workers` of them, shared by the process's trajectories),
each call with the time limit `timeout_s`: a call past it is killed with its
worker. Whatever goes wrong becomes the call's answer, never an error of the
run, and is counted in `info` (logged as `env/...`):

    malformed call (no closing tag, not JSON, no name)  -> "error: ..."   tool_malformed
    a name that is no tool                               -> "error: ..."   tool_unknown
    the function raised                                  -> "error: ..."   tool_errors
    past timeout_s                                       -> "error: ..."   tool_timeouts

A turn with no `<tool_call>` is the final answer: the trajectory ends and the
reward hub scores that answer against the row's label (`reward.name`).
"""

from __future__ import annotations

import inspect
import json
import re
import threading
from pathlib import Path
from typing import Any

from relax_core.rollout.envs import EnvError, Environment

CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
_POOLS: dict[tuple[str, int], Any] = {}
_LOCK = threading.Lock()


def load_tools(path: str | Path) -> dict[str, Any]:
    """The public functions of a tools file, by name."""
    from relax_core.plugin_files import import_file

    module = import_file(path, "relax_tools", EnvError, "rollout.env.args.tools: tools file")
    names = getattr(module, "__all__", None)
    found = {name: fn for name, fn in vars(module).items()
             if inspect.isfunction(fn) and fn.__module__ == module.__name__ and not name.startswith("_")}
    return {name: found[name] for name in names} if names is not None else found


def tool_schema(name: str, fn) -> dict[str, Any]:
    """The OpenAI-style function schema chat templates render (`{"type": "function", "function": ...}`)."""
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        kind = _TYPES.get(param.annotation if not isinstance(param.annotation, str) else
                          {t.__name__: t for t in _TYPES}.get(param.annotation), "string")
        properties[param.name] = {"type": kind}
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    doc = inspect.getdoc(fn) or ""
    return {"type": "function", "function": {"name": name, "description": doc.split("\n\n")[0],
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


def parse_calls(text: str) -> list[dict[str, Any] | str]:
    """Each `<tool_call>` of a turn: `{"name", "arguments"}`, or why it is malformed (a string)."""
    calls: list[dict[str, Any] | str] = []
    for body, closing in CALL.findall(text):
        if not closing:
            calls.append("the call has no closing </tool_call>")
            continue
        try:
            call = json.loads(body.strip())
        except ValueError as exc:
            calls.append(f"the call is not JSON ({exc})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append('the call needs a "name" (a string) and "arguments" (an object)')
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        if not isinstance(arguments, dict):
            calls.append('"arguments" must be an object')
            continue
        calls.append({"name": call["name"], "arguments": arguments})
    return calls


def _pool(path: str, workers: int):
    from relax_core.cluster.worker_pool import WorkerPool

    with _LOCK:
        key = (path, workers)
        if key not in _POOLS:
            _POOLS[key] = WorkerPool(workers, [path], module="relax_core.rollout.tool_worker")
        return _POOLS[key]


def close_pools() -> None:
    """Stop every tool worker this process started."""
    with _LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


class ToolEnv(Environment):
    """Tool use (see the module docstring).

    Args:
        tools: the Python file whose public functions are the tools.
        timeout_s: time limit of one call.
        workers: processes that run the calls (shared by all trajectories of this process).
        max_calls_per_turn: calls past this many in one turn are answered with an error, not run.
    """

    role = "tool"

    def __init__(self, tools: str, timeout_s: float = 5.0, workers: int = 2, max_calls_per_turn: int = 4):
        self.path = str(Path(tools).expanduser().resolve())
        functions = load_tools(self.path)
        self.names = sorted(functions)
        self.tools = [tool_schema(name, fn) for name, fn in functions.items()]
        self.timeout_s, self.workers, self.max_calls = timeout_s, workers, max_calls_per_turn

    def reset(self, sample: dict[str, Any]) -> None:
        return None  # the row's prompt; the tools reach the template through self.tools

    async def step(self, response: str) -> tuple[list[dict] | None, float | None, bool, dict[str, float]]:
        calls = parse_calls(response)
        if not calls:
            return None, None, True, {}
        info = dict.fromkeys(("tool_calls", "tool_malformed", "tool_unknown", "tool_errors", "tool_timeouts"), 0.0)
        answers = []
        for index, call in enumerate(calls):
            info["tool_calls"] += 1
            answers.append({"role": "tool", "content": await self._answer(index, call, info)})
        return answers, 0.0, False, info

    async def _answer(self, index: int, call: dict[str, Any] | str, info: dict[str, float]) -> str:
        if isinstance(call, str):
            info["tool_malformed"] += 1
            return f"error: malformed tool call: {call}"
        if call["name"] not in self.names:
            info["tool_unknown"] += 1
            return f"error: unknown tool '{call['name']}'; the tools are: {', '.join(self.names)}"
        if index >= self.max_calls:
            info["tool_errors"] += 1
            return f"error: at most {self.max_calls} tool calls per turn"
        outcome = await _pool(self.path, self.workers).call(call["name"], "", (call["arguments"],), self.timeout_s)
        if outcome.status == "ok":
            return str(outcome.value)
        if outcome.status == "timeout":
            info["tool_timeouts"] += 1
            return f"error: {call['name']} did not finish within {self.timeout_s:g} s and was stopped"
        info["tool_errors"] += 1
        return f"error: {call['name']} failed: {outcome.error}"
