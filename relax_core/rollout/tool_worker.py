"""Entry point of one tool worker process (started by tools.py through cluster/worker_pool.py's `WorkerPool`):
`python -m relax_core.rollout.tool_worker TOOLS_FILE`.

Imports the tools file, replies ("ready", None), then answers pickled `(tool name, "", (arguments,))`
requests with ("ok", the result as text) or ("error", what went wrong) until stdin closes. Anything a tool
prints goes to stderr. A tool that hangs is the parent's to kill (the pool's time limit).
"""

from __future__ import annotations

import json
import os
import pickle
import sys


def main(tools_file: str) -> None:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    from relax_core.cluster.worker_pool import send
    from relax_core.rollout.tools import load_tools

    try:
        tools = load_tools(tools_file)
    except Exception as exc:
        send(replies, ("broken", f"{type(exc).__name__}: {exc}"))
        return
    send(replies, ("ready", None))
    while True:
        try:
            name, _, (arguments,) = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        try:
            result = tools[name](**arguments)
            reply = ("ok", result if isinstance(result, str) else json.dumps(result, default=str))
        except Exception as exc:
            reply = ("error", f"{type(exc).__name__}: {exc}")
        send(replies, reply)


if __name__ == "__main__":
    main(sys.argv[1])
