"""A running job: its trainer ranks, engines, rollout manager, data and metrics.

`Job` owns every process the run started (Ray actors and the engine
servers they launch) and stops them on `close()`. The training loops
(`colocate.py`) call its verbs: `rollout`, `train`, `sync_weights`,
`checkpoint`, `resume`, `log`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

from relax_core.cluster.node import ROLLOUT_RESOURCE, TRAIN_RESOURCE
from relax_core.config.schema import FileData, Recipe, rollout_group_name
from relax_core.controller import setup
from relax_core.controller.workers import EngineWorker, TrainerWorker
from relax_core.launch.rundir import RunDir
from relax_core.rollout.types import Sample

log = logging.getLogger(__name__)
ENGINE_KEY = "engine_api_key"
ROUND_KEY_STRIDE = 10_000_000  # > any step count, so (step, round) keys never collide


class Job:
    def __init__(self, recipe: Recipe, run: RunDir, console=None, stop: threading.Event | None = None):
        import ray
        from transformers import AutoTokenizer

        from relax_core.data.prompts import build_prompt_source
        from relax_core.metrics.tracker import MetricsTracker

        self.recipe, self.run = recipe, run
        self.stop = stop or threading.Event()  # set on preemption: checkpoint and end the loop
        self.loop = asyncio.new_event_loop()
        self.model_dir = setup.prepare_model_dir(recipe, run)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.prompts = build_prompt_source(recipe.data)
        self.ckpt_dir = recipe.checkpoint.dir or str(run.checkpoints)
        self.policy_version = 0
        self.engines: list = []
        self.trainers: list = []
        self._ray = ray
        engines_ready = self._start_engines()
        trainers_ready = self._start_trainers()
        self.engine_urls = ray.get(engines_ready)  # engines and trainers load their models in parallel
        ray.get(trainers_ready)
        log.info("engines ready: %s", ", ".join(self.engine_urls))
        self._connect()
        self.tracker = MetricsTracker(run.metrics, run.tensorboard if recipe.logging.tensorboard else None,
                                      recipe.train.steps, console)

    # ------------------------------------------------------------ start-up
    def _threads(self, group: str) -> int:
        """Torch threads per process: a node's cores split between the processes it hosts.

        Oversubscribed CPU threads make torch an order of magnitude slower, and
        in colocate mode the processes take turns anyway.
        """
        cluster, nodes = self.recipe.cluster, getattr(self.recipe.cluster, group)
        per_node = {"train": -(-self.recipe.train_ranks // cluster.train.nodes), "rollout": 0}
        engine_group = "rollout" if cluster.rollout.nodes else "train"
        per_node[engine_group] += -(-self.recipe.rollout.num_engines // getattr(cluster, engine_group).nodes)
        cores = min(nodes.cpus_per_node, os.cpu_count() or 1)
        return max(1, cores // max(per_node[group], 1))

    def _start_engines(self) -> list:
        ro = self.recipe.rollout
        self.run.write_secret(ENGINE_KEY)
        key = self.run.secret(ENGINE_KEY)
        slot = {ROLLOUT_RESOURCE: max(ro.gpus_per_engine, 1)}
        actor = self._ray.remote(num_cpus=0, num_gpus=ro.gpus_per_engine, resources=slot)(EngineWorker)
        self.engines = [
            actor.remote(i, str(self.model_dir), str(self.run.logs / f"engine-{i}.log"), key,
                         self._threads(rollout_group_name(self.recipe)), self.recipe.train.seed,
                         ro.max_concurrency)
            for i in range(ro.num_engines)
        ]
        return [e.wait_ready.remote() for e in self.engines]

    def _start_trainers(self) -> list:
        world = self.recipe.train_ranks
        gpus = 1 if self.recipe.cluster.train.gpus_per_node else 0
        actor = self._ray.remote(num_cpus=0, num_gpus=gpus, resources={TRAIN_RESOURCE: 1})(TrainerWorker)
        self.trainers = [actor.remote(r, world) for r in range(world)]
        master = self._ray.get(self.trainers[0].rendezvous_address.remote())
        config = setup.trainer_config(self.recipe)
        return [t.setup.remote(master, str(self.model_dir), config, self._threads("train")) for t in self.trainers]

    def _connect(self) -> None:
        from relax_core.rewards.hub import RewardHub
        from relax_core.rollout.client import EngineClient
        from relax_core.rollout.manager import RolloutManager

        key = self.run.secret(ENGINE_KEY)
        bucket = int(self.recipe.train.weight_sync_bucket_mb * 2**20)
        self._ray.get(self.trainers[0].connect_engines.remote(self.engine_urls, key, bucket))
        clients = [EngineClient(url, api_key=key) for url in self.engine_urls]
        system = self.recipe.data.system_prompt if isinstance(self.recipe.data, FileData) else None
        self.reward_hub = RewardHub.from_config(self.recipe.reward)
        self.rollout_manager = RolloutManager(clients, self.tokenizer, setup.sampling_config(self.recipe),
                                              self.reward_hub, system)

    # --------------------------------------------------------------- verbs
    def rollout(self, step: int) -> list[Sample]:
        """The step's scored samples: one generation round, or DAPO's rounds (controller/sampling_rounds.py)."""
        from relax_core.controller.sampling_rounds import collect_batch

        ro, algo = self.recipe.rollout, self.recipe.algorithm
        samples, stats = collect_batch(lambda r: self._generate_round(step, r), algo,
                                       max_new_tokens=ro.max_new_tokens, target_groups=ro.prompts_per_step)
        if getattr(algo, "dynamic_sampling", None) is not None:  # DAPO: log what the rounds did
            self.rollout_manager.last_reward_stats = self.rollout_manager.last_reward_stats | stats.as_metrics()
        return samples

    def _generate_round(self, step: int, round_index: int) -> list[Sample]:
        # Round r > 0 of a step samples with its own seeds and group ids (the manager derives both from this key).
        key = step + round_index * ROUND_KEY_STRIDE
        rows = self.prompts.next_batch(self.recipe.rollout.prompts_per_step)
        return self.loop.run_until_complete(self.rollout_manager.generate(rows, key))

    def train(self, samples: list[Sample]) -> dict[str, float]:
        world = len(self.trainers)
        shards = [samples[r * len(samples) // world:(r + 1) * len(samples) // world] for r in range(world)]
        results = self._ray.get([t.train_step.remote(s) for t, s in zip(self.trainers, shards)])
        return results[0]

    def sync_weights(self, version: int) -> dict[str, float]:
        stats = self._ray.get(self.trainers[0].sync_weights.remote(version))
        self.policy_version = version
        return stats

    def checkpoint(self, step: int) -> None:
        progress = {"step": step, "data": self.prompts.state_dict(), "policy_version": self.policy_version}
        keep = self.recipe.checkpoint.keep_last
        self._ray.get([t.save_checkpoint.remote(self.ckpt_dir, step, progress, keep) for t in self.trainers])
        self.run.update_state(checkpoint_step=step)

    def resume(self) -> int:
        """Continue from the latest checkpoint, if any; returns the last completed step."""
        from relax_core.checkpoint import find_latest

        if not self.recipe.checkpoint.resume or find_latest(self.ckpt_dir) is None:
            return 0
        progress = self._ray.get([t.load_checkpoint.remote(self.ckpt_dir) for t in self.trainers])[0]
        self.prompts.load_state_dict(progress["data"])
        self.sync_weights(int(progress["policy_version"]))
        log.info("resumed from %s at step %d", self.ckpt_dir, progress["step"])
        return int(progress["step"])

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.tracker.log(step, metrics)

    # ------------------------------------------------------------ shutdown
    def close(self) -> None:
        for method, actors in (("close", self.trainers), ("stop", self.engines)):
            refs = [getattr(a, method).remote() for a in actors]
            try:
                self._ray.get(refs, timeout=30)
            except Exception as exc:  # shutting down: report and go on stopping the rest
                log.warning("%s of %d actors failed: %s", method, len(actors), exc)
        if hasattr(self, "rollout_manager"):
            for client in self.rollout_manager.clients:
                self.loop.run_until_complete(client.aclose())
        if hasattr(self, "reward_hub"):
            self.reward_hub.close()
        if hasattr(self, "tracker"):
            self.tracker.close()
        self.loop.close()


def timed(fn, *args) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start
