"""The reward hub: scores a whole step's responses concurrently; one failure costs one sample.

    RolloutManager --(response, label, metadata, reward) x N--> RewardHub.score
        route:  the item's `reward` (the row's `data.reward_key` column) or the recipe's reward.name;
                `genrm` with a `judge`: the judge engines Relax started (genrm.py, judge_service.py)
        call:   async reward  -> awaited on the event loop, with the time limit
                cheap reward  -> in-process (registered with in_process=True)
                other sync    -> WorkerPool (cluster/worker_pool.py): a worker process, killed past the limit
        select: a float, or the dict entry named by reward.key (default "score")
        --> one RewardResult per response (score 0 on error/timeout) + step stats

Failures are counted per call (`reward_errors`, `reward_timeouts` in
`last_stats`) and logged once per (reward, kind of failure), so a broken
reward shows in the step metrics without flooding the log. Too many failures
over a window of samples end the run (failures.py: `reward.max_error_frac`,
`reward.error_window`), naming the reward and its first error.
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from relax_core.cluster.worker_pool import Outcome, WorkerPool, default_workers
from relax_core.errors import UserError
from relax_core.rewards import registry
from relax_core.rewards.failures import FailureWindow, describe_error
from relax_core.rewards.genrm import Judge, JudgeEndpoints, as_reward
from relax_core.rollout.scoring import RewardItem, empty_stats

log = logging.getLogger(__name__)


@dataclass
class RewardResult:
    """The score of one response: `status` is "ok", "error" or "timeout" (score 0 then)."""

    score: float
    reward: str
    scores: dict[str, float] = field(default_factory=dict)
    status: str = "ok"
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"score": self.score, "reward": self.reward}
        if self.scores:
            out["scores"] = self.scores
        if self.error is not None:
            out["error"] = self.error
            out["status"] = self.status
        return out


class RewardHub:
    """Scores responses with registered rewards (built-ins and plugins).

    Args:
        name: the default reward (the recipe's `reward.name`).
        key: which entry of a dict-valued reward to train on (default "score",
            or the only entry).
        plugin_dirs: extra plugin folders (`reward.plugin_dirs`); imported now,
            so a broken plugin raises `RewardPluginError` before any work.
        timeout_s: time limit of one call (`reward.timeout_s`).
        num_workers: worker processes for sync rewards (default: CPUs, at most 16);
            started on the first call that needs them.
        in_process: call every sync reward in this process (no pool, no time
            limit for sync rewards): for debugging and the benchmark baseline.
        max_error_frac, error_window: more than `max_error_frac * error_window`
            failures among the last `error_window` samples raise
            `RewardFailureError` (failures.py); 1.0 (the default here, for
            `relax reward score`) never does.
        judge: the `genrm` reward of this hub (a `genrm.Judge` on the engines of
            `reward.genrm`); None: the registered `genrm` (a judge at $RELAX_GENRM_URL).
    """

    def __init__(self, name: str = "exact_match", *, key: str | None = None,
                 plugin_dirs: list[str] | tuple[str, ...] = (), timeout_s: float = 10.0,
                 num_workers: int | None = None, in_process: bool = False,
                 max_error_frac: float = 1.0, error_window: int = 256, judge: Judge | None = None):
        self.default, self.key, self.timeout_s = name, key, timeout_s
        self.plugin_dirs = [str(d) for d in plugin_dirs]
        self.num_workers, self.in_process = num_workers or default_workers(), in_process
        self._specs: dict[str, registry.RewardSpec] = {}
        self._pool: WorkerPool | None = None
        self._logged: set[tuple[str, str, str]] = set()
        self.last_stats: dict[str, float] = empty_stats()
        self.total_errors = self.total_timeouts = 0
        self.failures = FailureWindow(max_error_frac, error_window)
        names = registry.list_rewards(self.plugin_dirs)
        if judge is not None:  # this hub's own `genrm`, whatever the registry holds
            self._specs["genrm"] = registry.RewardSpec("genrm", as_reward(judge), source="reward.genrm")
        if name not in names:
            raise UserError(f"reward.name: no reward called '{name}' (available: {', '.join(names)})")

    @classmethod
    def from_config(cls, config, num_workers: int | None = None, judge: JudgeEndpoints | None = None) -> RewardHub:
        """A hub for a recipe's `reward` section (`RewardConfig`).

        `judge`: where the judge engines of `reward.genrm` serve (`JudgeService.endpoints()`);
        required exactly when the section is set.
        """
        if (config.genrm is None) != (judge is None):
            given = "reward.genrm set, no judge endpoints" if judge is None else "judge endpoints, no reward.genrm"
            raise ValueError(f"RewardHub.from_config: reward.genrm and the judge endpoints go together ({given})")
        workers = num_workers or getattr(config, "num_workers", None)
        return cls(config.name, key=config.key, plugin_dirs=config.plugin_dirs, timeout_s=config.timeout_s,
                   num_workers=workers, max_error_frac=config.max_error_frac, error_window=config.error_window,
                   judge=Judge.serving(judge, config.genrm) if judge is not None else None)

    @classmethod
    def from_function(cls, fn: Callable, name: str | None = None, **kwargs) -> RewardHub:
        """A hub around one plain function, called in-process (the manager's legacy argument)."""
        name = name or getattr(fn, "__name__", "reward")
        hub = cls("exact_match", **kwargs)
        hub.default = name
        hub._specs[name] = registry.RewardSpec(name, fn, in_process=True, source="function")
        return hub

    # ------------------------------------------------------------- scoring
    async def score(self, items: list[RewardItem]) -> list[RewardResult]:
        """Score `items` concurrently; sets `last_stats` for this batch.

        Raises:
            RewardFailureError: the failure window (failures.py) holds too many failures.
        """
        start = time.perf_counter()
        results = list(await asyncio.gather(*(self._score_one(item) for item in items)))
        self.last_stats = batch_stats(results, time.perf_counter() - start)
        self.total_errors += int(self.last_stats["reward_errors"])
        self.total_timeouts += int(self.last_stats["reward_timeouts"])
        self.failures.add(results)
        return results

    def score_sync(self, items: list[RewardItem]) -> list[RewardResult]:
        """`score` for callers without an event loop (CLI, benchmark)."""
        return asyncio.run(self.score(items))

    async def _score_one(self, item: RewardItem) -> RewardResult:
        name = self.default if item.reward is None else str(item.reward)
        try:
            spec = self._spec(name)
        except KeyError as exc:  # a row routed to a reward that does not exist
            return self._failed(name, Outcome("error", error=str(exc.args[0])))
        outcome = await self._call(spec, item)
        if outcome.status != "ok":
            return self._failed(name, outcome)
        try:
            score, scores = select_score(outcome.value, self.key)
        except ValueError as exc:
            return self._failed(name, Outcome("error", error=f"ValueError: {exc}"))
        return RewardResult(score, name, scores)

    def _spec(self, name: str) -> registry.RewardSpec:
        if name not in self._specs:
            self._specs[name] = registry.get_spec(name, self.plugin_dirs)
        return self._specs[name]

    async def _call(self, spec: registry.RewardSpec, item: RewardItem) -> Outcome:
        args = (item.response, item.label, item.metadata if item.metadata is not None else {})
        try:
            if spec.is_async:
                return Outcome("ok", await asyncio.wait_for(spec.fn(*args), self.timeout_s))
            if spec.in_process or self.in_process:
                return Outcome("ok", spec.fn(*args))
            return await self._get_pool().call(spec.name, spec.fn.__module__, args, self.timeout_s)
        except TimeoutError:
            return Outcome("timeout", error=f"no result within {self.timeout_s:g} s")
        except Exception as exc:  # a reward bug costs one sample (until the failure window is full)
            return Outcome("error", error=describe_error(exc))

    def _get_pool(self) -> WorkerPool:
        if self._pool is None:
            self._pool = WorkerPool(self.num_workers, self.plugin_dirs, module="relax_core.rewards.worker")
        return self._pool

    def _failed(self, name: str, outcome: Outcome) -> RewardResult:
        kind = (outcome.error or "").split(":")[0]
        if (name, outcome.status, kind) not in self._logged:
            self._logged.add((name, outcome.status, kind))
            log.warning("reward '%s' %s (scored 0; further %s of this kind are only counted): %s",
                        name, "timed out" if outcome.status == "timeout" else "failed",
                        "timeouts" if outcome.status == "timeout" else "errors", outcome.error)
        return RewardResult(0.0, name, status=outcome.status, error=outcome.error)

    # ------------------------------------------------------------ lifetime
    def warm_up(self) -> None:
        """Start the worker processes now and wait until they are ready."""
        self._get_pool().warm_up()

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> RewardHub:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def select_score(value: Any, key: str | None) -> tuple[float, dict[str, float]]:
    """(the score to train on, all named scores) from a reward's return value."""
    if isinstance(value, dict):
        scores = {str(k): _finite(v, f"score '{k}'") for k, v in value.items()}
        chosen = key or ("score" if "score" in scores or len(scores) != 1 else next(iter(scores)))
        if chosen not in scores:
            raise ValueError(f"reward returned scores {sorted(scores)} without '{chosen}' (set reward.key)")
        return scores[chosen], scores
    return _finite(value, "score"), {}


def _finite(value: Any, what: str) -> float:
    if isinstance(value, str) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} is {type(value).__name__}; a reward returns a float or a dict of floats")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{what} is {number}")
    return number


def check_routes(names: set, column: str, plugin_dirs: list[str] | tuple[str, ...] = ()) -> None:
    """Refuse a data set whose reward column (`data.reward_key`) names a reward that does not exist.

    An empty (null) value routes its row to the recipe's `reward.name`.
    """
    known = set(registry.list_rewards(plugin_dirs))
    unknown = sorted(repr(name) for name in names if name is not None and name not in known)
    if unknown:
        shown = ", ".join(unknown[:10]) + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
        raise UserError(f"data.reward_key: column '{column}' names rewards that do not exist: {shown} "
                        f"(available: {', '.join(sorted(known))}; add a plug-in with reward.plugin_dirs)")


def batch_stats(results: list[RewardResult], seconds: float) -> dict[str, float]:
    """Failure counts, scoring time, and the mean of every named sub-score in the batch."""
    stats = {"reward_errors": sum(r.status == "error" for r in results),
             "reward_timeouts": sum(r.status == "timeout" for r in results), "reward_s": seconds}
    named: dict[str, list[float]] = {}
    for result in results:
        for name, value in result.scores.items():
            named.setdefault(name, []).append(value)
    stats |= {f"reward_{name}_mean": fmean(values) for name, values in sorted(named.items())}
    return stats
