"""The rollout service: engines' client, rollout manager and reward hub in their own process.

    for step s = first .. last (a thread of the actor):
        safe point: wait until the trainer has published version >= s - 1 - max_staleness (the staleness
                    bound); hold while the driver changes the engine set; take the new endpoints
        engines older than the newest published version?  trainer rank 0 broadcasts it (engines idle)
        samples = rollout(s)                 every sample carries the one version that generated it
        TransferQueue partition s <- samples; each downstream service is asked to process its share
        record s: counts, ids, times, prompt cursor, and the refs of the downstream calls
    told to halt: the step being generated is aborted by the driver (controller/preemption.py) and dropped

The driver talks to it in metadata only: `publish(version)` after each
optimizer step, `record(step)` for what a step produced, `pause`/`resume`
around a change of the engine set. Samples go from here straight into
TransferQueue; the trainer ranks read them there.

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
    idle_s: float
    sync_s: float
    data_state: dict
    sample_stats: dict[str, float] = field(default_factory=dict)  # reward, lengths (sample_stats below)
    reward_stats: dict[str, float] = field(default_factory=dict)
    downstream: list = field(default_factory=list)  # refs of the services' calls; resolved = columns written


@dataclass
class Downstream:
    """A service worker asked to process each step after it is put: `handle.process(step, rows)`; the
    workers of one service (same name) share each step's rows."""

    name: str
    handle: Any


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
        self._thread.start()

    def publish(self, version: int) -> None:
        with self._cond:
            self._version = max(self._version, version)
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
        """Hold the production thread at its next safe point (between two batches); True once held."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._hold = True
            self._cond.notify_all()
            while not (self._at_safe_point or self._ended) and time.monotonic() < deadline:
                self._cond.wait(WAIT_S)
            return self._at_safe_point

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
        if self._thread is not None:
            self._thread.join(timeout=120)

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
        sync_s = self._refresh_weights()
        start = time.perf_counter()
        samples = rollout_step(step, self.recipe, self.prompts, self.manager, self.loop, self._halt.is_set)
        generate_s = time.perf_counter() - start
        self.bus.put(step, samples)
        calls = self._ask_downstream(step, len(samples))
        record = StepRecord(step, len(samples), [s.sample_id for s in samples], [s.policy_version for s in samples],
                            generate_s, idle_s, sync_s, self.prompts.state_dict(), sample_stats(samples),
                            dict(self.manager.last_reward_stats), calls)
        with self._cond:
            self._records[step] = record
            self._cond.notify_all()
        return True

    def _ask_downstream(self, step: int, count: int) -> list:
        """Each service's workers process the step's rows, each its own contiguous share."""
        from relax_core.train.batching import shard_bounds

        calls = []
        for name in dict.fromkeys(d.name for d in self.downstream):
            workers = [d for d in self.downstream if d.name == name]
            bounds = shard_bounds(count, len(workers))
            calls += [w.handle.process.remote(step, b - a) for w, a, b in zip(workers, bounds, bounds[1:]) if b > a]
        self.rows_put += count
        return calls

    def produced(self) -> int:
        """Rows put into TransferQueue so far (the driver's queue depth: these minus those trained)."""
        return self.rows_put

    def _safe_point(self, needed_version: int) -> float:
        """Between two batches: wait for the staleness bound and any hold; returns the seconds waited."""
        start = time.perf_counter()
        with self._cond:
            self._at_safe_point = True
            self._cond.notify_all()
            while (self._version < needed_version or self._hold) and not self._halt.is_set():
                self._cond.wait(WAIT_S)
            self._at_safe_point = False
            endpoints, self._endpoints = self._endpoints, None
        if endpoints is not None:
            self.loop.run_until_complete(self.manager.set_clients(self._clients(endpoints)))
        return time.perf_counter() - start

    def _refresh_weights(self) -> float:
        """Bring the engines to the newest published version (they are idle now)."""
        import ray

        if self._version <= self.engine_version:
            return 0.0
        start = time.perf_counter()
        version = self._version
        try:
            stats = ray.get(self.trainer0.sync_weights.remote(None))
        except Exception as exc:  # an engine died: once it is replaced, every engine holds these weights
            self.loop.run_until_complete(self.manager.replace_engines(exc))
            stats = {"sync_version": version}
        self.engine_version = int(stats.get("sync_version", version))
        return time.perf_counter() - start


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


def sample_stats(samples: list) -> dict[str, float]:
    """What the driver logs about a step's samples without holding them."""
    from statistics import fmean

    if not samples:
        return {"reward_mean": 0.0, "response_len_mean": 0.0, "prompt_len_mean": 0.0, "truncated_frac": 0.0,
                "response_tokens": 0.0}
    lengths = [s.response_len for s in samples]
    return {"reward_mean": fmean(s.reward for s in samples), "response_len_mean": fmean(lengths),
            "prompt_len_mean": fmean(len(s.prompt_ids) for s in samples),
            "truncated_frac": fmean(s.finish_reason == "length" for s in samples),
            "response_tokens": float(sum(lengths))}
