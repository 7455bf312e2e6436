"""`fully_async` and `hybrid` modes: every role a service, samples streamed through TransferQueue.

    rollout service (services/rollout.py)            driver (here): metadata only
    -------------------------------------            ----------------------------
    step s: wait for version >= s-1-max_staleness    step s: record s from the rollout service
            newest weights -> engines                        wait for its downstream services
            generate, score -> TransferQueue s               claim the complete rows (metadata)
            ask the reference / advantage                    each trainer rank reads its shard from
            services to process s; record s                  TransferQueue and trains (rank 0 keeps
                                                             version s aside); publish s to the rollout;
                                                             free s
                                                             check: every sample once, staleness kept
    told to stop (job.stop)? the engines abort the step being generated, which is dropped; the driver
    checkpoints the last step it trained, with the prompt cursor as of that step, and returns "stopped"

The two modes differ in who computes the reference log-probs and the
advantages: in `fully_async` the reference workers (on a node group of their
own) and the advantage service write them into each step's rows
(services/fields.py; advantages where the estimator is outcome-only, else the
trainer computes them); in `hybrid` the trainer ranks compute all of it in
their own processes, as in colocate. In both, the trainer ranks compute what
depends on the weights the step starts from: logp_old, the anchor of the
ratio and of the importance weight (the step logs its version,
`logp_old_version`, always `step - 1`), and PPO's critic values.
Truncated importance sampling corrects for the samples' age by default in
both (algorithm.tis_cap). Engine changes requested meanwhile are applied with
the rollout service held at a safe point (between two batches); one it does
not reach in time leaves them requested, for the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from statistics import fmean

from relax_core.controller.job import Job
from relax_core.rollout.sampling_rounds import Preempted
from relax_core.services.rollout import StepRecord

log = logging.getLogger(__name__)
TAKE_TIMEOUT_S = 3600.0  # one step's rollout; a dead rollout service is noticed at once, not after this
POLL_S = 0.5  # how often a waiting driver looks at job.stop
PAUSE_TIMEOUT_S = 600.0  # the rollout's safe point (between two batches) must come within this for an engine change


def train_fully_async(job: Job) -> str:
    return train_streaming(job)


def train_hybrid(job: Job) -> str:
    return train_streaming(job)


def train_streaming(job: Job) -> str:
    total = job.recipe.train.steps
    start = job.resume()
    services, ray = job.services, job._ray
    ray.get(services.rollout.start.remote(start + 1, total, job.engines.endpoints(), job.prompts.state_dict(),
                                          job.policy_version, services.downstream, job.judge))
    world, fields = len(job.trainers), services.fields
    last_done = time.perf_counter()
    upcoming = Upcoming(job, start + 1)
    books = None  # the step trained last, whose records are written while the next one trains
    desk = RecoveryDesk(job)
    try:
        for step in range(start + 1, total + 1):
            engine_stats = apply_engine_changes(job)
            try:
                upcoming.wait()
            except Preempted:
                if books is not None:
                    books.write(job)  # the step trained last is complete: the checkpoint holds it
                return job.progress.stop_here()
            record = upcoming.record
            parts = None if upcoming.prefetched else job.bus.rank_shards(upcoming.meta, world)
            dispatched = time.perf_counter()
            refs = job.train_rows(parts, fields, step)
            if books is not None:
                books.write(job)
            upcoming = Upcoming(job, step + 1) if step < total else None
            if upcoming is not None:
                upcoming.prefetch_while(refs)
            train_metrics, ids, versions = job.train_results(refs)
            done = time.perf_counter()
            services.rollout.publish.remote(step)
            job.policy_version = step
            books = Books(step, record, ids, versions, engine_stats | train_metrics, dispatched - last_done,
                          done - dispatched, done - last_done)
            last_done = done
            checkpoint = step % job.recipe.checkpoint.interval == 0 or step == total
            # the next step's rows are read already: start it first, write these records while it trains
            if checkpoint or job.stop.is_set() or upcoming is None or not upcoming.prefetched:
                books.write(job)
                books = None
            if checkpoint:
                job.progress.checkpoint(step, record.data_state)
            if job.stop.is_set() and step < total:
                return job.progress.stop_here()
        return "completed"
    finally:
        desk.stop()
        services.rollout.halt.remote()


@dataclass
class Books:
    """A trained step's records, written (checks, metrics, freed partition) while the next step trains."""

    step: int
    record: StepRecord
    ids: list[int]
    versions: list[int]
    metrics: dict[str, float]
    idle_s: float  # the trainer ranks waited for this step's rows (or for the driver) this long
    train_s: float
    step_s: float

    def write(self, job: Job) -> None:
        check_trained(self.step, self.record, self.ids, self.versions, job.recipe.rollout.max_staleness)
        job.bus.clear(self.step)
        job.rows_trained += len(self.ids)
        depth = job._ray.get(job.services.rollout.produced.remote()) - job.rows_trained
        job.log(self.step, stream_metrics(self.record, self.versions, self.step, self.idle_s, self.train_s,
                                          self.step_s, depth) | self.record.reward_stats | self.metrics)
        job.progress.step_done(self.step, self.record.data_state)  # the cursor as of this step, not the rollout's now


