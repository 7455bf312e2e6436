"""Entry point of one reward worker process (started by the hub through cluster/worker_pool.py):
`python -m relax_core.rewards.worker [PLUGIN_DIR...]`.

Loads the built-in rewards, math-verify and the plugin folders, replies
("ready", None), then answers pickled `(name, module, args)` requests on
stdin with pickled ("ok", value) / ("error", message) on stdout until stdin
closes. Anything a reward prints goes to stderr, so it cannot corrupt replies.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
from typing import Any

from relax_core.cluster.worker_pool import send
from relax_core.rewards.failures import describe_error


def main(plugin_dirs: list[str]) -> None:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints from rewards land on stderr
    requests = sys.stdin.buffer
    from relax_core.rewards import registry

    try:
        registry.load_all(plugin_dirs)
        _warm()
    except Exception as exc:  # reported by the parent on every call
        send(replies, ("broken", f"{type(exc).__name__}: {exc}"))
        return
    send(replies, ("ready", None))
    while True:
        try:
            name, module, args = pickle.load(requests)
        except EOFError:
            return
        send(replies, _call(registry, name, module, args))


def _call(registry, name: str, module: str, args: tuple) -> tuple[str, Any]:
    try:
        if name not in registry._REWARDS and module:
            importlib.import_module(module)  # a reward registered in an ordinary importable module
        return "ok", registry.get_reward(name)(*args)
    except Exception as exc:
        return "error", describe_error(exc)


def _warm() -> None:
    """Import math-verify now, so the first math call's time limit does not pay for it."""
    try:
        import math_verify  # noqa: F401
    except ImportError:  # only the math rewards need it; they say so when called
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
