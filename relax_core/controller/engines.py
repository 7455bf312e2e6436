"""The rollout engines of a job, as one set that can grow and shrink during the run.

`EngineSet` owns the engine actors (each starts one engine server), the
router in front of them (when there is one) and the trainer's weight-update
group that reaches them. An engine loads while the run goes on (`spawn`);
what touches the running set happens at a safe point, when no request is in
flight on the driver's side (between two rollout batches):

    join:    healthy engine -> weight group re-formed with it -> current weights broadcast to every
             engine -> router routes to it
    remove:  router stops routing to it and waits until it drained -> weight group re-formed without
             it -> engine stopped by PID (only one this run started)

so an added engine never answers a request with stale weights, and a removed
one finishes what it was given. Which engines come and go, and when, is the
scale operations' business (elastic.py). The rollout side reaches the engines
through `endpoints()`: the router's URL, or each engine's URL when there is no
router.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relax_core.config.engines import engine_kind
from relax_core.rollout.engine_command import EngineSettings

log = logging.getLogger(__name__)


@dataclass
class EngineSpec:
    """How to start one engine (the same for every engine of a run)."""

    settings: EngineSettings  # what its command line is built from (rollout/engine_command.py)
    log_dir: str
    api_key: str
    cpus: list[int] | None = None  # cores to pin the engine to (local executor), None: no pinning

    @property
    def gpus(self) -> int:
        """GPUs of each engine: its TP size on GPUs, none otherwise."""
        return self.settings.tp_size if engine_kind(self.settings.engine).on_gpus else 0

    @property
    def ranks_per_engine(self) -> int:
        """Ranks each engine has in the weight-update group: every TP rank of an engine on GPUs."""
        return self.gpus or 1

    @property
    def weight_backend(self) -> str:
        """The weight-update group's backend: NCCL to engines on GPUs, gloo to the CPU engine."""
        return "nccl" if self.gpus else "gloo"


