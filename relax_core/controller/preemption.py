"""What a stop signal does to a running job: act at once, not after the step.

    signal (Slurm's USR1 `signal_before_end_s` before the limit; USR1 or TERM to a local driver)
        -> job.stop is set
        -> every engine: /abort_request {abort_all: true}, again every second until the loop has ended
           (a request sent just before the signal can reach its engine after the first abort)
        -> the step's rollout ends within a second (GenerationAborted -> Preempted,
           rollout/sampling_rounds.py); its samples are dropped
        -> the loop checkpoints the last completed step with its prompt cursor (unless that step
           already is checkpointed) and returns "stopped"; a resumed run regenerates the dropped step

Generation is what makes a step long, and it is the part that can be cut: an
optimizer step or a weight sync already running finishes first (a torch step
cannot be stopped safely half-way).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)
POLL_S = 0.1  # how soon after the signal the first abort goes out
REPEAT_S = 1.0  # then how often, until the training loop has returned


def stop_on_signals(stop: threading.Event, signals=(signal.SIGUSR1, signal.SIGTERM)) -> None:
    """Turn `signals` into `stop` (call from the main thread). The handler only sets the event: the
    threads of `abort_generation_on_stop` and the training loop do the rest."""
    for signum in signals:
        signal.signal(signum, lambda *_: stop.set())


@contextmanager
def abort_generation_on_stop(job) -> Iterator[None]:
    """While the block runs, a thread aborts every engine's requests as soon as `job.stop` is set."""
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(job, done), name="relax-abort-on-stop", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(timeout=10)


def _watch(job, done: threading.Event) -> None:
    while not job.stop.is_set():
        if done.wait(POLL_S):
            return
    log.info("stop requested: aborting the engines' requests; the last completed step is checkpointed next")
    while not done.is_set():
        _abort_all(job)
        done.wait(REPEAT_S)


def _abort_all(job) -> None:
    """`/abort_request` with `abort_all` to each engine (directly, not through the router)."""
    try:
        asyncio.run(_abort_engines(job.clients_for(job.engines.urls)))
    except Exception as exc:  # an engine already gone has nothing left to abort
        log.warning("aborting the engines' requests failed: %s", exc)


async def _abort_engines(clients: list) -> None:
    try:
        results = await asyncio.gather(*(c.abort_request(abort_all=True) for c in clients), return_exceptions=True)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    for client, result in zip(clients, results):
        if isinstance(result, Exception):
            log.warning("aborting the requests of %s failed: %s", client.base_url, result)
