"""Which failures restart a job from its checkpoint (controller/restarts.py), and when they stop doing so.

The job here is the part `JobRestarts` asks: are processes lost, is it stopping, its run directory.
Killing real trainer ranks is tests/integration/test_recovery.py's.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from relax_core.controller.restarts import JobRestarts, RestartLimit
from relax_core.errors import RecipeError
from relax_core.rollout.client import EngineFailed


def job(tmp_path, lost=(), stopping=False):
    stop = threading.Event()
    if stopping:
        stop.set()
    return SimpleNamespace(stop=stop, lost=list(lost), progress=SimpleNamespace(checkpointed=8),
                           run=SimpleNamespace(logs=tmp_path / "logs"))


def restarts_at_most(limit: int) -> JobRestarts:
    return JobRestarts(limit, probe=lambda job, timeout_s: job.lost)


class OutOfMemoryError(RuntimeError):  # as torch names it
    pass


def test_a_lost_rank_restarts_until_the_limit_then_the_run_ends_naming_it(tmp_path):
    restarts = restarts_at_most(2)
    died = job(tmp_path, lost=["trainer rank 1 (pid 7 on n1) is gone (ActorDiedError: ...)"])
    for count in (1, 2):
        assert restarts.cause(RuntimeError("gloo: connection reset"), died).startswith("trainer rank 1")
        assert restarts.count == count and restarts.history[-1]["from_step"] == 8
    with pytest.raises(RestartLimit) as raised:
        restarts.cause(RuntimeError("gloo: connection reset"), died)
    message = str(raised.value)
    assert "trainer rank 1 (pid 7 on n1)" in message and "recovery.max_restarts=2" in message
    assert str(tmp_path / "logs" / "driver.log") in message


def test_errors_a_restart_would_repeat_end_the_run_at_once(tmp_path):
    restarts = restarts_at_most(3)
    healthy = job(tmp_path)
    assert restarts.cause(RecipeError("data.path: no such file"), job(tmp_path, lost=["rank"])) is None
    assert restarts.cause(EngineFailed("engine e0 ..."), healthy) is None
    assert restarts.cause(ValueError("a bug"), healthy) is None  # nothing was lost: it would happen again
    assert restarts.cause(RuntimeError("x"), job(tmp_path, lost=["rank"], stopping=True)) is None
    assert restarts.cause(RuntimeError("x"), None) is None  # failed while starting
    assert restarts.count == 0


def test_out_of_memory_restarts_once_and_the_same_error_again_ends_the_run(tmp_path):
    restarts, healthy = restarts_at_most(3), job(tmp_path)
    first = OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    wrapped = RuntimeError("ray task failed")
    wrapped.cause = first  # as a Ray task's error carries what the task raised
    assert restarts.cause(wrapped, healthy).startswith("out of memory: OutOfMemoryError: CUDA out of memory")
    assert restarts.cause(OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), healthy) is None
    other = OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")  # other shapes: once more
    assert restarts.cause(other, healthy) is not None and restarts.count == 2
