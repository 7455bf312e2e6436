"""The rollout service: engines' client, rollout manager and reward hub in their own process.

    production thread (per step s = first .. last):
        safe point: wait until the engines hold version >= s - 1 - max_staleness (the staleness bound)
                    and the steps not yet trained hold less than rollout.max_queue_mb of TransferQueue;
                    hold while the driver changes the engine set; take the new endpoints
        samples = rollout(s)                 each token carries the version that generated it; each prompt
                                             group goes into TransferQueue partition s as soon as it is
                                             scored; the reference workers are asked to process the rows
                                             a micro-batch at a time as they arrive (they work while the
                                             rest of the step generates), the advantage service the whole
                                             step once it is in
        record s: counts, ids, times, prompt cursor, and the refs of the downstream calls
    weight thread (whenever the trainer publishes a version the engines lack):
        trainer rank 0 broadcasts its newest snapshot while the engines generate: each engine is paused
        (SGLang's retract), loads the weights and continues; a request in flight goes on under the new
        weights, and the engine reports which of its tokens each version made
    told to halt: the step being generated is aborted by the driver (controller/preemption.py) and dropped

The driver talks to it in metadata only: `publish(version)` after each
optimizer step, `record(step)` for what a step produced, `pause`/`resume`
around a change of the engine set. Samples go from here straight into
TransferQueue; the trainer ranks read them there.

Weights reach the engines as soon as a version is published, not between two
batches: no engine waits for a step's slowest sample before it gets the new
weights, and no step's generation waits for a sync to start. A sample may
therefore mix versions, oldest first; the engines were at version >= s - 1 -
max_staleness when step s began and only newer ones follow, so every token of
a sample consumed at step s has staleness `(s - 1) - version <= max_staleness`
(controller/streaming.py checks it per token). With max_staleness 0 the
production thread waits for every new version before each step, and a
publish during the step's generation cannot happen (the trainer waits for the
step), so the samples are those colocate would use.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from relax_core.rollout.sampling_rounds import Preempted

log = logging.getLogger(__name__)
WAIT_S = 0.1  # how often a waiting thread looks at halt


@dataclass
class StepRecord:
    """What the rollout service did for one step (metadata only: the samples are in TransferQueue)."""

    step: int
    count: int
    sample_ids: list[int]
    versions: list[int]
    generate_s: float
    idle_s: float  # the production thread waited at the safe point (staleness bound, an engine change)
    sync_s: float  # the engines were paused for weight updates while this step generated
    data_state: dict
    sample_stats: dict[str, float] = field(default_factory=dict)  # reward, lengths (sample_stats below)
    reward_stats: dict[str, float] = field(default_factory=dict)
    downstream: list = field(default_factory=list)  # refs of the services' calls; resolved = columns written


@dataclass
class Downstream:
    """A service worker asked to process rows once they are put: `handle.process(step, rows)`. The workers
    of one service (same name) share each step's rows. `whole_step`: the service needs all of a step's rows
    in one call (the advantage service: batch whitening and estimators over the step); else it is asked as
    the groups stream in, `batch_rows` at a time (its forward's micro-batch) and the rest at the step's end."""

    name: str
    handle: Any
    whole_step: bool = False
    batch_rows: int = 1


class RolloutService:
    """A Ray actor (threaded: the driver's calls arrive while the production thread runs)."""

    def __init__(self, recipe, model_dir: str, api_key: str, trainer0, cpus: list[int] | None = None):
        """Loads the tokenizer and the prompts; `start` connects to the engines, the reward's judge
        engines (`reward.genrm`) and TransferQueue."""
        import torch

        from relax_core.cluster.actors import pin_process
        from relax_core.config.data import FileData
        from relax_core.data.prompts import build_prompt_source
        from relax_core.models.model_dir import trust_remote_code
        from relax_core.models.tokenizer import load_tokenizer
        from relax_core.rollout.settings import media_prompts

        if cpus:
            pin_process(cpus)
        torch.set_num_threads(1)  # tokenizing and packing columns: no intra-op work worth threads
        from relax_core.data.bus import import_tq

        import_tq()  # now, while the engines load; attached in `start`, once the driver started it
        self.recipe, self.api_key, self.trainer0 = recipe, api_key, trainer0
        self.loop = asyncio.new_event_loop()
        tokenizer = load_tokenizer(model_dir, trust_remote_code(recipe))
        self.prompts = build_prompt_source(recipe.data)
        self.tokenizer = tokenizer
        self.system = recipe.data.system_prompt if isinstance(recipe.data, FileData) else None
        self.media = media_prompts(recipe, model_dir)  # its worker processes start on first use
        self.reward_hub = self.manager = self.bus = None
        self.engine_version = 0
        self.downstream: list[Downstream] = []
        self.rows_put = 0
        self._queued: dict[int, int] = {}  # step -> bytes put into TransferQueue, until the step is trained
        self._version = 0  # newest version the trainer published
        self._cond = threading.Condition()
        self._halt = threading.Event()
        self._hold = False  # the driver asked for a safe point (an engine change)
        self._at_safe_point = False
        self._endpoints: list[str] | None = None
        self._records: dict[int, StepRecord] = {}
        self._error: BaseException | None = None
        self._ended = False
        self._thread: threading.Thread | None = None
        self._weights: threading.Thread | None = None  # the weight thread (`_sync_loop`)
        self._syncing = False  # a weight update is in progress
        self._sync_s = 0.0  # seconds the engines were paused for weight updates since the last step's record
        self._sync_failed: tuple[Exception, int] | None = None  # (error, version) of a failed update
        self._recovery_asked: str | None = None  # why the production thread waits for engines replaced
        self._recovery_answer: tuple[list[str] | None, str | None] | None = None

    def _clients(self, urls: list[str]) -> list:
        from relax_core.rollout.client import EngineClient

        return [EngineClient(url, api_key=self.api_key) for url in urls]

    def node_id(self) -> str:
        from relax_core.cluster.actors import node_id

        return node_id()

    # ---------------------------------------------------------- driver's calls
    def start(self, first: int, last: int, endpoints: list[str], data_state: dict, engine_version: int,
              downstream: list[Downstream], judge=None) -> None:
        """Produce steps `first`..`last`, from the prompt cursor `data_state`, through `endpoints`, whose
        engines hold `engine_version` (= the trainer's newest), asking `downstream` to process each step;
        `judge`: where the judge engines of `reward.genrm` serve."""
        from relax_core.data.bus import SampleBus
        from relax_core.rewards.hub import RewardHub
        from relax_core.rollout.manager import RolloutManager
        from relax_core.rollout.settings import agentic, sampling_config

        self.bus = SampleBus.attach()
        self.prompts.load_state_dict(data_state)
        self.reward_hub = RewardHub.from_config(self.recipe.reward, judge=judge)
        self.manager = RolloutManager(self._clients(endpoints), self.tokenizer, sampling_config(self.recipe),
                                      self.reward_hub, self.system, self.media, self.recipe.data.apply_chat_template,
                                      recovery=_DriverRecovery(self),
                                      agentic=agentic(self.recipe, self.tokenizer))
        self.engine_version = self._version = engine_version
        self.downstream = downstream
        self._thread = threading.Thread(target=self._run, args=(first, last), name="relax-rollout", daemon=True)
        self._weights = threading.Thread(target=self._sync_loop, name="relax-weights", daemon=True)
        self._thread.start()
        self._weights.start()

    def publish(self, version: int) -> None:
        """The trainer trained step `version` (its rows leave TransferQueue): the engines should get it."""
        with self._cond:
            self._version = max(self._version, version)
            for step in [s for s in self._queued if s <= version]:
                del self._queued[step]
            self._cond.notify_all()

    def record(self, step: int, timeout_s: float) -> StepRecord | None:
        """`step`'s record once its samples are in TransferQueue; None if not within `timeout_s`.
        Raises what the production thread died of, or `Preempted` when it ended without `step`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while step not in self._records:
                if self._error is not None:
                    raise RuntimeError(f"rollout failed: {self._error!r}") from self._error
                if self._ended:
                    raise Preempted(f"the rollout ended before step {step}")
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, WAIT_S))
            return self._records.pop(step)

    def pause(self, timeout_s: float = 600) -> bool:
        """Hold the production thread at its next safe point (between two batches) and the weight thread
        between two updates; True once both are held."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._hold = True
            self._cond.notify_all()
            while not ((self._at_safe_point and not self._syncing) or self._ended) and time.monotonic() < deadline:
                self._cond.wait(WAIT_S)
            return self._at_safe_point and not self._syncing

    def resume(self, endpoints: list[str] | None = None) -> None:
        """Let the thread go on, sending to `endpoints` from its next batch on (when given)."""
        with self._cond:
            if endpoints is not None:
                self._endpoints = list(endpoints)
            self._hold = False
            self._cond.notify_all()

    # ---------------------------------------------------- engine recovery
    def recovery_request(self, timeout_s: float) -> str | None:
        """The driver's recovery thread: why the production thread waits for failed engines to be replaced
        (nothing of it is in flight), once it does within `timeout_s`; else None."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._recovery_asked is None and time.monotonic() < deadline:
                self._cond.wait(min(WAIT_S, max(deadline - time.monotonic(), 0)))
            asked, self._recovery_asked = self._recovery_asked, None
            return asked

    def recovered(self, endpoints: list[str] | None, error: str | None = None) -> None:
        """The driver replaced the engines (requests go to `endpoints` now), or could not (`error`)."""
        with self._cond:
            self._recovery_answer = (endpoints, error)
            self._cond.notify_all()

    def _await_recovery(self, why: str) -> list[str]:
        """Ask the driver to replace the engines that failed; their new endpoints (controller/recovery.py)."""
        from relax_core.rollout.client import EngineFailed

        with self._cond:
            self._recovery_asked, self._recovery_answer = why, None
            self._cond.notify_all()
            while self._recovery_answer is None:
                if self._halt.is_set():
                    raise Preempted("the run is stopping")
                self._cond.wait(WAIT_S)
            endpoints, error = self._recovery_answer
        if error is not None:
            raise EngineFailed(error)
        return endpoints

    def halt(self) -> None:
        self._halt.set()
        self.resume()
        for thread in (self._thread, self._weights):
            if thread is not None:
                thread.join(timeout=120)

    def close(self) -> None:
        self.halt()
        if self.manager is not None:
            self.manager.close(self.loop)
        if self.reward_hub is not None:
            self.reward_hub.close()
        if self.media is not None:
            self.media.close()
        if self.bus is not None:
            self.bus.close()
        self.loop.close()

    # ------------------------------------------------------ production thread
    def _run(self, first: int, last: int) -> None:
        try:
            for step in range(first, last + 1):
                if not self._produce(step):
                    break
        except Preempted as exc:
            log.info("rollout ended: %s", exc)
        except BaseException as exc:  # handed to the driver by `record`
            log.exception("rollout failed")
            self._error = exc
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def _produce(self, step: int) -> bool:
        from relax_core.rollout.sampling_rounds import rollout_step

        idle_s = self._safe_point(step - 1 - self.recipe.rollout.max_staleness)
        if self._halt.is_set():
            return False
        start = time.perf_counter()
        asking = _Asking(step, self.downstream)

        def put(group: list) -> None:  # each prompt group as soon as it is scored
            nbytes = self.bus.put(step, group)
            with self._cond:
                self._queued[step] = self._queued.get(step, 0) + nbytes
            self.rows_put += len(group)
            asking.put(len(group))

        samples = rollout_step(step, self.recipe, self.prompts, self.manager, self.loop, self._halt.is_set, put)
        calls = asking.finish()
        generate_s = time.perf_counter() - start
        with self._cond:
            sync_s, self._sync_s = self._sync_s, 0.0
        record = StepRecord(step, len(samples), [s.sample_id for s in samples], [s.policy_version for s in samples],
                            generate_s, idle_s, sync_s, self.prompts.state_dict(), sample_stats(samples),
                            dict(self.manager.last_reward_stats), calls)
        with self._cond:
            self._records[step] = record
            self._cond.notify_all()
        return True

    def produced(self) -> int:
        """Rows put into TransferQueue so far (the driver's queue depth: these minus those trained)."""
        return self.rows_put

    def _safe_point(self, needed_version: int) -> float:
        """Between two batches: wait until the engines hold `needed_version` (the staleness bound) and for
        any hold; a weight update that failed is recovered here. Returns the seconds waited."""
        start = time.perf_counter()
        while True:
            with self._cond:
                self._at_safe_point = True
                self._cond.notify_all()
                while ((self.engine_version < needed_version or self._hold or self._queue_full())
                       and self._sync_failed is None and not self._halt.is_set()):
                    self._cond.wait(WAIT_S)
                self._at_safe_point = False
                failed, endpoints, self._endpoints = self._sync_failed, self._endpoints, None
            if endpoints is not None:
                self.loop.run_until_complete(self.manager.set_clients(self._clients(endpoints)))
            if failed is None or self._halt.is_set():
                return time.perf_counter() - start
            self._recover_sync(*failed)

    def _queue_full(self) -> bool:
        """`rollout.max_queue_mb`: the steps not yet trained hold that much of TransferQueue (call holding
        `_cond`; an empty queue is never full, so a step larger than the budget still goes, alone)."""
        budget = self.recipe.rollout.max_queue_mb
        return budget is not None and bool(self._queued) and sum(self._queued.values()) >= budget * 2**20

    def _recover_sync(self, error: Exception, version: int) -> None:
        """A weight update failed (an engine died): once the driver replaced it, every engine holds the
        version that was being sent (the recovery sends it to the new engine and again to the others)."""
        self.loop.run_until_complete(self.manager.replace_engines(error))
        with self._cond:
            self.engine_version = max(self.engine_version, version)
            self._sync_failed = None
            self._cond.notify_all()

    # ---------------------------------------------------------- weight thread
    def _sync_loop(self) -> None:
        """Bring the engines to each newly published version at once, while they generate."""
        import ray

        while True:
            with self._cond:
                while (not self._halt.is_set() and (self._version <= self.engine_version or self._hold
                                                    or self._sync_failed is not None)):
                    self._cond.wait(WAIT_S)
                if self._halt.is_set():
                    return
                version, self._syncing = self._version, True
            start = time.perf_counter()
            try:
                stats = ray.get(self.trainer0.sync_weights.remote(None, True))
            except Exception as exc:  # the production thread has the driver replace the engine (`_recover_sync`)
                log.warning("the weight update to version %d failed: %s", version, exc)
                with self._cond:
                    self._sync_failed, self._syncing = (exc, version), False
                    self._cond.notify_all()
                continue
            with self._cond:
                self.engine_version = max(self.engine_version, int(stats.get("sync_version", version)))
                self._sync_s += stats.get("sync_paused_s", time.perf_counter() - start)
                self._syncing = False
                self._cond.notify_all()


class _DriverRecovery:
    """The rollout manager's recovery in this process: the driver replaces the engines (it owns them),
    asked through `recovery_request` / `recovered`; the driver also runs the health watch."""

    check_every_s = None

    def __init__(self, service: RolloutService):
        self.service = service

    async def recover(self, error: Exception) -> list:
        from relax_core.cluster.actors import describe

        endpoints = await asyncio.to_thread(self.service._await_recovery, describe(error))
        return self.service._clients(endpoints)



class _Asking:
    """Who processes which rows of one step: each service is asked as the step's rows arrive, one worker
    per call in turn, in calls of at least its `batch_rows` rows (a whole-step service once, at the end)."""

    def __init__(self, step: int, downstream: list[Downstream]):
        self.step = step
        names = dict.fromkeys(d.name for d in downstream)
        self.services = [[d for d in downstream if d.name == name] for name in names]
        self.waiting = [0] * len(self.services)  # rows put that each service was not asked about yet
        self.turns = [0] * len(self.services)
        self.calls: list = []

    def put(self, rows: int) -> None:
        for index, workers in enumerate(self.services):
            self.waiting[index] += rows
            if not workers[0].whole_step and self.waiting[index] >= workers[0].batch_rows:
                self._ask(index)

    def finish(self) -> list:
        """The calls of the step (the rest of its rows asked about now)."""
        for index in range(len(self.services)):
            if self.waiting[index]:
                self._ask(index)
        return self.calls

    def _ask(self, index: int) -> None:
        workers = self.services[index]
        worker = workers[self.turns[index] % len(workers)]
        self.calls.append(worker.handle.process.remote(self.step, self.waiting[index]))
        self.turns[index] += 1
        self.waiting[index] = 0


def sample_stats(samples: list) -> dict[str, float]:
    """What the driver logs about a step's samples without holding them."""
    from statistics import fmean

    from relax_core.data.sample import length_stats

    if not samples:
        return {"reward_mean": 0.0, "prompt_len_mean": 0.0, "truncated_frac": 0.0, "response_tokens": 0.0,
                **length_stats(samples)}
    return {"reward_mean": fmean(s.reward for s in samples), **length_stats(samples),
            "prompt_len_mean": fmean(len(s.prompt_ids) for s in samples),
            "truncated_frac": fmean(s.finish_reason == "length" for s in samples),
            "response_tokens": float(sum(s.response_len for s in samples))}