class Upcoming:
    """The next step's rows as they become ready: the rollout's record, then the services' columns, then
    the rows claimed (metadata only). `prefetch_while` gets that far while the step before trains and
    hands each rank its shard to read at once; `wait` blocks for what is left."""

    def __init__(self, job: Job, step: int):
        self.job, self.step = job, step
        self._record_ref = job.services.rollout.record.remote(step, TAKE_TIMEOUT_S)
        self.record: StepRecord | None = None
        self._pending: list = []
        self.meta = None
        self.prefetched = False

    def _waitables(self) -> list:
        return [self._record_ref] if self.record is None else self._pending

    def _advance(self, timeout_s: float) -> bool:
        """Progress for at most `timeout_s`; True once the rows are claimed."""
        ray = self.job._ray
        if self.record is None:
            if not ray.wait([self._record_ref], timeout=timeout_s)[0]:
                return False
            try:
                self.record = ray.get(self._record_ref)
            except Exception as exc:
                if self.job.stop.is_set():  # an abort racing the stop: the rollout ended, as asked
                    raise Preempted(f"step {self.step} not trained: the run is stopping") from exc
                raise
            if self.record is None:
                raise TimeoutError(f"no samples for step {self.step} after {TAKE_TIMEOUT_S:.0f}s")
            self._pending = list(self.record.downstream)
        if self._pending:
            done, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=timeout_s)
            ray.get(done)  # a service's error surfaces here
            if self._pending:
                return False
        if self.meta is None:
            self.meta = self.job.bus.claim(self.step, self.record.count, self.job.services.fields, stop=self.job.stop)
        return True

    def wait(self) -> None:
        """Block until the rows are claimed; raises `Preempted` once the run is told to stop."""
        while not self._advance(POLL_S):
            if self.job.stop.is_set():
                raise Preempted(f"step {self.step} not trained: the run is stopping")

    def prefetch_while(self, training: list) -> None:
        """While `training` (refs) runs: get the rows ready and have each rank read its shard."""
        ray = self.job._ray
        while not self.job.stop.is_set():
            busy = ray.wait(training, num_returns=len(training), timeout=0)[1]
            if not busy:
                return
            ray.wait(self._waitables() + busy, num_returns=1, timeout=POLL_S)
            if self._advance(0):
                shards = self.job.bus.rank_shards(self.meta, len(self.job.trainers))
                self.job.prefetch_rows(shards, self.job.services.fields, self.step)
                self.prefetched = True
                return


