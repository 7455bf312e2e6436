"""Colocate mode: rollout and training take turns on the same devices; strictly on-policy.

    for each step:
        samples  = rollout with the current weights (version k-1)
        metrics  = one training step on them
        weights  -> every engine, now version k
        scale operations waiting for a safe point? apply them (elastic.py)
        log; checkpoint every `checkpoint.interval` steps and at the end
    told to stop (job.stop, controller/preemption.py)? a rollout in progress is aborted and dropped,
    a training step in progress finishes; checkpoint the last completed step and return "stopped"

On shared GPUs (colocate on GPU nodes without a rollout group, `engines_share_train_gpus`)
the engines and the trainer ranks take turns with the GPU memory, and the
weights move by reference (CUDA IPC, relax_core/weights/ipc.py: NCCL cannot
broadcast between two ranks on one device), in the order verl and slime use:

    engines release all (weights, kv_cache, cuda_graph) -> trainer ranks reload -> train ->
    ranks offload gradients, optimizer, critic and reference -> engines resume weights ->
    hand the new weights over -> ranks offload the policy, empty the cache -> engines resume kv_cache, cuda_graph

At start the ranks load and offload before the engines start (job.py), so
each engine sizes its KV cache from the same free memory on each of its GPUs.

Elsewhere (CPU engines, or engines on a rollout group of their own) the
engines keep their memory and the weights are broadcast (weights/sync.py).
"""

from __future__ import annotations

from functools import partial
from statistics import fmean

from relax_core.cluster.placement import engines_share_train_gpus
from relax_core.controller.job import Job, timed
from relax_core.data.sample import Sample, length_stats
from relax_core.rollout.sampling_rounds import Preempted

# SGLang's memory tags: what an engine frees while the trainer trains, and the two halves it resumes in.
WEIGHT_TAGS, CACHE_TAGS = ["weights"], ["kv_cache", "cuda_graph"]


def train_colocate(job: Job) -> str:
    total = job.recipe.train.steps
    start = job.resume(partial(resync, job) if engines_share_train_gpus(job.recipe) else None)
    for step in range(start + 1, total + 1):
        engine_stats = job.elastic.apply(job.loop, job.set_endpoints)  # between steps: engines idle
        try:
            samples, rollout_s = timed(job.rollout, step)
        except Preempted:
            return job.progress.stop_here()
        check_distinct(step, samples)
        train_metrics, train_s = timed(train_step, job, samples)
        sync_stats, sync_s = timed(sync_weights, job, step)
        job.log(step, step_metrics(samples, rollout_s, train_s, sync_s, job.policy_version)
                | job.rollout_manager.last_reward_stats | engine_stats | train_metrics | sync_stats)
        job.progress.step_done(step)
        if step % job.recipe.checkpoint.interval == 0 or step == total:
            job.progress.checkpoint(step)
        if job.stop.is_set() and step < total:
            return job.progress.stop_here()
    return "completed"


def check_distinct(step: int, samples: list[Sample]) -> None:
    """No sample is trained on twice: a request sent again after its engine failed (recovery.py) must
    have replaced its first answer, not joined it."""
    ids = [s.sample_id for s in samples]
    if len(set(ids)) != len(ids):
        raise RuntimeError(f"step {step}: {len(ids)} samples but {len(set(ids))} distinct sample ids: a sample "
                           "would be trained on twice")


def train_step(job: Job, samples: list[Sample]) -> dict[str, float]:
    """One training step; on shared GPUs the engines' memory released and the ranks' state reloaded for it."""
    if engines_share_train_gpus(job.recipe):
        job.engines.release_memory(job.loop)
        job.wake_trainers()
    return job.train(samples)


def sync_weights(job: Job, step: int) -> dict[str, float]:
    """The new weights into every engine; on shared GPUs the ranks keep only the policy while the engines
    resume their weights and take it over, then hand the rest of the GPU back before the cache resumes."""
    if not engines_share_train_gpus(job.recipe):
        return job.sync_weights(step)
    job.sleep_trainers(["optimizer"])
    job.engines.resume_memory(job.loop, WEIGHT_TAGS)
    stats = job.sync_weights(step)
    job.sleep_trainers(["model"])
    job.engines.resume_memory(job.loop, CACHE_TAGS)
    return stats


def resync(job: Job, version: int) -> None:
    """On shared GPUs, a resumed run's weights into the engines, which hold their memory then and the ranks
    none: the same turns as after a step."""
    job.engines.release_memory(job.loop)
    job.wake_trainers()
    sync_weights(job, version)


def step_metrics(samples: list[Sample], rollout_s: float, train_s: float, sync_s: float, version: int) -> dict:
    lengths = [s.response_len for s in samples]
    rewards = [s.reward for s in samples]
    staleness = [version - 1 - s.policy_version for s in samples]
    return {
        "reward_mean": fmean(rewards) if rewards else 0.0,
        **length_stats(samples),
        "prompt_len_mean": fmean(len(s.prompt_ids) for s in samples) if samples else 0.0,
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
