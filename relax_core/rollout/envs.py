"""Environments of multi-turn rollouts: the interface a user implements, and how a recipe finds one.

    rollout:
      env: {path: envs/guess.py, name: GuessEnv, max_turns: 2, args: {length: 2}}

`path` is a Python file next to the recipe (like reward plug-ins, it is
imported by Relax, and an error in it stops the run before anything starts,
naming the file and line); `name` is the class in it. Without `path`, `name`
is a built-in environment (`tools`, rollout/tools.py). One instance is made
per trajectory, `cls(**args)`, so an environment keeps its state in `self`.

    class MyEnv(Environment):
        def reset(self, sample):          # the data row: {"prompt", "label", "metadata", ...}
            return "first user message"   # or a list of chat messages; None: the row's prompt
        def step(self, response):         # the model's turn, as text
            return observation, reward, done, info
        def close(self): ...

`reset`, `step` and `close` may be `async def`; a plain `step` runs in a
thread, so a slow one does not hold the other trajectories. An observation is
a string (a message of role `self.role`, "user" unless set to "tool"), a chat
message dict, a list of them, or None (no message, the model goes on). A
trajectory's reward is the sum of the rewards `step` returned; when the step
that ends it returns `None` as its reward, the reward hub scores the model's
last turn against the row's label instead (`reward.name`). `tools`, set on
the instance by `reset`, is passed to the chat template (JSON schemas of the
functions the model may call). `info` may hold numbers; each key's mean
over a step's trajectories is logged as `env/<key>`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from relax_core.errors import UserError
from relax_core.plugin_files import import_file


class EnvError(UserError):
    """An environment file or class a recipe names cannot be used."""


class Environment:
    """Base class of environments (optional: any class with `reset` and `step` works)."""

    role: str = "user"
    tools: list[dict[str, Any]] | None = None

    def reset(self, sample: dict[str, Any]) -> str | dict | list[dict] | None:
        return None

    def step(self, response: str) -> tuple[Any, float | None, bool, dict[str, Any]]:
        raise NotImplementedError

    def close(self) -> None:
        pass


BUILTIN = {"tools": "relax_core.rollout.tools:ToolEnv"}


def environment_class(path: str | None, name: str) -> type:
    """The class a recipe's `rollout.env` names (its file imported now)."""
    if path is None:
        if name not in BUILTIN:
            raise EnvError(f"rollout.env.name: no built-in environment '{name}' (built-in: "
                                    f"{', '.join(sorted(BUILTIN))}); set rollout.env.path to the file that "
                                    f"defines it")
        import importlib

        module, attr = BUILTIN[name].split(":")
        return getattr(importlib.import_module(module), attr)
    module = import_file(path, "relax_environments", EnvError, "rollout.env.path: environment file")
    cls = getattr(module, name, None)
    if cls is None:
        found = sorted(n for n, v in vars(module).items() if inspect.isclass(v) and hasattr(v, "step")
                       and getattr(v, "__module__", "") == module.__name__)
        raise EnvError(f"rollout.env.name: {path} defines no '{name}'"
                                + (f" (its environments: {', '.join(found)})" if found else ""))
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not inspect.isclass(cls) or missing:
        raise EnvError(f"rollout.env.name: {name} in {path} is not an environment class (it needs "
                                f"reset(sample) and step(response) methods; missing: {', '.join(missing) or '-'})")
    return cls


def environment_factory(config) -> Callable[[], Any]:
    """A function making one environment per trajectory from a recipe's `rollout.env` (`EnvConfig`)."""
    cls = environment_class(config.path, config.name)
    args = dict(config.args)
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as exc:
        raise EnvError(f"rollout.env.args: {config.name}({', '.join(args)}) does not match its "
                                f"constructor: {exc}") from None
    return lambda: cls(**args)


def env_problems(config) -> list[str]:
    """`relax validate`/`submit`: the environment loads and takes its arguments."""
    try:
        environment_factory(config)
    except UserError as exc:
        return [str(exc)]
    return []


async def call(fn, *args):
    """`fn(*args)`, awaited if it is a coroutine function, else in a thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    import asyncio

    result = await asyncio.to_thread(fn, *args)
    return await result if inspect.isawaitable(result) else result


def as_messages(observation: Any, role: str) -> list[dict[str, Any]]:
    """An observation as chat messages (see the module docstring)."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    if isinstance(observation, dict):
        return [observation]
    if isinstance(observation, list) and all(isinstance(m, dict) for m in observation):
        return list(observation)
    raise TypeError(f"an observation must be a string, a chat message dict or a list of them, not "
                    f"{type(observation).__name__}")
