"""`fully_async` and `hybrid` modes: rollout and training at the same time, joined by TransferQueue.

    rollout thread (producer.py)                     training loop (here)
    ----------------------------                     --------------------
    step s: wait for version >= s-1-max_staleness    step s: take partition s from the bus
            newest weights -> engines                        train on it (rank 0 snapshots version s)
            generate, score -> bus partition s               publish version s; clear partition s
            [fully_async] advantage stage adds               log, checkpoint
            `advantages` to the partition
    told to stop (job.stop)? the rollout thread's generation is aborted and dropped; the trainer
    checkpoints the last step it trained, with the prompt cursor as of that step, and returns "stopped"

The two modes differ in where the step's advantages are computed: in
`fully_async` an advantage stage on the rollout side reads the partition's
rewards and group ids from the bus and writes the advantages back (for the
outcome estimators, which need nothing else; the others fall back to the
trainer); in `hybrid` the actor computes them in its own process, as it
does the reference log-probs in both modes. Truncated importance sampling
corrects for the samples' age by default in both (algorithm.tis_cap).
"""

from __future__ import annotations

import logging
import time
from statistics import fmean

from relax_core.controller.job import Job, timed
from relax_core.controller.preemption import Preempted
from relax_core.controller.producer import RolloutProducer, StepRecord, VersionGate
from relax_core.rollout.types import Sample

log = logging.getLogger(__name__)
TAKE_TIMEOUT_S = 3600.0  # one step's rollout; a dead producer is noticed at once, not after this


def train_fully_async(job: Job) -> str:
    return train_streaming(job, advantage_stage(job.recipe))


def train_hybrid(job: Job) -> str:
    return train_streaming(job, None)


def train_streaming(job: Job, advantages) -> str:
    from relax_core.data.bus import SampleBus

    total, staleness = job.recipe.train.steps, job.recipe.rollout.max_staleness
    start = job.resume()
    bus = SampleBus.start(job.recipe.samples_per_step, max_partitions=staleness + 2)
    gate = VersionGate(start)
    producer = RolloutProducer(job, bus, gate, start + 1, total, advantages)
    producer.start()
    fields = ("advantages",) if advantages is not None else ()
    last_end = time.perf_counter()
    try:
        for step in range(start + 1, total + 1):
            try:
                (record, (samples, extra)), wait_s = timed(_take, producer, bus, step, fields)
            except Preempted:
                return job.stop_here()
            depth = bus.depth()
            train_metrics, train_s = timed(job.train, samples, extra.get("advantages"), step)
            gate.publish(step)
            job.policy_version = step
            bus.clear(step)
            now = time.perf_counter()
            job.log(step, stream_metrics(samples, record, step, wait_s, train_s, now - last_end, depth)
                    | record.reward_stats | record.engine_stats | train_metrics)
            last_end = now
            job.step_done(step, record.data_state)  # the cursor as of this step, not the producer's now
            if step % job.recipe.checkpoint.interval == 0 or step == total:
                job.checkpoint(step, record.data_state)
            if job.stop.is_set() and step < total:
                return job.stop_here()
        return "completed"
    finally:
        producer.stop()
        bus.close()


def _take(producer: RolloutProducer, bus, step: int, fields) -> tuple[StepRecord, tuple[list[Sample], dict]]:
    record = producer.record(step, TAKE_TIMEOUT_S)
    return record, bus.take(step, record.count, fields)


def stream_metrics(samples: list[Sample], record: StepRecord, step: int, wait_s: float, train_s: float,
                   step_s: float, depth: int) -> dict[str, float]:
    staleness = [step - 1 - s.policy_version for s in samples]
    lengths = [s.response_len for s in samples]
    return {
        "reward_mean": fmean(s.reward for s in samples) if samples else 0.0,
        "response_len_mean": fmean(lengths) if lengths else 0.0,
        "truncated_frac": fmean(s.finish_reason == "length" for s in samples) if samples else 0.0,
        "samples": float(len(samples)),
        "rollout_s": record.generate_s,
        "train_s": train_s,
        "sync_s": record.sync_s,
        "step_s": step_s,
        "policy_version": step,
        "staleness_min": float(min(staleness, default=0)),
        "staleness_mean": fmean(staleness) if staleness else 0.0,
        "staleness_max": float(max(staleness, default=0)),
        "queue_depth": float(depth),
        "trainer_idle_s": wait_s,
        "rollout_idle_s": record.idle_s,
        "samples_per_s": len(samples) / max(step_s, 1e-9),
        "tokens_per_s": sum(lengths) / max(step_s, 1e-9),
    }


def advantage_stage(recipe):
    """The rollout-side advantage function of `fully_async` where the algorithm's spec declares its
    advantages `outcome_only` (rewards and group ids suffice); None where the trainer computes them."""
    algo = recipe.algorithm
    spec = algo.spec
    if not spec.outcome_only:
        return None
    import torch

    from relax_core.algorithms.estimators import AdvantageBatch
    from relax_core.algorithms.registry import get_estimator
    from relax_core.train.step_advantages import dense_ids

    estimator, kwargs = get_estimator(spec.advantage_estimator), algo.estimator_kwargs()

    def compute(samples: list[Sample]) -> list[float]:
        batch = AdvantageBatch(rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
                               group_ids=dense_ids([s.group_id for s in samples]),
                               mask=torch.ones((len(samples), 1)))
        return estimator(batch, **kwargs).advantages[:, 0].tolist()

    return compute
