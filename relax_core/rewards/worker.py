"""Entry point of one reward worker process (started by pool.py): `python -m relax_core.rewards.worker [PLUGIN_DIR...]`.

Loads the built-in rewards, math-verify and the plugin folders, replies
("ready", None), then answers pickled `(name, module, args)` requests on
stdin with pickled ("ok", value) / ("error", message) on stdout until stdin
closes. Anything a reward prints goes to stderr, so it cannot corrupt replies.
"""

from __future__ import annotations

import os
import pickle
import sys


def main(plugin_dirs: list[str]) -> None:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints from rewards land on stderr
    requests = sys.stdin.buffer
    from relax_core.rewards import registry
    from relax_core.rewards.pool import _call

    try:
        registry.load_all(plugin_dirs)
        _warm()
    except Exception as exc:  # reported by the parent on every call
        _send(replies, ("broken", f"{type(exc).__name__}: {exc}"))
        return
    _send(replies, ("ready", None))
    while True:
        try:
            name, module, args = pickle.load(requests)
        except EOFError:
            return
        _send(replies, _call(registry, name, module, args))


def _warm() -> None:
    """Import math-verify now, so the first math call's time limit does not pay for it."""
    try:
        import math_verify  # noqa: F401
    except ImportError:  # only the math rewards need it; they say so when called
        pass


def _send(stream, message) -> None:
    try:
        data = pickle.dumps(message)  # whole, so a failure cannot leave half a reply in the pipe
    except Exception as exc:  # an unpicklable return value
        data = pickle.dumps(("error", f"reward returned an unpicklable value: {exc}"))
    stream.write(data)
    stream.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
