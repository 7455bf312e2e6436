"""Colocate mode: rollout and training take turns on the same devices; strictly on-policy.

    for each step:
        samples  = rollout with the current weights (version k-1)
        metrics  = one training step on them
        weights  -> every engine, now version k
        engines added or removed since the last step? apply (engines.py)
        log; checkpoint every `checkpoint.interval` steps and at the end
    told to stop (job.stop, controller/preemption.py)? a rollout in progress is aborted and dropped,
    a training step in progress finishes; checkpoint the last completed step and return "stopped"
"""

from __future__ import annotations

from statistics import fmean

from relax_core.controller.job import Job, timed
from relax_core.controller.preemption import Preempted
from relax_core.rollout.types import Sample


def train_colocate(job: Job) -> str:
    total = job.recipe.train.steps
    start = job.resume()
    for step in range(start + 1, total + 1):
        engine_stats = job.engines.apply_pending(job.loop, job.set_endpoints)  # between steps: engines idle
        try:
            samples, rollout_s = timed(job.rollout, step)
        except Preempted:
            return job.stop_here()
        train_metrics, train_s = timed(job.train, samples)
        sync_stats, sync_s = timed(job.sync_weights, step)
        job.log(step, step_metrics(samples, rollout_s, train_s, sync_s, job.policy_version)
                | job.rollout_manager.last_reward_stats | engine_stats | train_metrics | sync_stats)
        job.step_done(step)
        if step % job.recipe.checkpoint.interval == 0 or step == total:
            job.checkpoint(step)
        if job.stop.is_set() and step < total:
            return job.stop_here()
    return "completed"


def step_metrics(samples: list[Sample], rollout_s: float, train_s: float, sync_s: float, version: int) -> dict:
    lengths = [s.response_len for s in samples]
    rewards = [s.reward for s in samples]
    staleness = [version - 1 - s.policy_version for s in samples]
    return {
        "reward_mean": fmean(rewards) if rewards else 0.0,
        "response_len_mean": fmean(lengths) if lengths else 0.0,
        "truncated_frac": fmean(s.finish_reason == "length" for s in samples) if samples else 0.0,
        "tokens_per_s": sum(lengths) / max(rollout_s, 1e-9),
        "samples": len(samples),
        "rollout_s": rollout_s,
        "train_s": train_s,
        "sync_s": sync_s,
        "step_s": rollout_s + train_s + sync_s,
        "samples_per_s": len(samples) / max(rollout_s + train_s + sync_s, 1e-9),
        "policy_version": version,
        "staleness_max": max(staleness, default=0),
    }
