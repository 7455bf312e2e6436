"""A job that lost a trainer rank (or a service) starts again from its latest checkpoint, in the same driver.

    a trainer rank stops answering (TrainerWatch: within `recovery.health_timeout_s`): it is ended, and
    the step waiting on it fails
    the training loop raises
        -> is a process of the job gone? every trainer rank is asked who it is (`process`) and must
           answer within PROBE_TIMEOUT_S (a rank has threads to spare while it trains); a service
           whose actor died counts too. The first one gone is the cause.
        -> else, out of memory? The first time, start again (memory left fragmented, a neighbour's
           job on the node); the same error twice ends the run: the same shapes would fail again.
        -> anything else (a recipe mistake found late, an engine past its restarts, a stop, a bug that
           would only happen again) ends the run at once.
    a restart: `Job.close` stops every process the job started, a new `Job` starts them again and
    resumes from the latest checkpoint (the steps after it run again; metrics.jsonl drops them first).

At most `recovery.max_restarts` restarts per driver; the next failure that would restart the job ends
it instead, naming the cause. Each restart is in run.json (`job_restarts`, which `relax status` shows),
in the driver log and sent to the run's notifiers. A job that fails while it starts is not restarted:
it would fail the same way.
"""

from __future__ import annotations

import logging
import threading
import time

from relax_core.cluster.actors import describe
from relax_core.errors import UserError
from relax_core.rollout.client import EngineFailed

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 20.0


class RestartLimit(RuntimeError):
    """The job failed again after `recovery.max_restarts` restarts: the run ends with this message."""


def out_of_memory(error: BaseException) -> str | None:
    """The first line of an out-of-memory error anywhere in `error`'s chain (a Ray task's cause included)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = (str(error).splitlines() or [""])[0]
        if "OutOfMemoryError" in type(error).__name__ or "out of memory" in text.lower():
            return f"{type(error).__name__}: {text[:300]}"
        error = getattr(error, "cause", None) or error.__cause__
    return None


class JobRestarts:
    """What the driver does after the job failed: start it again (the cause) or end the run."""

    def __init__(self, limit: int, probe=None):
        """`probe(job, timeout_s)`: the job's lost processes, one line each (default `lost_processes`)."""
        self.limit, self.probe = limit, probe or lost_processes
        self.history: list[dict] = []  # one entry per restart: when, the cause, the step resumed from
        self._memory: str | None = None  # the last out-of-memory error that restarted the job

    @property
    def count(self) -> int:
        return len(self.history)

    def cause(self, error: BaseException, job) -> str | None:
        """Why the job should start again after `error`; None when the run should end with `error`.

        Raises:
            RestartLimit: it should, but was restarted `limit` times already.
        """
        if not isinstance(error, Exception) or isinstance(error, (UserError, EngineFailed, RestartLimit)):
            return None
        if job is None or job.stop.is_set():  # failed while starting, or told to stop
            return None
        lost = self.probe(job, PROBE_TIMEOUT_S)
        if lost:
            cause = lost[0]
        else:
            memory = out_of_memory(error)
            if memory is None or memory == self._memory:
                return None
            self._memory, cause = memory, f"out of memory: {memory}"
        if self.count >= self.limit:
            raise RestartLimit(f"{cause}; the job was restarted {self.count} time(s) already, the most "
                               f"recovery.max_restarts={self.limit} allows. The run's log: "
                               f"{job.run.logs / 'driver.log'}. Find out why it fails there, or raise "
                               "recovery.max_restarts") from error
        self.history.append({"at": round(time.time(), 3), "cause": cause, "failed": describe(error),
                             "from_step": job.progress.checkpointed})
        log.warning("the job failed (%s): %s; restarting it from its latest checkpoint (restart %d of at most %d)",
                    describe(error), cause, self.count, self.limit)
        return cause


def lost_processes(job, timeout_s: float) -> list[str]:
    """The trainer ranks of `job` that do not say who they are within `timeout_s` (dead, or stopped), and
    the services whose actor died: one line each, naming it."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    known = {p["rank"]: p for p in job.run.read_state().get("trainers") or []}
    lost = []
    for rank, ref in enumerate([t.process.remote() for t in job.trainers]):
        try:
            ray.get(ref, timeout=timeout_s)
        except Exception as exc:  # its actor died, or it did not answer in time
            where = known.get(rank)
            name = f"trainer rank {rank}" + (f" (pid {where['pid']} on {where['node']})" if where else "")
            why = f"did not answer within {timeout_s:.0f}s" if isinstance(exc, GetTimeoutError) else "is gone"
            if job.trainer_watch is not None and rank in job.trainer_watch.ended:
                why = (f"did not answer within recovery.health_timeout_s={job.trainer_watch.timeout_s:g}s "
                       "and was ended")
            lost.append(f"{name} {why} ({describe(exc)})")
    for name, handle in job.services.actors() if job.services is not None else ():
        try:
            ray.get(handle.node_id.remote(), timeout=timeout_s)
        except RayActorError as exc:
            lost.append(f"the {name} service is gone ({describe(exc)})")
        except GetTimeoutError:
            pass  # busy: a service computes one batch at a time
    return lost


class TrainerWatch:
    """Asks every trainer rank who it is every `timeout_s / 3` seconds, from a thread of its own (a rank
    answers from a spare thread while it trains). A rank that does not answer within `timeout_s` (stopped,
    hung) is ended: the step that waits on it then fails and the job restarts (`JobRestarts`)."""

    def __init__(self, ray, trainers: list, timeout_s: float):
        self._ray, self.trainers, self.timeout_s = ray, trainers, timeout_s
        self.ended: dict[int, float] = {}  # rank -> the time it was ended for not answering
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="trainer-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.timeout_s / 3):
            refs = [t.process.remote() for t in self.trainers]
            answered, _ = self._ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
            if self._stop.is_set():
                return
            for rank, ref in enumerate(refs):
                if ref not in answered and rank not in self.ended:
                    log.warning("trainer rank %d did not answer within %.0fs (recovery.health_timeout_s): "
                                "ending it", rank, self.timeout_s)
                    self.ended[rank] = time.time()
                    self._ray.kill(self.trainers[rank])

    def close(self) -> None:
        self._stop.set()
