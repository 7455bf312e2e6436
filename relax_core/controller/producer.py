"""The rollout side of the asynchronous modes: a thread that generates ahead of training.

    for step s = first .. last:
        wait until the trainer has published version >= s - 1 - max_staleness   (staleness bound)
        engines older than the newest published version?  broadcast it (engines idle: between batches)
        apply requested engine changes (add: gets the weights first; remove: drained first)
        samples = rollout(s)              every sample carries the one version that generated it
        bus.put(s, samples); advantage stage adds its field; record (count, ids, times) for the trainer
    the run told to stop: the step being generated is aborted (controller/preemption.py) and dropped

Weights change only between two batches, so no sample mixes two policy
versions, and the staleness of a sample consumed at step s is exactly
`(s - 1) - sample.policy_version <= max_staleness`. With max_staleness 0 the
thread waits for every new version: the samples are those colocate would use.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from relax_core.controller.preemption import Preempted
from relax_core.rollout.types import Sample

log = logging.getLogger(__name__)


class VersionGate:
    """The newest policy version the trainer has published, and a way to wait for one."""

    def __init__(self, version: int):
        self._version = version
        self._cond = threading.Condition()

    @property
    def version(self) -> int:
        return self._version

    def publish(self, version: int) -> None:
        with self._cond:
            self._version = max(self._version, version)
            self._cond.notify_all()

    def wait_for(self, version: int, stop: threading.Event) -> float:
        """Block until `version` is published (or `stop`); returns the seconds waited."""
        start = time.perf_counter()
        with self._cond:
            while self._version < version and not stop.is_set():
                self._cond.wait(0.1)
        return time.perf_counter() - start


@dataclass
class StepRecord:
    """What the producer did for one step (read by the trainer loop for its metrics and checkpoint)."""

    step: int
    count: int
    sample_ids: list[int]
    generate_s: float
    idle_s: float
    sync_s: float
    data_state: dict
    reward_stats: dict[str, float] = field(default_factory=dict)
    engine_stats: dict[str, float] = field(default_factory=dict)


class RolloutProducer(threading.Thread):
    def __init__(self, job, bus, gate: VersionGate, first: int, last: int,
                 advantages: Callable[[list[Sample]], list[float]] | None):
        super().__init__(name="relax-rollout", daemon=True)
        self.job, self.bus, self.gate, self.first, self.last = job, bus, gate, first, last
        self.advantages = advantages
        self.halt = threading.Event()
        self.error: BaseException | None = None
        self.engine_version = job.policy_version
        self.records: dict[int, StepRecord] = {}
        self._cond = threading.Condition()

    def run(self) -> None:
        loop = asyncio.new_event_loop()
        manager = self.job.make_rollout_manager()
        try:
            for step in range(self.first, self.last + 1):
                if not self._produce(step, manager, loop):
                    break
        except Preempted as exc:
            log.info("rollout ended: %s", exc)
        except BaseException as exc:  # handed to the trainer loop, which raises it
            log.exception("rollout failed")
            self.error = exc
        finally:
            manager.close(loop)
            loop.close()
            with self._cond:
                self._cond.notify_all()

    def _produce(self, step: int, manager, loop) -> bool:
        idle_s = self.gate.wait_for(step - 1 - self.job.recipe.rollout.max_staleness, self.halt)
        if self.halt.is_set():
            return False
        sync_s = self._refresh_weights()
        engine_stats = self.job.engines.apply_pending(
            loop, lambda urls: loop.run_until_complete(manager.set_clients(self.job.clients_for(urls))))
        start = time.perf_counter()
        samples = self.job.rollout(step, manager, loop)
        generate_s = time.perf_counter() - start
        self.bus.put(step, samples)
        if self.advantages is not None:
            self.bus.add_field(step, "advantages", "advantage", self.advantages)
        record = StepRecord(step, len(samples), [s.sample_id for s in samples], generate_s, idle_s, sync_s,
                            self.job.prompts.state_dict(), dict(manager.last_reward_stats), engine_stats)
        with self._cond:
            self.records[step] = record
            self._cond.notify_all()
        return True

    def _refresh_weights(self) -> float:
        """Bring the engines to the newest published version (they are idle now)."""
        if self.gate.version <= self.engine_version:
            return 0.0
        start = time.perf_counter()
        stats = self.job.broadcast_snapshot()
        self.engine_version = int(stats["sync_version"])
        return time.perf_counter() - start

    def record(self, step: int, timeout_s: float) -> StepRecord:
        """Wait until `step`'s samples are on the bus; raises what the producer died of, or `Preempted`
        once the run is told to stop (samples already produced are not trained on: stop at once)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self.job.stop.is_set():
                    raise Preempted(f"step {step} not trained: the run is stopping")
                if step in self.records:
                    return self.records.pop(step)
                if self.error is not None:
                    raise RuntimeError(f"rollout failed: {self.error}") from self.error
                if not self.is_alive() or time.monotonic() > deadline:
                    raise TimeoutError(f"no samples for step {step} after {timeout_s:.0f}s")
                self._cond.wait(0.5)

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=120)
