"""`python -m sglang.launch_server`, with its API key taken from the environment.

    RELAX_ENGINE_API_KEY=... python -m relax_core.rollout.sglang_launch --model-path DIR ...

SGLang reads its key only from `--api-key`, and a command line is visible to
every user of the node (/proc/*/cmdline). This module adds the flag to
`sys.argv` in-process and runs SGLang's launcher as `__main__`, so the key
never reaches a command line (SGLang's own workers are spawned by
`multiprocessing`, which sends them their arguments through a pipe).
"""

from __future__ import annotations

import os
import runpy
import sys

KEY_ENV = "RELAX_ENGINE_API_KEY"


def main() -> None:
    key = os.environ.pop(KEY_ENV, "")
    sys.argv = ["sglang.launch_server", *sys.argv[1:]] + (["--api-key", key] if key else [])
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
