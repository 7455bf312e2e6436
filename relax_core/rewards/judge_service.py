"""The LLM judge as a service of the run: the engines of `reward.genrm`, started and stopped by the job.

    job start-up: JudgeService.start(ray, recipe, run, threads, cpus, slots)     returns at once
                    -> reward.genrm.num_engines EngineWorker actors, each serving reward.genrm.model behind
                       the run's bearer key `judge_api_key`: with SGLang engines, SGLang servers of
                       rollout.gpus_per_engine GPUs in the last engine slots of the engines' group
                       (placement.judge_slots, their placement-group bundles: controller/gpu_slots.py);
                       with CPU engines, CPU engines in one `relax_judge` slot each (the engines' node group
                       advertises them beside its engine slots, cluster/node.py)
                  ... the policy engines and the trainers load their models meanwhile ...
                  service.endpoints()   waits until every judge engine is healthy
                    -> JudgeEndpoints(urls, api_key): plain data, for whichever process runs the hub
                  RewardHub.from_config(recipe.reward, judge=endpoints)   the hub's `genrm` (genrm.py)
    job close:    service.stop()   each server stopped by its PID (EngineWorker.stop), its actor killed

The judge engines are the rollout's kind of engine (rollout/engine_command.py's
`judge_engines`) without a weight group: the judge is frozen. They serve greedy `/generate` calls,
`rollout.max_concurrency` at a time each. Without a `reward.genrm` section the
service has no engines and `endpoints()` is None.
"""

from __future__ import annotations

import logging

from relax_core.cluster.placement import JUDGE_RESOURCE
from relax_core.rewards.genrm import JudgeEndpoints

log = logging.getLogger(__name__)
JUDGE_KEY = "judge_api_key"
READY_TIMEOUT_S = 360.0  # the cpu engine's own limit (config/engines.py) plus time to be placed


class JudgeService:
    """The judge engine actors of one run."""

    def __init__(self, ray, api_key: str | None = None):
        self._ray, self.api_key = ray, api_key
        self.actors: list = []
        self._ready: list = []  # refs resolving to each engine's URL once it is healthy
        self._endpoints: JudgeEndpoints | None = None

    @classmethod
    def start(cls, ray, recipe, run, threads: int, cpus: list[int] | None = None, slots=None) -> JudgeService:
        """Start the judge engines of `recipe.reward.genrm` (none without it); does not wait for them.

        Args:
            threads: torch threads of each judge engine (CPU engines).
            cpus: cores to pin CPU judge engines to (the engines' group on the local executor), None: no pinning.
            slots: the run's `GpuSlots`, whose engine-slot bundles GPU judge engines take.
        """
        section = recipe.reward.genrm
        if section is None:
            return cls(ray)
        from relax_core.models.model_dir import resolve_model_path

        run.write_secret(JUDGE_KEY)
        service = cls(ray, run.secret(JUDGE_KEY))
        model = str(resolve_model_path(section.model))
        from relax_core.cluster.placement import judge_slots

        on_gpus = judge_slots(recipe)
        try:
            for index in range(section.num_engines):
                options = slots.engine_options(on_gpus[index])[0] if on_gpus else \
                    {"num_cpus": 0, "resources": {JUDGE_RESOURCE: 1}}
                service._spawn(index, model, str(run.logs / f"judge-{index}.log"), threads,
                               None if on_gpus else cpus, recipe, options)
        except BaseException:
            service.stop()
            raise
        return service

    def _spawn(self, index: int, model: str, log_path: str, threads: int, cpus: list[int] | None, recipe,
               options: dict) -> None:
        from relax_core.rollout.engine_command import judge_engines
        from relax_core.rollout.engine_worker import EngineWorker

        actor = self._ray.remote(**options)(EngineWorker).remote(
            index, judge_engines(recipe, model, threads), log_path, self.api_key, cpus)
        self.actors.append(actor)
        self._ready.append(actor.wait_ready.remote())

    def endpoints(self, timeout_s: float = READY_TIMEOUT_S) -> JudgeEndpoints | None:
        """Where the judge engines serve, once every one is healthy (None: the run has none).

        Raises:
            RuntimeError: an engine failed to start (its log's tail), or was not placed in time.
        """
        if not self._ready or self._endpoints is not None:
            return self._endpoints
        _, pending = self._ray.wait(self._ready, num_returns=len(self._ready), timeout=timeout_s)
        if pending:
            raise RuntimeError(f"{len(pending)} of {len(self._ready)} judge engines (reward.genrm) not healthy "
                               f"after {timeout_s:.0f} s; free '{JUDGE_RESOURCE}' slots: "
                               f"{self._ray.available_resources().get(JUDGE_RESOURCE, 0):g}")
        urls = tuple(self._ray.get(self._ready))
        log.info("judge engines ready: %s", ", ".join(urls))
        self._endpoints = JudgeEndpoints(urls, self.api_key)
        return self._endpoints

    def stop(self) -> None:
        """Stop every judge engine server by its PID, then end its actor (idempotent)."""
        from relax_core.cluster.actors import end_actors

        actors, self.actors, self._ready = self.actors, [], []
        end_actors(self._ray, actors, "judge engines")