class RecoveryDesk:
    """A driver thread for the engines' health while the run streams (controller/recovery.py): the watch
    (an engine that does not answer /health in time is ended), and the rollout service's requests to
    replace engines that failed its requests or a weight update (it waits meanwhile, nothing in flight)."""

    def __init__(self, job: Job):
        self.job = job
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relax-recovery", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from relax_core.cluster.actors import RequestFailed, describe
        from relax_core.rollout.client import EngineFailed

        job, loop = self.job, asyncio.new_event_loop()
        rollout, recovery = job.services.rollout, job.recovery
        next_check = time.monotonic() + recovery.check_every_s
        try:
            while not self._stop.is_set():
                try:
                    why = job._ray.get(rollout.recovery_request.remote(POLL_S))
                except Exception as exc:  # the rollout service ended: the driver hears why from `record`
                    log.debug("recovery desk: %s", exc)
                    return
                with job.engine_lock:
                    if why is not None:
                        try:
                            loop.run_until_complete(recovery.recover(RequestFailed(why)))
                            answer = (job.engines.endpoints(), None)
                        except EngineFailed as exc:
                            answer = (None, str(exc))
                        except Exception as exc:
                            answer = (None, f"replacing a failed engine failed: {describe(exc)} (after {why})")
                        rollout.recovered.remote(*answer)
                    elif time.monotonic() >= next_check:
                        loop.run_until_complete(recovery.check())
                        next_check = time.monotonic() + recovery.check_every_s
        finally:
            loop.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def apply_engine_changes(job: Job, pause_timeout_s: float = PAUSE_TIMEOUT_S) -> dict[str, float]:
    """Engines added or removed since the last step, applied with the rollout service held between
    two batches (an added engine gets the weights before its first request). A rollout not held within
    `pause_timeout_s` has requests in flight: the change stays requested, for the next step."""
    unchanged = {"engines": float(len(job.engines.urls))}
    if not job.elastic.needs_safe_point:
        return unchanged
    rollout, ray = job.services.rollout, job._ray
    if not ray.get(rollout.pause.remote(pause_timeout_s)):
        rollout.resume.remote()
        log.warning("the rollout did not reach a safe point within %.0fs (a step generating, or a weight "
                    "update); the engines change at the next step", pause_timeout_s)
        return unchanged
    changed: list[list[str]] = []
    try:
        with job.engine_lock:  # not while the recovery desk replaces an engine
            return job.elastic.apply(job.loop, changed.append)
    finally:
        rollout.resume.remote(changed[-1] if changed else None)


def check_trained(step: int, record: StepRecord, ids: list[int], versions: list[dict[int, int]],
                  max_staleness: int) -> None:
    """Every sample the rollout produced for `step` was trained on exactly once, and every token of each was
    generated by a version within the bound (`versions`: each sample's `Sample.version_counts`)."""
    if Counter(ids) != Counter(record.sample_ids):
        raise RuntimeError(f"step {step}: trained on {len(ids)} samples ({len(set(ids))} distinct), the rollout "
                           f"produced {record.count}: the data plane lost or duplicated rows")
    stale = [step - 1 - v for counts in versions for v in counts]
    if stale and (min(stale) < 0 or max(stale) > max_staleness):
        raise RuntimeError(f"step {step}: token staleness {min(stale)}..{max(stale)} is outside "
                           f"0..{max_staleness} (rollout.max_staleness)")


def staleness_metrics(versions: list[dict[int, int]], step: int) -> dict[str, float]:
    """Staleness (`step - 1 - version`) of the step's samples (by their oldest token) and of their tokens, and
    the share of samples whose tokens come from two versions or more (weights changed while they generated)."""
    staleness = [step - 1 - min(counts) for counts in versions]
    tokens = sum(n for counts in versions for n in counts.values())
    token_stale = sum((step - 1 - v) * n for counts in versions for v, n in counts.items())
    return {
        "staleness_min": float(min(staleness, default=0)),
        "staleness_mean": fmean(staleness) if staleness else 0.0,
        "staleness_max": float(max(staleness, default=0)),
        "token_staleness_mean": token_stale / tokens if tokens else 0.0,
        "token_staleness_max": float(max((step - 1 - v for counts in versions for v in counts), default=0)),
        "multi_version_frac": fmean(len(counts) > 1 for counts in versions) if versions else 0.0,
    }


def stream_metrics(record: StepRecord, versions: list[dict[int, int]], step: int, wait_s: float, train_s: float,
                   step_s: float, depth: int) -> dict[str, float]:
    stats = record.sample_stats
    return {
        "reward_mean": stats.get("reward_mean", 0.0),
        **{key: stats.get(key, 0.0) for key in ("response_len_mean", "response_len_median", "response_len_max")},
        "prompt_len_mean": stats.get("prompt_len_mean", 0.0),
        "truncated_frac": stats.get("truncated_frac", 0.0),
        "samples": float(record.count),
        "rollout_s": record.generate_s,
        "train_s": train_s,
        "sync_s": record.sync_s,
        "step_s": step_s,
        "policy_version": step,
        **staleness_metrics(versions, step),
        "queue_depth": float(depth),
        "trainer_idle_s": wait_s,
        "rollout_idle_s": record.idle_s,
        "samples_per_s": record.count / max(step_s, 1e-9),
        "tokens_per_s": stats.get("response_tokens", 0.0) / max(step_s, 1e-9),
    }
