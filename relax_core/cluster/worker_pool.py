"""Worker processes that run calls with a per-call time limit: the reward hub's sync rewards
(rewards/worker.py) and the agentic tools (rollout/tool_worker.py).

A `concurrent.futures.ProcessPoolExecutor` cannot stop a call that hangs
(sympy on an adversarial expression can run for hours), so each worker here
is one process behind a pipe: the parent sends `(name, module, args)`, waits
at most the time limit, and on a timeout kills that worker and starts a fresh
one; the other workers carry on. The parent side is blocking and runs on a
thread per worker, so the asyncio caller awaits `WorkerPool.call` without
blocking its event loop. A worker answers with `send` (its side of the pipe).

Workers are fresh interpreters (`python -m MODULE ARGS...`), not forks: the
controller holds Ray and torch threads whose locks a forked child could
inherit held, and `spawn`/`forkserver` would re-import the caller's main
script. They look what they call up by name (rewards with the same plugin
folders as the parent, tools in the tools file), so functions never need to
be pickled.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import queue
import select
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_core.cluster.lifetime import Child

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0  # importing sympy and the plugins in a new worker on a busy node


@dataclass
class Outcome:
    """What one call came back with: `status` is "ok", "error" or "timeout"."""

    status: str
    value: Any = None
    error: str | None = None


class _Worker:
    """One `python -m MODULE ARGS...` process (`relax_core.rewards.worker` and the plug-in folders, or
    `relax_core.rollout.tool_worker` and a tools file), spoken to with pickles over its stdin/stdout."""

    def __init__(self, args: list[str], module: str):
        self.process = Child([sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env=_worker_env())
        self.broken: str | None = None
        self.ready = False

    def wait_ready(self) -> None:
        if self.ready or self.broken:
            return
        status, detail = self._receive(_START_TIMEOUT_S) or ("broken", "worker did not start in time")
        self.ready, self.broken = status == "ready", detail
        if not self.ready:
            self.process.stop(grace_s=0)  # so the pool replaces it

    def call(self, name: str, module: str, args: tuple, timeout_s: float) -> Outcome:
        self.wait_ready()
        if self.broken:
            return Outcome("error", error=self.broken)
        request = pickle.dumps((name, module, args))  # whole first: a failure must not half-write
        self.process.stdin.write(request)
        self.process.stdin.flush()
        reply = self._receive(timeout_s)
        if reply is None:
            return Outcome("timeout", error=f"no result within {timeout_s:g} s")
        status, value = reply
        return Outcome("ok", value) if status == "ok" else Outcome("error", error=value)

    def _receive(self, timeout_s: float) -> tuple[str, Any] | None:
        """The worker's next reply; None past `timeout_s`; ("error", ...) if it died."""
        readable, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        if not readable:
            return None
        try:
            return pickle.load(self.process.stdout)
        except (EOFError, pickle.UnpicklingError, OSError):
            self.process.wait(timeout=10)
            return "error", f"worker died (exit code {self.process.returncode})"

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        self.process.stop(grace_s=0)  # a hung call would not heed SIGTERM


def _worker_env() -> dict[str, str]:
    # the worker must import this very package, also when it is not installed (tests, a checkout)
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


class WorkerPool:
    """`size` worker processes; `await pool.call(...)` runs one call (a reward's, a tool's) in one of them."""

    def __init__(self, size: int, plugin_dirs: list[str] | tuple[str, ...] = (),
                 *, module: str):
        """`module`: the workers' entry point, given `plugin_dirs` as its arguments (rewards/worker.py's
        protocol: "ready" first, then one pickled reply per pickled `(name, module, args)`)."""
        self.size, self.plugin_dirs, self.module = size, [str(d) for d in plugin_dirs], module
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._threads = ThreadPoolExecutor(max_workers=size, thread_name_prefix="relax-reward")
        self._lock = threading.RLock()
        self._workers: set[_Worker] = set()
        self._closed = False
        for _ in range(size):
            self._idle.put(self._start())
        # a worker that is already importing, so replacing a hung one does not stall its slot
        self._spare: _Worker | None = self._start()

    def _start(self) -> _Worker:
        worker = _Worker(self.plugin_dirs, self.module)
        with self._lock:
            self._workers.add(worker)
        return worker

    async def call(self, name: str, module: str, args: tuple, timeout_s: float) -> Outcome:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self._call_blocking, name, module, args, timeout_s)

    def _call_blocking(self, name: str, module: str, args: tuple, timeout_s: float) -> Outcome:
        worker = self._idle.get()
        outcome = Outcome("error", error="worker failed")
        try:
            outcome = worker.call(name, module, args, timeout_s)
        finally:
            if self._closed:
                worker.stop()
            elif outcome.status == "ok" or (outcome.status == "error" and worker.alive):
                self._idle.put(worker)
            else:  # hung or dead: replace it, so one bad sample costs one worker restart
                self._replace(worker)
        return outcome

    def _replace(self, worker: _Worker) -> None:
        worker.stop()
        with self._lock:
            self._workers.discard(worker)
            replacement, self._spare = self._spare or self._start(), self._start()
        self._idle.put(replacement)

    def warm_up(self) -> None:
        """Wait until every worker has loaded its rewards (so the first calls' time limits are fair)."""
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            worker.wait_ready()

    def close(self) -> None:
        """Stop every worker process (started by this pool; killed by their own handles)."""
        self._closed = True
        with self._lock:
            workers, self._workers, self._spare = list(self._workers), set(), None
        for worker in workers:  # a call waiting on a killed worker returns at once
            worker.stop()
        self._threads.shutdown(wait=True, cancel_futures=True)


def default_workers() -> int:
    """One worker per CPU this process may use, at most 16."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(16, cpus))


def send(stream, message) -> None:
    """A worker's reply to its parent: `message` pickled whole onto `stream` (the worker's stdout)."""
    try:
        data = pickle.dumps(message)  # whole, so a failure cannot leave half a reply in the pipe
    except Exception as exc:  # an unpicklable return value
        data = pickle.dumps(("error", f"reward returned an unpicklable value: {exc}"))
    stream.write(data)
    stream.flush()
