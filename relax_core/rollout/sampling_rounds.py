"""One step's rollout batch, in one or more generation rounds: DAPO's overlong shaping and dynamic sampling.

`rollout_step` (called by `Job.rollout` in colocate and by the rollout service
of the asynchronous modes) calls `collect_batch` with a function that generates and scores
one round of `rollout.prompts_per_step` prompts. For most algorithms that is
the whole batch. For DAPO (algorithms/dapo.py holds the formulas):

- overlong shaping: each sample's reward gets `penalty_factor * penalty(L)`
  (0 up to `L_max - L_cache`, a ramp to -1 at `L_max`), L_max =
  `rollout.max_new_tokens`;
- dynamic sampling: groups whose (shaped) rewards are all equal carry no
  learning signal and are dropped; more rounds are generated until the batch
  holds `prompts_per_step` groups, at most `max_num_gen_batches` rounds. The
  batch is then cut to exactly that many groups. If the last round ends with
  fewer, the step trains on what it has, and if no group at all survived it
  trains on the last round unfiltered (zero advantages, a no-op update)
  rather than on an empty batch.

The filter looks at the shaped reward: a length difference alone is a signal.
Plain Python over `Sample`s, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from relax_core.algorithms.dapo import dynamic_sampling_keep, penalty_for_length
from relax_core.data.sample import Sample, group_order


@dataclass
class RoundStats:
    """What the rounds of one step did (for logs and metrics)."""

    rounds: int = 0
    groups_generated: int = 0
    groups_kept: int = 0
    overlong_penalised: int = 0

    def as_metrics(self) -> dict[str, float]:
        return {"gen_rounds": float(self.rounds), "groups_generated": float(self.groups_generated),
                "groups_kept": float(self.groups_kept), "overlong_penalised": float(self.overlong_penalised)}


def shape_overlong(samples: list[Sample], max_len: int, cache_len: int, factor: float) -> int:
    """Add the soft overlong penalty to each sample's reward; returns how many were penalised."""
    hit = 0
    for s in samples:
        penalty = factor * penalty_for_length(s.response_len, max_len, cache_len)
        if penalty:
            s.reward += penalty
            hit += 1
    return hit


def informative_groups(samples: list[Sample]) -> list[list[Sample]]:
    """The groups whose rewards are not all equal."""
    keep = dynamic_sampling_keep([s.reward for s in samples], [s.group_id for s in samples])
    return group_order([s for s, k in zip(samples, keep) if k])


def collect_batch(generate_round: Callable[[int], list[Sample]], algorithm, *, max_new_tokens: int,
                  target_groups: int) -> tuple[list[Sample], RoundStats]:
    """The step's samples: `generate_round(r)` for r = 0, 1, ... as the algorithm's sampling asks."""
    stats = RoundStats()
    overlong = getattr(algorithm, "overlong", None)
    dynamic = getattr(algorithm, "dynamic_sampling", None)
    filtering = dynamic is not None and dynamic.enabled
    rounds = dynamic.max_num_gen_batches if filtering else 1
    kept: list[list[Sample]] = []
    last: list[Sample] = []
    for r in range(rounds):
        last = generate_round(r)
        stats.rounds += 1
        stats.groups_generated += len(group_order(last))
        if overlong is not None and overlong.enabled and overlong.cache_len(max_new_tokens) > 0:
            stats.overlong_penalised += shape_overlong(last, max_new_tokens, overlong.cache_len(max_new_tokens),
                                                       overlong.penalty_factor)
        if not filtering:
            return last, stats
        kept += informative_groups(last)
        if len(kept) >= target_groups:
            break
    kept = kept[:target_groups]
    stats.groups_kept = len(kept)
    if not kept:
        return last, stats
    return [s for group in kept for s in group], stats


class Preempted(Exception):
    """The step in progress was abandoned because the run was told to stop."""


ROUND_KEY_STRIDE = 10_000_000  # > any step count, so (step, round) keys never collide


def rollout_step(step: int, recipe, prompts, manager, loop, stopping: Callable[[], bool],
                 on_group: Callable[[list[Sample]], None] | None = None) -> list[Sample]:
    """The step's scored samples from `prompts` through `manager` (on the caller's event `loop`).

    `on_group(samples)`: called with each prompt group of the step's batch. With one round per step (no
    dynamic sampling) as soon as the group is generated, scored and shaped, while the others still
    generate; with DAPO's dynamic sampling once the rounds decided which groups the batch keeps.
    `stopping()` true: the run is stopping, so generation aborted by the engines (controller/preemption.py)
    or a round not yet started raise `Preempted`: the step's samples are dropped.
    """
    from relax_core.rollout.client import EngineError, GenerationAborted

    ro, algo = recipe.rollout, recipe.algorithm
    dynamic = getattr(algo, "dynamic_sampling", None)
    streams = on_group is not None and not (dynamic is not None and dynamic.enabled)
    overlong = getattr(algo, "overlong", None)
    cache_len = overlong.cache_len(ro.max_new_tokens) if overlong is not None and overlong.enabled else 0

    stats = RoundStats(rounds=1)

    async def shaped(group: list[Sample]) -> None:  # what collect_batch does to a round, for one group
        stats.groups_generated += 1
        if cache_len > 0:
            stats.overlong_penalised += shape_overlong(group, ro.max_new_tokens, cache_len, overlong.penalty_factor)
        on_group(group)

    def one_round(round_index: int) -> list[Sample]:
        # Round r > 0 of a step samples with its own seeds and group ids (the manager derives both from this key).
        if stopping():
            raise Preempted(f"step {step} not rolled out: the run is stopping")
        rows = prompts.next_batch(ro.prompts_per_step)
        return loop.run_until_complete(manager.generate(rows, step + round_index * ROUND_KEY_STRIDE,
                                                        shaped if streams else None))

    try:
        if streams:
            samples = one_round(0)
        else:
            samples, stats = collect_batch(one_round, algo, max_new_tokens=ro.max_new_tokens,
                                           target_groups=ro.prompts_per_step)
            for group in group_order(samples) if on_group is not None else []:
                on_group(group)
    except (GenerationAborted, EngineError) as exc:
        if stopping():
            raise Preempted(f"the rollout of step {step} was aborted: the run is stopping") from exc
        raise
    if dynamic is not None:  # DAPO: log what the rounds did
        manager.last_reward_stats = manager.last_reward_stats | stats.as_metrics()
    return samples