class EngineSet:
    def __init__(self, ray, spec: EngineSpec, bucket_bytes: int, slots, router=None, trainer0=None,
                 sources_of: Callable[[int], list[int]] | None = None):
        """`slots`: the run's `GpuSlots` (where each engine goes); `router`: a `relax_core.rollout.router.Router`
        (started by `connect`), or None to reach the engines directly; `trainer0`: rank 0 of the trainers,
        which owns the weight broadcaster (set before `connect`); `sources_of` (engines on the trainer ranks'
        GPUs, colocate.py): slot -> the trainer rank on each of its GPUs, which hands the weights over by
        reference to the engine rank there (weights/ipc.py); None: weights are broadcast."""
        self._ray, self.spec, self.trainer0, self.bucket_bytes, self.router = ray, spec, trainer0, bucket_bytes, router
        self.slots, self.sources_of = slots, sources_of
        self._slot_of: dict[int, Any] = {}  # slot -> the engine actor holding it
        self.actors: dict[str, Any] = {}  # url -> EngineWorker actor
        self._next_index = 0
        self._launched: list = []
        self._extra: list = []  # engines started during the run (joined or not yet)
        self._logs: list[tuple[Any, str]] = []  # (engine actor, its log file)

    # ------------------------------------------------------------ start-up
    def launch(self, count: int) -> list:
        """Start `count` engines; returns refs that resolve to their URLs when healthy (then `connect`)."""
        self._launched = [self._spawn() for _ in range(count)]
        return [actor.wait_ready.remote() for actor in self._launched]

    def _spawn(self, options: dict[str, Any] | None = None):
        from relax_core.rollout.engine_worker import EngineWorker

        s, index = self.spec, self._next_index
        slot, gpus = None, None
        if options is None:
            slot = self._free_slot()
            options, gpus = self.slots.engine_options(slot)
        self._next_index += 1
        # Two threads: where it runs (`node_id`, to place the rollout service beside it) is answered
        # while `wait_ready` still waits for the server.
        log_path = f"{s.log_dir}/engine-{index}.log"
        actor = self._ray.remote(max_concurrency=2)(EngineWorker).options(**options).remote(
            index, s.settings, log_path, s.api_key, s.cpus, gpus=gpus)
        if slot is not None:
            self._slot_of[slot] = actor
        self._logs.append((actor, log_path))
        return actor

    def log_of(self, url: str) -> str | None:
        """The log file of the engine at `url` (None: one this run did not start)."""
        actor = self.actors.get(url)
        return next((path for a, path in self._logs if actor is not None and a is actor), None)

    def kill(self, url: str) -> bool:
        """End the engine at `url` at once (it hangs: its requests then fail); True if this run started it.
        It stays in the set until `remove(url, alive=False)`."""
        actor = self.actors.get(url)
        if actor is None:
            return False
        self._ray.kill(actor)
        return True

    def _free_slot(self) -> int:
        """The lowest slot no engine holds: its GPUs (gpu_slots.py); CPU engines have as many as they need."""
        capacity = self.slots.engine_capacity
        free = [slot for slot in range(capacity or len(self._slot_of) + 1) if slot not in self._slot_of]
        if not free:
            raise RuntimeError(f"no GPUs left for another engine: the {capacity} engine slots of the engines' "
                               "node group are all taken")
        return free[0]

    def connect(self, urls: list[str]) -> None:
        """Once the first engines are healthy: form the weight group, start the router."""
        self.actors = dict(zip(urls, self._launched))
        self._ray.get(self.trainer0.connect_engines.remote(urls, self.spec.api_key, self.bucket_bytes,
                                                           self.spec.ranks_per_engine, self.spec.weight_backend,
                                                           self._sources()))
        if self.router is not None:
            self.router.start(urls)

    @property
    def hands_over(self) -> bool:
        """The weights go by reference from every trainer rank (`Job.sync_weights` calls them all)."""
        return self.sources_of is not None

    def _sources(self) -> dict[str, list[int]] | None:
        """Engine URL -> the trainer rank feeding each of its TP ranks (None: weights are broadcast)."""
        if self.sources_of is None:
            return None
        slot_of = {id(actor): slot for slot, actor in self._slot_of.items()}
        return {url: self.sources_of(slot_of[id(actor)]) for url, actor in self.actors.items()}

    # ------------------------------------------------------ memory (shared GPUs)
    def release_memory(self, loop: asyncio.AbstractEventLoop, tags: list[str] | None = None) -> None:
        """Every engine (idle) gives back the memory of `tags` (None: all) until `resume_memory`."""
        loop.run_until_complete(self._each_engine(lambda c: c.release_memory_occupation(tags)))

    def resume_memory(self, loop: asyncio.AbstractEventLoop, tags: list[str] | None = None) -> None:
        loop.run_until_complete(self._each_engine(lambda c: c.resume_memory_occupation(tags)))

    async def _each_engine(self, call) -> None:
        from relax_core.rollout.client import EngineClient

        clients = [EngineClient(url, api_key=self.spec.api_key) for url in self.urls]
        try:
            await asyncio.gather(*(call(c) for c in clients))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    @property
    def urls(self) -> list[str]:
        return list(self.actors)

    @property
    def launched(self) -> list:
        """The engine actors started at launch (the first one places the rollout service beside it)."""
        return list(self._launched)

    def ready(self, actor):
        """A ref that resolves to the URL of `actor`'s engine once it is healthy."""
        return actor.wait_ready.remote()

    def endpoints(self) -> list[str]:
        """Where the rollout manager sends requests: the router, or every engine."""
        return [self.router.url] if self.router is not None else self.urls

    # ------------------------------------------------------------- changes
    def spawn(self, options: dict[str, Any] | None = None):
        """Start one more engine (it loads while the run goes on); `options`: Ray options placing it on
        nodes that joined for it (a scale-out job's, controller/elastic.py), else it takes a free slot of
        the engines' group. Returns the actor; `ready(actor)` resolves to its URL once healthy."""
        if self.hands_over:  # the resend would need every trainer rank, which only `Job.sync_weights` calls
            raise RuntimeError("engines on the trainer ranks' GPUs (colocate on GPU nodes) cannot be added "
                               "during a run; start the run with rollout.num_engines of them")
        actor = self._spawn(options)
        self._extra.append(actor)
        return actor

    async def join(self, url: str, actor=None) -> None:
        """Call at a safe point (no request in flight): `url` (a healthy engine; `actor`: the one that runs
        it, None for an engine someone else started) joins the weight group, gets the weights every other
        engine holds, and only then is routed to."""
        self.actors[url] = actor
        try:
            await asyncio.wrap_future(self.trainer0.set_engines.remote(self.urls, True).future())
            if self.router is not None:
                await self.router.add_engine(url)
        except BaseException:
            self.actors.pop(url, None)
            raise
        log.info("engine %s joined", url)

    async def remove(self, url: str, alive: bool = True) -> None:
        """Stop routing to `url`, let it drain, drop it from the weight group, stop it (if this run started
        it). `alive` False: the engine is gone (its node left): it is only forgotten."""
        if self.router is not None and url in await self.router.engines():
            await self.router.remove_engine(url, drain=alive)
        actor = self.actors.pop(url)
        await asyncio.wrap_future(self.trainer0.set_engines.remote(self.urls, False).future())
        if actor is not None and alive:
            try:
                await asyncio.wrap_future(actor.stop.remote().future())
            except Exception as exc:  # its node may be going away as well
                log.warning("stopping engine %s failed: %s", url, exc)
        if actor is not None:
            self.forget(actor)
        log.info("engine %s removed", url)

    def forget(self, actor) -> None:
        """End an engine actor this run started (removed, or never joined: a cancelled or failed
        scale-out); its slot (its GPUs) is free again."""
        self._ray.kill(actor)
        self._slot_of = {slot: a for slot, a in self._slot_of.items() if a is not actor}
        self._extra = [a for a in self._extra if a is not actor]

    # ------------------------------------------------------------ shutdown
    def stop(self) -> None:
        """Stop the router and every engine started, also those launched but never connected (a set-up
        that failed half-way), then end their actors."""
        if self.router is not None:
            self.router.stop()
        from relax_core.cluster.actors import end_actors

        started = [a for a in [*self.actors.values(), *self._launched, *self._extra] if a is not None]
        end_actors(self._ray, list({id(a): a for a in started}.values()), "engines")
