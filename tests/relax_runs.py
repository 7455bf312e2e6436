"""Relax as the tests run it: the `relax` command in a subprocess, the way a user types it.

One home for what every test file used to write for itself: the command line, its environment
(wide, uncoloured output; HF_HUB_OFFLINE comes from tests/conftest.py), a background run whose
output goes to a file, and waiting for something a run does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

RELAX = [sys.executable, "-m", "relax_cli.main"]
CLI_ENV = {"COLUMNS": "200", "NO_COLOR": "1"}

T = TypeVar("T")


def cli_env(extra: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment for a `relax` command: wide, uncoloured output, `extra` on top,
    without the variables named in `drop`."""
    env = os.environ | CLI_ENV | (extra or {})
    for name in drop:
        env.pop(name, None)
    return env


def relax(*args: str, cwd: Path | None = None, timeout: float = 120, env: dict[str, str] | None = None,
          drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run `relax ARGS` to its end (killed after `timeout` s); its output captured as text."""
    return subprocess.run([*RELAX, *args], cwd=cwd, env=cli_env(env, drop), capture_output=True, text=True,
                          timeout=timeout)


def start_relax(*args: str, cwd: Path, out: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `relax ARGS` in the background, its stdout and stderr into the file `out`."""
    with out.open("w") as handle:
        return subprocess.Popen([*RELAX, *args], cwd=cwd, env=cli_env(env), stdout=handle,
                                stderr=subprocess.STDOUT)


def wait_for(predicate: Callable[[], T], timeout: float, what: str, poll: float = 0.5,
             alive: subprocess.Popen | None = None) -> T:
    """Poll `predicate` until it returns something true, and return that; fail naming `what` after
    `timeout` s, or at once when the process `alive` has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if alive is not None and alive.poll() is not None:
            said = [part for part in alive.communicate() if part]
            raise AssertionError(f"the run ended (exit {alive.returncode}) while waiting for {what}: {said}")
        time.sleep(poll)
    raise AssertionError(f"{what}: not within {timeout} s")
