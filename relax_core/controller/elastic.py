"""Scale operations: the rollout engines of a running job, grown and shrunk on request.

    relax scale-rollout +1   ->   POST /v1/scale (api.py)   ->   Elastic.request   ->   a ScaleOp

    scale-out   pending -> starting -> healthy -> syncing -> active        (or failed, cancelled)
      pending    Slurm: a rollout-only job is submitted (by the job's supervisor, entrypoints/scale_jobs.py)
                 and waits in Slurm's queue; local: the engines start at once; a URL: asked for /health
      starting   the engines load (on the new job's nodes once they joined the run's Ray cluster)
      healthy    every engine answers; waiting for the training loop's next safe point
      syncing    at that point each engine joins the weight group, gets the current weights, and only
                 then is routed to (EngineSet.join)
      active     serving
    scale-in    pending -> draining -> stopped
      the newest added engines: at the safe point the router stops sending to them, they drain, leave
      the weight group and stop; a scale-out job whose engines are all gone is cancelled.

One operation at a time (another is refused while one runs: 409); a request with a client request id
is carried out once however often it is sent, and a target count is met whatever the count is; a
pending operation can be cancelled. The run's original engines are never removed. An operation that
fails leaves the run as it was: what it started is stopped and the run goes on. Engines that leave on
their own (their scale-out job reached its time limit, or its nodes died) are removed at the next safe
point, and the run goes on with the rest. Nothing here blocks the training loop except the safe-point
work (`apply`): engines load, and Slurm jobs wait in the queue, while the run trains.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from relax_core.controller.scale_ops import Engine, ScaleError, ScaleOp, check_engine_url, engine_pids, host_of
from relax_core.controller.scale_out import ScaleOut
from relax_core.rollout.client import answers_health

log = logging.getLogger(__name__)

WATCH_S = 0.25  # how often the watcher advances the operations
HEALTH_EVERY_S = 2.0  # how often an added engine is asked whether it is still there
LOST_AFTER = 3  # failed health checks in a row before an added engine counts as gone
URL_HEALTH_TIMEOUT_S = 60.0  # an engine added by URL must answer /health within this


class Elastic:
    """The scale operations of one job and the engines they bring and take (the job's `EngineSet` does
    the joining and removing, at the safe points the training loop offers through `apply`).

    Args:
        engines: the job's `EngineSet`.
        scale_out: where a scale-out's engines start (scale_out.py: the executor's part).
        on_change: called (with the lock held) whenever engines or operations change.
    """

    def __init__(self, engines, scale_out: ScaleOut, on_change: Callable[[], None] | None = None):
        self.set, self.scale_out = engines, scale_out
        self._on_change = on_change
        self._lock = threading.RLock()
        self.engines: dict[str, Engine] = {}
        pids = engine_pids([self.set.actors[url] for url in self.set.urls])
        for url, pid in zip(self.set.urls, pids):
            index = len(self.engines)
            self.engines[f"e{index}"] = Engine(f"e{index}", "original", url=url, pid=pid)
        self._engine_ids = itertools.count(len(self.engines))
        self.ops: list[ScaleOp] = []
        self._op_ids = itertools.count(1)
        self._stop = threading.Event()
        self._next_health = 0.0
        self._thread = threading.Thread(target=self._watch, name="relax-elastic", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ queries
    def engine_list(self) -> list[Engine]:
        with self._lock:
            return list(self.engines.values())

    def op(self, op_id: str) -> ScaleOp:
        with self._lock:
            for op in self.ops:
                if op.id == op_id:
                    return op
        raise ScaleError(404, f"no scale operation '{op_id}' (GET /v1/scale lists them)")

    def running_op(self) -> ScaleOp | None:
        with self._lock:
            return next((op for op in self.ops if not op.final), None)

    def serving(self) -> list[Engine]:
        """Engines that serve or are about to (joined, or starting to): what a target count counts."""
        with self._lock:
            return [e for e in self.engines.values() if e.state in ("starting", "healthy", "active")]

    def started_by_scale(self) -> int:
        """Engines this run started on request and still runs (what a checkpoint records)."""
        with self._lock:
            return sum(e.origin == "added" and e.state == "active" for e in self.engines.values())

    @property
    def needs_safe_point(self) -> bool:
        """Something waits for the training loop's next safe point (`apply`)."""
        with self._lock:
            op = self.running_op()
            waiting = op is not None and ((op.kind == "out" and op.state == "healthy")
                                          or (op.kind == "in" and op.state == "pending"))
            return waiting or any(e.state == "lost" or (e.retiring and e.state == "active")
                                  for e in self.engines.values())

    # ------------------------------------------------------------ recovery
    def record_of(self, url: str) -> Engine | None:
        """The engine serving at `url`."""
        with self._lock:
            serving = (e for e in self.engines.values() if e.url == url and e.state not in ("stopped", "failed"))
            return next(serving, None)

    def set_state(self, url: str, state: str) -> None:
        with self._lock:
            record = self.record_of(url)
            if record is not None:
                record.state = state
                self._changed()

    def spawn_options(self, engine: Engine) -> dict[str, Any] | None:
        """Where a replacement of `engine` starts: where its scale-out's engines start, else a free slot."""
        op = next((op for op in self.ops if op.id == engine.op), None)
        return self.scale_out.spawn_options(op.id) if op is not None and self._ours(op) else None

    def replaced(self, engine: Engine, url: str, actor, node: str | None) -> None:
        """`engine` serves again, from a new process at `url` (recovery.py replaced it)."""
        with self._lock:
            engine.url, engine.node, engine.state = url, node, "active"
            engine.pid = engine_pids([actor])[0]
            engine.actor = actor if engine.origin == "added" else engine.actor
            engine.restarts += 1
            engine.failed_checks = 0
            self._changed()

    # ------------------------------------------------------------ requests
    def request(self, delta: int | None = None, target: int | None = None, url: str | None = None,
                request_id: str | None = None) -> tuple[int, dict[str, Any]]:
        """A scale request; returns (HTTP status, body): 202 with the new operation, 200 when it was
        already made (the same `request_id`) or nothing is to be done (the target count holds)."""
        with self._lock:
            if request_id is not None:
                done = next((op for op in self.ops if op.request_id == request_id), None)
                if done is not None:
                    return 200, done.public()
            busy = self.running_op()
            if busy is not None:
                raise ScaleError(409, f"scale operation {busy.id} ({busy.kind} {busy.count}) is {busy.state}; "
                                      f"wait for it to end, or cancel it while it is pending "
                                      f"(DELETE /v1/scale/{busy.id})")
            delta = self._delta(delta, target, url)
            if delta == 0:
                return 200, {"id": None, "state": "active", "engines": len(self.serving()),
                             "message": f"the run has {len(self.serving())} engines already"}
            op = self._begin(delta, url, request_id)
            self._changed()
            return 202, op.public()

    def restore(self, added: int, request_id: str) -> None:
        """A resumed run asks again for the engines its scale-outs had added (the checkpoint's count)."""
        try:
            code, op = self.request(delta=added, request_id=request_id)
            log.info("resumed with %d added engine(s): scale operation %s", added, op.get("id"))
        except ScaleError as exc:
            log.warning("the checkpoint had %d added engine(s), which cannot be added again: %s", added, exc)

    def _delta(self, delta: int | None, target: int | None, url: str | None) -> int:
        if url is not None:
            check_engine_url(url, delta, target, self.engines.values())
            return 1
        if (delta is None) == (target is None):
            raise ScaleError(400, "give one of 'delta' (+N or -N engines) or 'target' (a count of engines)")
        if target is not None:
            if target < 1:
                raise ScaleError(400, f"target {target}: a run keeps at least its original engines")
            delta = target - len(self.serving())
        if delta < 0:
            originals = sum(e.origin == "original" for e in self.engines.values())
            removable = self._removable()
            if -delta > len(removable):
                raise ScaleError(400, f"cannot remove {-delta} engine(s): the run has {len(removable)} added "
                                      f"engine(s), and its {originals} original engine(s) are never removed")
        if delta > 0:
            if self.set.hands_over:
                raise ScaleError(400, "engines on the trainer ranks' GPUs (colocate on GPU nodes) cannot be "
                                      "added during a run; start the run with more rollout.num_engines")
            refusal = self.scale_out.refusal(len(self.serving()), delta)
            if refusal is not None:
                raise ScaleError(400, refusal)
        return delta

    def _removable(self) -> list[Engine]:
        """Engines a scale-in may take, newest first."""
        return [e for e in reversed(self.engines.values()) if e.origin != "original" and e.state == "active"]

    def _begin(self, delta: int, url: str | None, request_id: str | None) -> ScaleOp:
        op_id = f"s{next(self._op_ids)}"
        if delta < 0:
            engines = self._removable()[:-delta]
            op = ScaleOp(op_id, "in", -delta, "/".join(sorted({e.origin for e in engines})), request_id,
                         engines=[e.id for e in engines])
            for engine in engines:
                engine.op = engine.op or op_id
            self.ops.append(op)
            return op
        source = "url" if url is not None else self.scale_out.name
        op = ScaleOp(op_id, "out", delta, source, request_id, url=url.rstrip("/") if url else None)
        self.ops.append(op)
        try:
            if url is not None:
                self._new_engine("external", op, url=op.url)
            else:
                self.scale_out.submit(op.id, delta)
                options = self.scale_out.spawn_options(op.id)
                for _ in range(delta):
                    engine = self._new_engine("added", op)
                    engine.actor = self.set.spawn(options)
                    engine.ready_ref = self.set.ready(engine.actor)
            if url is not None or not self.scale_out.queued:
                op.to("starting")
        except Exception as exc:  # nothing started stays
            self._fail(op, f"{type(exc).__name__}: {exc}")
        return op

    def _new_engine(self, origin: str, op: ScaleOp, url: str | None = None) -> Engine:
        engine = Engine(f"e{next(self._engine_ids)}", origin, url=url, op=op.id, state="starting")
        self.engines[engine.id] = engine
        op.engines.append(engine.id)
        return engine

    def cancel(self, op_id: str) -> dict[str, Any]:
        """Cancel a pending scale-out (or a scale-in not yet begun); 409 once it went further."""
        with self._lock:
            op = self.op(op_id)
            if op.state != "pending":
                raise ScaleError(409, f"scale operation {op.id} is {op.state}: only a pending one can be cancelled")
            if op.kind == "out":
                self._discard(op)
            else:
                for engine in self._engines_of(op):
                    engine.op = None if engine.op == op.id else engine.op
            op.to("cancelled")
            self._changed()
            return op.public()

    def remove_engine(self, engine_id: str, request_id: str | None = None) -> tuple[int, dict[str, Any]]:
        """Scale in by one named engine (DELETE /v1/engines/{id})."""
        with self._lock:
            engine = self.engines.get(engine_id)
            if engine is None:
                raise ScaleError(404, f"no engine '{engine_id}' (GET /v1/engines lists them)")
            if engine.origin == "original":
                raise ScaleError(400, f"engine {engine_id} is one of the run's original engines, which are never "
                                      "removed; remove an added one")
            if engine.state != "active":
                raise ScaleError(400, f"engine {engine_id} is {engine.state}, not active")
            busy = self.running_op()
            if busy is not None:
                raise ScaleError(409, f"scale operation {busy.id} is {busy.state}; wait for it to end")
            op = ScaleOp(f"s{next(self._op_ids)}", "in", 1, engine.origin, request_id, engines=[engine.id])
            self.ops.append(op)
            self._changed()
            return 202, op.public()

    # -------------------------------------------------------- the watcher
    def _watch(self) -> None:
        while not self._stop.wait(WATCH_S):
            try:
                with self._lock:
                    self._advance()
                self._check_health()
            except Exception:  # never the run's end: the next round tries again
                log.exception("the scale watcher failed a round")

    def _advance(self) -> None:
        op = self.running_op()
        if op is None or op.kind != "out":
            self._retire_ending_jobs()
            return
        if op.state == "pending" and self._ours(op):
            pending = self.scale_out.pending(op.id)
            if pending.job_id is not None and op.job_id is None:
                op.job_id = pending.job_id
                self._changed()
            if pending.error is not None:
                self._fail(op, pending.error)
                return
            if pending.ready:
                op.to("starting")
                self._changed()
        if op.state == "starting":
            self._poll_starting(op)
        self._retire_ending_jobs()

    def _poll_starting(self, op: ScaleOp) -> None:
        engines = self._engines_of(op)
        if op.url is not None:  # an engine someone else started: ask it for /health
            engine = engines[0]
            if answers_health(engine.url, self.set.spec.api_key, timeout_s=2.0):
                engine.state, engine.node = "healthy", host_of(engine.url)
            elif time.time() - op.history[0][1] > URL_HEALTH_TIMEOUT_S:
                self._fail(op, f"{engine.url} did not answer /health with the run's engine key within "
                               f"{URL_HEALTH_TIMEOUT_S:.0f}s")
                return
        else:
            import ray

            for engine in engines:
                if engine.state != "starting" or not ray.wait([engine.ready_ref], timeout=0)[0]:
                    continue
                try:
                    engine.url = ray.get(engine.ready_ref)
                    engine.node = ray.get(engine.actor.where.remote(), timeout=30)
                    engine.pid = engine_pids([engine.actor])[0]
                except Exception as exc:
                    self._fail(op, f"engine {engine.id} did not start: {type(exc).__name__}: {exc}")
                    return
                engine.state = "healthy"
                self._changed()
        if all(e.state == "healthy" for e in engines):
            op.to("healthy")
            self._changed()

    def _retire_ending_jobs(self) -> None:
        """Engines of a scale-out whose resources are going away (a Slurm job near its time limit,
        cancelled or dead) leave at the next safe point."""
        for op in self.ops:
            if not self._ours(op) or op.state != "active" or not self.scale_out.ending(op.id):
                continue
            for engine in self._engines_of(op):
                if engine.state == "active" and not engine.retiring:
                    engine.retiring = True
                    log.info("engine %s leaves: the resources of %s (job %s) are going away", engine.id, op.id,
                             op.job_id)

    def _check_health(self) -> None:
        """Added engines that stopped answering count as gone (removed at the next safe point)."""
        if time.monotonic() < self._next_health:
            return
        self._next_health = time.monotonic() + HEALTH_EVERY_S
        with self._lock:
            watched = [e for e in self.engines.values() if e.origin != "original" and e.state == "active"]
        for engine in watched:
            if answers_health(engine.url, self.set.spec.api_key, timeout_s=5.0):
                engine.failed_checks = 0
                continue
            engine.failed_checks += 1
            if engine.failed_checks >= LOST_AFTER:
                with self._lock:
                    if engine.state == "active":
                        engine.state = "lost"
                        log.warning("engine %s (%s) stopped answering; it is removed at the next safe point",
                                    engine.id, engine.url)
                        self._changed()

    # --------------------------------------------------------- safe point
    def apply(self, loop: asyncio.AbstractEventLoop,
              on_change: Callable[[list[str]], None] | None = None) -> dict[str, float]:
        """At a safe point of the training loop (no request in flight): engines that left are removed,
        the running operation's engines join or leave. Returns the step's engine metrics."""
        added = removed = 0
        with self._lock:
            gone = [e for e in self.engines.values() if e.state == "lost" or (e.retiring and e.state == "active")]
            op = self.running_op()
        for engine in gone:
            alive = engine.state == "active"
            try:
                loop.run_until_complete(self.set.remove(engine.url, alive=alive))
            except Exception as exc:
                log.warning("removing engine %s: %s", engine.id, exc)
            with self._lock:
                engine.state = "stopped" if alive else "lost"
                engine.retiring = False
                engine.failed_checks = -1  # not watched again
                removed += 1
                self._job_done_with(engine.op)
                self._changed()
        if op is not None and op.kind == "out" and op.state == "healthy":
            added = self._join(op, loop)
        elif op is not None and op.kind == "in" and op.state == "pending":
            removed += self._leave(op, loop)
        if (added or removed) and on_change is not None:
            on_change(self.set.endpoints())
        return {"engines": float(len(self.set.urls)), "engines_added": float(added),
                "engines_removed": float(removed)}

    def _join(self, op: ScaleOp, loop) -> int:
        with self._lock:
            op.to("syncing")
            self._changed()
        joined = []
        try:
            for engine in self._engines_of(op):
                loop.run_until_complete(self.set.join(engine.url, engine.actor))
                joined.append(engine)
                engine.state = "active"
        except Exception as exc:
            for engine in joined:  # back to the engines the run had
                try:
                    loop.run_until_complete(self.set.remove(engine.url))
                except Exception as again:
                    log.warning("taking engine %s back out: %s", engine.id, again)
            with self._lock:
                self._fail(op, f"joining the run failed: {type(exc).__name__}: {exc}")
            return 0
        with self._lock:
            op.to("active")
            self._changed()
        return len(joined)

    def _leave(self, op: ScaleOp, loop) -> int:
        with self._lock:
            op.to("draining")
            engines = self._engines_of(op)
            for engine in engines:
                engine.state = "draining"
            self._changed()
        try:
            for engine in engines:
                loop.run_until_complete(self.set.remove(engine.url, alive=True))
                with self._lock:
                    engine.state = "stopped"
                    self._job_done_with(engine.op)
                    self._changed()
        except Exception as exc:
            with self._lock:
                for engine in engines:
                    if engine.state == "draining":
                        engine.state = "active" if engine.url in self.set.urls else "lost"
                self._fail(op, f"removing the engines failed: {type(exc).__name__}: {exc}")
            return 0
        with self._lock:
            op.to("stopped")
            self._changed()
        return len(engines)

    # ------------------------------------------------------------ helpers
    def _engines_of(self, op: ScaleOp) -> list[Engine]:
        return [self.engines[i] for i in op.engines]

    def _ours(self, op: ScaleOp) -> bool:
        """`op` is a scale-out whose engines started where the executor puts them (not added by URL)."""
        return op.kind == "out" and op.url is None

    def _job_done_with(self, op_id: str | None) -> None:
        """A scale-out whose engines are all gone gives its resources back (its nodes hold nothing of the
        run)."""
        out = next((op for op in self.ops if op.id == op_id and self._ours(op)), None)
        if out is not None and all(e.state in ("stopped", "lost", "failed") for e in self._engines_of(out)):
            self.scale_out.release(out.id)

    def _discard(self, op: ScaleOp) -> None:
        """Stop whatever scale-out `op` started (engines not yet joined; its Slurm job)."""
        for engine in self._engines_of(op):
            if engine.actor is not None:
                self.set.forget(engine.actor)
            engine.state = "failed" if engine.state != "stopped" else engine.state
        if self._ours(op):
            self.scale_out.release(op.id)

    def _fail(self, op: ScaleOp, message: str) -> None:
        self._discard(op)
        op.to("failed", message)
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change()
            except Exception as exc:
                log.warning("recording the engines: %s", exc)

    def snapshot(self) -> dict[str, Any]:
        """What run.json records (and `relax status` shows): the engines, and the operation in progress."""
        with self._lock:
            running = self.running_op()
            last = self.ops[-1] if self.ops else None
            return {"engines": [e.public() for e in self.engines.values() if e.state not in ("stopped", "failed")],
                    "scale": (running or last).public() if (running or last) else None}

    def close(self) -> None:
        """Stop the watcher; every scale-out gives its resources back (a Slurm job still running is
        cancelled; the supervisor cancels all at the end as well)."""
        self._stop.set()
        self._thread.join(timeout=10)
        with self._lock:
            for op in self.ops:
                if self._ours(op):
                    self.scale_out.release(op.id)

