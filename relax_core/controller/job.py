"""A running job: its trainer ranks, engines, services, data and metrics.

`Job` owns every process the run started (Ray actors and the engine
servers they launch, and in the asynchronous modes TransferQueue and the
services of relax_core/services) and stops them on `close()`, or as soon as
its set-up fails. The training loops (`colocate.py`, `streaming.py`) call its
verbs: `rollout`, `train`, `train_rows`, `sync_weights`, `resume`, `log`;
and its `progress` (progress.py): `step_done`, `checkpoint`, and `stop_here`
when told to stop. Its scale operations are `elastic` (elastic.py), its
engine recovery `recovery` (recovery.py).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import threading
import time
from concurrent.futures import Future
from functools import cached_property, partial
from typing import Any

from relax_core.cluster.actors import end_actors
from relax_core.cluster.placement import engines_share_train_gpus, handover_sources, threads_per_process
from relax_core.config.data import FileData
from relax_core.config.engines import engine_kind
from relax_core.config.modes import mode_spec
from relax_core.config.schema import Recipe, rollout_group_name
from relax_core.controller.progress import Progress
from relax_core.controller.restarts import TrainerWatch
from relax_core.controller.scale_out import LocalScaleOut, ScaleOut
from relax_core.controller.workers import RankSetup, TrainerWorker
from relax_core.data.sample import Sample
from relax_core.models.model_dir import prepare_model_dir, trust_remote_code, with_fetched
from relax_core.rollout.settings import agentic, media_prompts, sampling_config
from relax_core.rundir import RunDir
from relax_core.train.settings import megatron_options, trainer_config

log = logging.getLogger(__name__)
ENGINE_KEY = "engine_api_key"


class Job:
    def __init__(self, recipe: Recipe, run: RunDir, console=None, stop: threading.Event | None = None,
                 cpu_sets: dict[str, list[int]] | None = None, notifier=None, restarted: bool = False,
                 scale_out: ScaleOut | None = None):
        """`cpu_sets`: cores of the train and rollout groups when they share one machine (local executor);
        `scale_out`: where `relax scale-rollout`'s engines start (scale_out.py; the driver's entry point
        gives its executor's, default: this machine's);
        `notifier`: the run's `metrics.notify.Notifier` (checkpoints, engine restarts, step summaries);
        `restarted`: this job replaces one that failed (restarts.py; progress.py says what that changes)."""
        import ray

        from relax_core.data.prompts import build_prompt_source
        from relax_core.metrics.tracker import MetricsTracker
        from relax_core.rewards.hub import check_routes

        recipe = with_fetched(recipe, run)  # hub ids: the folders `relax submit` fetched them to
        self.recipe, self.run = recipe, run
        self.mode = mode_spec(recipe.mode)  # what runs where (config/modes.py)
        self.notifier = notifier
        self.stop = stop or threading.Event()  # set on preemption: checkpoint and end the loop
        self.cpu_sets = cpu_sets or {}
        self.scale_out = scale_out or LocalScaleOut.for_run(recipe, run)
        self.loop = asyncio.new_event_loop()
        self.model_dir = prepare_model_dir(recipe, run)
        self._tokenizer_load = None  # colocate: loading in a thread while the engines and trainers start
        self.prompts = build_prompt_source(recipe.data)
        if isinstance(recipe.data, FileData) and recipe.data.reward_key:  # before anything is started
            check_routes(self.prompts.reward_names(), recipe.data.reward_key, recipe.reward.plugin_dirs)
        self.policy_version = 0
        self.trainers: list = []
        self.progress = Progress(ray, recipe, run, self.trainers, self.prompts, self._engines_added, notifier,
                                 restarted)
        self._ray = ray
        self.engines = None
        self.elastic = None  # scale operations (elastic.py), once the engines are up
        self.recovery = None  # engines that die or hang are replaced (recovery.py), once they are up
        self.engine_lock = threading.Lock()  # one change of the engine set at a time (streaming's two threads)
        self.api = None  # the control API (api.py)
        self.slots = None  # controller/gpu_slots.py: what each trainer rank and engine asks Ray for
        self.bus = None  # TransferQueue (asynchronous modes)
        self._bus_start: Future | None = None  # the bus, starting in a thread (asynchronous modes)
        self.services = None  # relax_core.services.launch.ServiceSet (asynchronous modes)
        self.trainer_watch = None  # trainer ranks that stop answering are ended (restarts.py)
        self.rows_trained = 0  # asynchronous modes: rows trained on by this driver (for the queue depth)
        self._media = None  # the media workers of the rollout managers this process makes (prompt_prep.py)
        self.reward_hub = self.rollout_manager = None  # colocate: the driver's own rollout (`_connect`)
        self.tracker = None
        try:
            self._start_processes()
            self.tracker = MetricsTracker(run.metrics, run.tensorboard if recipe.logging.uses("tensorboard") else None,
                                          recipe.train.steps, console, trackers=self._trackers())
        except BaseException:
            self.close()  # a failed set-up stops what it already started before the error propagates
            raise

    def _trackers(self) -> list:
        """The remote trackers `logging.backends` lists, each started at the first step."""
        from relax_core.metrics.tracker import public_recipe

        logging_ = self.recipe.logging
        config = public_recipe(self.recipe.model_dump(mode="json"))
        trackers = []
        if logging_.uses("wandb"):
            from relax_core.metrics.wandb_run import WandbRun

            trackers.append(WandbRun(self.run.path, logging_.wandb.project or self.recipe.name, config))
        if logging_.uses("clearml"):
            from relax_core.metrics.clearml_run import ClearMLRun

            trackers.append(ClearMLRun(self.run.path, logging_.clearml.project or self.recipe.name,
                                       self.run.path.name, config, self.run.logs / "clearml.log"))
        return trackers

    # ------------------------------------------------------------ start-up
    def _start_processes(self) -> None:
        """Engines, trainers and services (loading their models in parallel), TransferQueue meanwhile
        (asynchronous modes); then the router, and the reward hub and manager of colocate's rollout.
        The judge engines of `reward.genrm` load theirs meanwhile too (rewards/judge_service.py)."""
        from relax_core.controller.gpu_slots import GpuSlots
        from relax_core.rewards.judge_service import JudgeService

        self.slots = GpuSlots.reserve(self._ray, self.recipe)
        group = rollout_group_name(self.recipe)
        self.judges = JudgeService.start(self._ray, self.recipe, self.run, self._threads(group),
                                         self.cpu_sets.get(group), self.slots)
        self.engines = self._engine_set()
        shared = self.engines.hands_over  # colocate on GPU nodes: engines on the trainer ranks' GPUs
        engines_ready = None if shared else self.engines.launch(self.recipe.rollout.num_engines)
        self._create_trainers()
        if self.mode.bus:  # TransferQueue's processes start while the models load
            from relax_core.data.bus import import_tq

            import_tq()  # here, not in the thread: a second thread importing torch's modules may break them
            self._bus_start = _in_thread(self._start_bus)
        if not self.mode.rollout_service:  # the driver's rollout manager tokenizes
            from relax_core.models.tokenizer import load_tokenizer

            self._tokenizer_load = _in_thread(load_tokenizer, self.model_dir, trust_remote_code(self.recipe))
        # The first step's log line would wait for these imports (TensorBoard's event writer: 1 s).
        for backend, module in (("tensorboard", "tensorboard.summary.writer.event_file_writer"), ("wandb", "wandb")):
            if self.recipe.logging.uses(backend):
                _in_thread(importlib.import_module, module)
        trainers_ready = self._setup_trainers()
        if shared:  # the ranks load, then hand the GPUs back: each engine sizes its KV cache from what is free,
            self._ray.get(trainers_ready)  # the same on every GPU (SGLang refuses TP ranks whose free memory differs)
            self.sleep_trainers(["optimizer", "model"])
            engines_ready = self.engines.launch(self.recipe.rollout.num_engines)
        if self.mode.rollout_service:
            self._start_services()
        urls = self._ray.get(engines_ready)
        self._ray.get(trainers_ready)
        # Each rank's process, for an operator (and `lost_processes`) to find it by
        self.run.update_state(trainers=self._ray.get([t.process.remote() for t in self.trainers]))
        self.trainer_watch = TrainerWatch(self._ray, self.trainers, self.recipe.recovery.health_timeout_s)
        self.judge = self.judges.endpoints()  # None without reward.genrm; plain data for the reward hub
        log.info("engines ready: %s", ", ".join(urls))
        self.engines.connect(urls)
        self._start_control()
        if self.services is not None:
            log.info("services ready: %s", self.services.ready(self._ray))
        else:
            self._connect()

    def _start_control(self) -> None:
        """The scale operations (elastic.py) and the control API that takes them (api.py)."""
        from relax_core.cluster.actors import node_ip
        from relax_core.controller.api import ControlApi
        from relax_core.controller.elastic import Elastic
        from relax_core.controller.recovery import EngineRecovery

        self.elastic = Elastic(self.engines, self.scale_out,
                               on_change=lambda: self.run.update_state(**self.elastic.snapshot()))
        self.run.update_state(**self.elastic.snapshot())
        self.recovery = EngineRecovery(self, self.recipe.recovery.health_timeout_s,
                                       self.recipe.recovery.max_engine_restarts,
                                       on_restart=self.notifier.engine_restarted if self.notifier else None)
        self.api = ControlApi.start(self.run, self.elastic, node_ip(), self.api_status)

    def api_status(self) -> dict[str, Any]:
        """The run as GET /v1/status shows it (the engines and scale operation are added there)."""
        return {"run_id": self.run.run_id(), "name": self.recipe.name, "mode": self.recipe.mode, "state": "running",
                "step": self.progress.completed[0], "total_steps": self.recipe.train.steps,
                "policy_version": self.policy_version, "stopping": self.stop.is_set(),
                "router": self.engines.router.url if self.engines.router is not None else None}

    @cached_property
    def tokenizer(self):
        """The model directory's tokenizer: colocate's rollout manager encodes the prompts and decodes the
        responses with it (in the asynchronous modes the rollout service has its own)."""
        if self._tokenizer_load is not None:
            return self._tokenizer_load.result()
        from relax_core.models.tokenizer import load_tokenizer

        return load_tokenizer(self.model_dir, trust_remote_code(self.recipe))

    def _start_services(self) -> None:
        from relax_core.services.launch import ServiceSet

        self.services = ServiceSet.start(self._ray, self.recipe, model_dir=str(self.model_dir),
                                         api_key=self.run.secret(ENGINE_KEY), trainer0=self.trainers[0],
                                         engine0=self.engines.launched[0], cpu_sets=self.cpu_sets)
        self.bus = self._bus_start.result()

    def _start_bus(self):
        from relax_core.data.bus import SampleBus

        return SampleBus.start(self.recipe.samples_per_step, max_partitions=self.recipe.rollout.max_staleness + 2)

    def _threads(self, group: str) -> int:
        """Torch threads per process: this node's cores of `group` split between the processes it hosts
        (launch/plan.py, which shows them)."""
        cores = len(self.cpu_sets.get(group, ())) or getattr(self.recipe.cluster, group).cpus_per_node
        return threads_per_process(self.recipe, group, min(cores, os.cpu_count() or 1))

    def _engine_set(self):
        from relax_core.controller.engines import EngineSet, EngineSpec
        from relax_core.rollout.engine_command import rollout_engines

        self.run.write_secret(ENGINE_KEY)
        group = rollout_group_name(self.recipe)
        settings = rollout_engines(self.recipe, str(self.model_dir), self._threads(group))
        spec = EngineSpec(settings, str(self.run.logs), self.run.secret(ENGINE_KEY), self.cpu_sets.get(group))
        shared = engines_share_train_gpus(self.recipe)  # each engine rank fed by the trainer rank on its GPU
        return EngineSet(self._ray, spec, bucket_bytes=int(self.recipe.train.weight_sync_bucket_mb * 2**20),
                         slots=self.slots, router=self._router(),
                         sources_of=partial(handover_sources, self.recipe) if shared else None)

    def _router(self):
        """The router in front of the engines, when the recipe asks for one (`rollout.router`)."""
        if not self.recipe.rollout.uses_router:
            return None
        from relax_core.cluster.actors import node_ip
        from relax_core.rollout.router import Router

        return Router(node_ip(), None, str(self.model_dir), self.run.secret(ENGINE_KEY),
                      str(self.run.logs / "router.log"))

    def _create_trainers(self) -> None:
        world = self.recipe.train_ranks
        # Four threads (asynchronous modes): while a step trains, rank 0 broadcasts the weights of the
        # one before to the engines, and every rank reads the next step's rows from TransferQueue.
        actor = self._ray.remote(max_concurrency=4)(TrainerWorker)
        self.trainers[:] = [actor.options(**self.slots.trainer_options(r)).remote(r, world) for r in range(world)]
        self.engines.trainer0 = self.trainers[0]

    def _setup_trainers(self) -> list:
        """Each rank's `setup` (its model loaded), once rank 0's rendezvous address is known."""
        master = self._ray.get(self.trainers[0].rendezvous_address.remote())
        how = RankSetup(str(self.model_dir), trainer_config(self.recipe), self._threads("train"),
                        self.cpu_sets.get("train"),
                        # on shared GPUs every rank hands its own gathered buckets over: no whole copy kept
                        keep_live=not engines_share_train_gpus(self.recipe),
                        checkpoint_names=engine_kind(self.recipe.rollout.engine).loads_by_checkpoint_names,
                        megatron=megatron_options(self.recipe), bus=self.mode.bus,
                        overlap=self.mode.own_rollout_group)
        return [t.setup.remote(master, how) for t in self.trainers]

    def _connect(self) -> None:
        from relax_core.rewards.hub import RewardHub

        self.reward_hub = RewardHub.from_config(self.recipe.reward, judge=self.judge)
        self.rollout_manager = self.make_rollout_manager()

    def clients_for(self, urls: list[str]) -> list:
        from relax_core.rollout.client import EngineClient

        return [EngineClient(url, api_key=self.run.secret(ENGINE_KEY)) for url in urls]

    def set_endpoints(self, urls: list[str]) -> None:
        """The main thread's rollout manager sends to `urls` from now on (the engine set changed)."""
        self.loop.run_until_complete(self.rollout_manager.set_clients(self.clients_for(urls)))

    def make_rollout_manager(self):
        """A rollout manager whose HTTP clients belong to the calling thread's event loop."""
        from relax_core.rollout.manager import RolloutManager

        clients = self.clients_for(self.engines.endpoints())
        system = self.recipe.data.system_prompt if isinstance(self.recipe.data, FileData) else None
        sampling = sampling_config(self.recipe)
        if self._media is None:
            self._media = media_prompts(self.recipe, self.model_dir)
        return RolloutManager(clients, self.tokenizer, sampling, self.reward_hub, system, self._media,
                              self.recipe.data.apply_chat_template, recovery=self.recovery,
                              agentic=agentic(self.recipe, self.tokenizer))

    # --------------------------------------------------------------- verbs
    def rollout(self, step: int) -> list[Sample]:
        """The step's scored samples: one generation round, or DAPO's rounds (rollout/sampling_rounds.py)."""
        from relax_core.rollout.sampling_rounds import rollout_step

        return rollout_step(step, self.recipe, self.prompts, self.rollout_manager, self.loop, self.stop.is_set)

    def train(self, samples: list[Sample], advantages: list[float] | None = None,
              snapshot_version: int | None = None) -> dict[str, float]:
        """One optimizer step over all ranks (`advantages`: one per sample, from the advantage stage), each
        rank given a share of the samples with about the same number of tokens (`balanced_shards`)."""
        from relax_core.data.balance import balanced_shards

        shards = balanced_shards([s.num_tokens for s in samples], len(self.trainers))
        refs = [t.train_step.remote([samples[i] for i in shard],
                                    [advantages[i] for i in shard] if advantages is not None else None,
                                    snapshot_version) for t, shard in zip(self.trainers, shards)]
        return self._ray.get(refs)[0]

    def sleep_trainers(self, parts: list[str]) -> None:
        """Every rank hands its GPU back to the engines that share it (colocate on GPU nodes; `parts`:
        `TorchTrainer.offload`'s)."""
        self._ray.get([t.offload.remote(parts) for t in self.trainers])

    def wake_trainers(self) -> None:
        """Every rank takes its GPU again, its state back on it (the engines released theirs)."""
        self._ray.get([t.reload.remote() for t in self.trainers])

    def train_rows(self, parts: list | None, fields: tuple[str, ...], version: int) -> list:
        """Start one optimizer step on rows claimed from TransferQueue: rank r gets the metadata of its
        shard `parts[r]` and reads the rows itself (None: the rows it prefetched for `version`); rank 0
        keeps the new weights aside as `version`. Returns the refs of the ranks' results
        (`train_results` reads them)."""
        parts = parts if parts is not None else [None] * len(self.trainers)
        return [t.train_from_bus.remote(part, fields, version) for t, part in zip(self.trainers, parts)]

    def prefetch_rows(self, parts: list, fields: tuple[str, ...], step: int) -> None:
        """Each rank reads its shard `parts[r]` of step `step` now (while the step before trains)."""
        for trainer, part in zip(self.trainers, parts):
            trainer.prefetch.remote(part, fields, step)

    def train_results(self, refs: list) -> tuple[dict[str, float], list, list]:
        """The metrics of a `train_rows` step, and the ids and version counts (`Sample.version_counts`) of the
        samples trained on."""
        results = self._ray.get(refs)
        ids = [i for r in results for i in r["sample_ids"]]
        versions = [v for r in results for v in r["versions"]]
        fetch = max(r["metrics"]["fetch_s"] for r in results)
        return results[0]["metrics"] | {"fetch_s": fetch}, ids, versions

    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        """Broadcast to every engine (engines on the trainer ranks' GPUs: hand over by reference) the live
        weights as `version`, or (None) the newest snapshot."""
        if self.engines.hands_over:  # engines on the trainer ranks' GPUs: every rank hands its part over
            stats = self._ray.get([t.hand_over_weights.remote(version) for t in self.trainers])[0]
        else:
            try:
                stats = self._watched(self.trainers[0].sync_weights.remote(version))
            except Exception as exc:  # an engine died: replaced, it and the others get these weights then
                if self.recovery is None:
                    raise
                if self.rollout_manager is not None:  # colocate: the next step goes to the new engine
                    self.loop.run_until_complete(self.rollout_manager.replace_engines(exc))
                else:  # the rollout service's manager learns the new engines from the driver
                    self.loop.run_until_complete(self.recovery.recover(exc))
                stats = {"sync_version": float(version if version is not None else self.policy_version)}
        self.policy_version = int(stats.get("sync_version", version or 0))
        return stats

    def _watched(self, ref):
        """`ray.get(ref)` of a weight sync, with the engines' health watch meanwhile in colocate (in the
        asynchronous modes the recovery desk watches all the time): an engine stopped during the sync
        would hold it forever; the watch ends it, and the sync fails and takes the recovery path."""
        if self.recovery is None or self.services is not None:
            return self._ray.get(ref)
        while not self._ray.wait([ref], timeout=self.recovery.check_every_s)[0]:
            self.loop.run_until_complete(self.recovery.check())
        return self._ray.get(ref)

    def resume(self, resync=None) -> int:
        """Continue from the latest checkpoint, if any (progress.py); returns the last completed step.
        `resync(version)` gives the engines the loaded weights (default: `sync_weights`; colocate on GPU
        nodes has its own); the engines the run's scale-outs had added are asked for again."""
        step, added = self.progress.resume(resync or self.sync_weights)
        if added > 0:
            self.elastic.restore(added, request_id=f"resume-{step}")
        self.tracker.resume_from(step)
        return step

    def _engines_added(self) -> int:
        return self.elastic.started_by_scale() if self.elastic is not None else 0

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.tracker.log(step, metrics)
        if self.notifier is not None:
            self.notifier.step(step, self.recipe.train.steps, metrics)

    # ------------------------------------------------------------ shutdown
    def close(self) -> None:
        if self.trainer_watch is not None:
            self.trainer_watch.close()
        if self.api is not None:
            self.api.stop()
        if self.elastic is not None:
            self.elastic.close()
        if self.services is not None:
            self.services.stop(self._ray)
        if self.bus is None and self._bus_start is not None:  # a set-up that failed before it was taken
            try:
                self.bus = self._bus_start.result(timeout=120)
            except Exception as exc:
                log.warning("TransferQueue did not start: %s", exc)
        if self.bus is not None:
            self.bus.close()
        end_actors(self._ray, self.trainers, "trainers", method="close")
        if self.engines is not None:
            self.engines.stop()
        if getattr(self, "judges", None) is not None:
            self.judges.stop()
        if self.slots is not None:  # its placement groups, once the actors in them have ended
            self.slots.release()
        if self.rollout_manager is not None:
            self.rollout_manager.close(self.loop)
        if self.reward_hub is not None:
            self.reward_hub.close()
        if self._media is not None:
            self._media.close()
        if self.tracker is not None:
            self.tracker.close()
        self.loop.close()


def timed(fn, *args) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def _in_thread(fn, *args) -> Future:
    """`fn(*args)` in a daemon thread of its own; its result (or error) in the returned future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to whoever reads the result
            future.set_exception(exc)

    threading.Thread(target=run, name=f"job-{getattr(fn, '__name__', 'load')}", daemon=True).start()
    return future
