"""Engines that die or hang during a run are replaced, and the run goes on without losing a sample.

    a request fails (connection refused or reset, a 5xx from the router)
        -> recover, at once (nothing is in flight then: rollout/manager.py waits for the round's
           other requests first)
             every engine is asked for /health; those that do not answer are removed (router,
             weight group), their actor ended and their slot freed; a new engine starts in the slot,
             and once healthy joins (weight group re-formed, the weights every engine holds sent to it)
        -> the failed requests are sent again (the same draws where the engine samples by each sample's
           seed: the CPU engine, SGLang with rollout.deterministic), and only one answer per sample is
           ever kept
    an engine that does not answer /health within `recovery.health_timeout_s` while a step generates
    (hung, or stopped) is ended first, so that its requests fail and take the path above

The watch asks for /health only while a step generates (rollout/manager.py `_watched`), while a
broadcast weight sync runs (job.py `_watched`) and, in the asynchronous modes, all the time: never while
colocate's engines have released their memory for the trainer (colocate.py `train_step`: release, train,
then resume before the sync; weights handed over by reference are not watched). That matters because
SGLang answers /health with a one-token generation (http_server.py `health_generate`), which on released
memory would run the model on unmapped pages.

An engine that fails again after `recovery.max_engine_restarts` replacements within an hour is left
out: something about it (its node, its memory, the model) keeps failing, and restarting it forever
would hide that. The run goes on with the other engines, or, with none left, ends naming the engine
and its log. Each replacement is recorded in run.json (`engine_restarts`,
which `relax status` shows) and reported to the run's notifiers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from relax_core.cluster.actors import describe
from relax_core.rollout.client import EngineFailed

log = logging.getLogger(__name__)

HOUR_S = 3600.0


class EngineRecovery:
    """The rollout manager's recovery (`RolloutManager(recovery=...)`) for one job's engines.

    Args:
        job: the running `Job` (its engine set, scale records, run directory, clients).
        health_timeout_s: an engine must answer /health within this while a step generates.
        max_restarts: replacements of one engine within an hour before the run ends instead.
    """

    def __init__(self, job, health_timeout_s: float, max_restarts: int, on_restart=None):
        self.job, self.health_timeout_s, self.max_restarts = job, health_timeout_s, max_restarts
        self.check_every_s = min(5.0, health_timeout_s)
        self.on_restart = on_restart  # called with each restart's record (notifications)
        self._times: dict[str, deque[float]] = {}  # engine id -> when it was replaced (within the hour)
        self.records: list[dict[str, Any]] = []
        self._hung: dict[str, str] = {}  # url -> why the watch ended it

    # ------------------------------------------------------------ the watch
    async def check(self) -> None:
        """End every engine that does not answer /health in time (its requests then fail and are sent
        again once it is replaced)."""
        urls = self.job.engines.urls
        for url, ok in zip(urls, await self._answering(urls)):
            if not ok and self.job.engines.kill(url):
                self._hung[url] = f"it did not answer /health within {self.health_timeout_s:g}s"
                log.warning("engine %s did not answer /health within %.0fs (recovery.health_timeout_s): ended; "
                            "it is replaced", self._name(url), self.health_timeout_s)

    async def _answering(self, urls: list[str]) -> list[bool]:
        from relax_core.rollout.client import EngineClient

        async def probe(url: str) -> bool:
            client = EngineClient(url, api_key=self.job.engines.spec.api_key, timeout=self.health_timeout_s)
            try:
                return await asyncio.wait_for(client.health(), self.health_timeout_s)
            except (asyncio.TimeoutError, OSError):
                return False
            finally:
                await client.aclose()

        return list(await asyncio.gather(*(probe(url) for url in urls)))

    # ------------------------------------------------------------ recovery
    async def recover(self, error: Exception) -> list:
        """Replace every engine that does not answer; returns the clients of the new endpoints. `error`
        (the failed request's) is raised again when every engine answers: it was not an engine's loss."""
        urls = self.job.engines.urls
        answers = await self._answering(urls)
        gone = [url for url, ok in zip(urls, answers) if not ok]
        if not gone:
            raise error
        serving = sum(answers)
        for url in gone:
            serving += await self._replace(url, self._hung.pop(url, None) or describe(error), serving)
        return self.job.clients_for(self.job.engines.endpoints())

    async def _replace(self, url: str, reason: str, serving: int) -> int:
        """Replace the engine at `url` (1: it serves again), or past its restarts leave it out when
        `serving` other engines carry on (0); with none left, the run ends (EngineFailed)."""
        engines, elastic = self.job.engines, self.job.elastic
        record = elastic.record_of(url)
        name, log_path = self._name(url), engines.log_of(url)
        if engines.hands_over:
            raise EngineFailed(f"engine {name} ({url}) failed: {reason}. Engines on the trainer ranks' GPUs are "
                               f"not replaced during a run; its log: {log_path}")
        recent = self._times.setdefault(name, deque())
        now = time.time()
        while recent and now - recent[0] > HOUR_S:
            recent.popleft()
        if len(recent) >= self.max_restarts:
            limit = (f"engine {name} ({url}) failed ({reason}) and was replaced {len(recent)} time(s) within the hour "
                     f"already, the most recovery.max_engine_restarts={self.max_restarts} allows; its log: {log_path}")
            if not serving:
                raise EngineFailed(f"{limit}. No other engine serves. Find out why it keeps failing there, or raise "
                                   "recovery.max_engine_restarts")
            await self._leave_out(url, name, limit, reason, serving)
            return 0
        log.warning("engine %s (%s) is gone (%s): starting a new one in its place", name, url, reason)
        elastic.set_state(url, "restarting")
        engines.kill(url)  # it did not answer, but may be alive (stopped, hung): nothing may wait on it
        await engines.remove(url, alive=False)
        if record is not None and record.origin == "external":
            return 0  # someone else's engine: it is only forgotten
        actor = engines.spawn(elastic.spawn_options(record) if record is not None else None)
        new_url = await asyncio.wrap_future(actor.wait_ready.remote().future())
        node = await asyncio.wrap_future(actor.where.remote().future())
        await engines.join(new_url, actor)
        recent.append(now)
        if record is not None:
            elastic.replaced(record, new_url, actor, node)
        entry = {"engine": name, "at": now, "old_url": url, "new_url": new_url, "reason": reason,
                 "took_s": round(time.time() - now, 2), "log": engines.log_of(new_url)}
        self.records.append(entry)
        self.job.run.update_state(engine_restarts=self.records)
        log.warning("engine %s replaced: %s now serves in place of %s (%.1fs)", name, new_url, url, entry["took_s"])
        if self.on_restart is not None:
            self.on_restart(entry)
        return 1

    async def _leave_out(self, url: str, name: str, limit: str, reason: str, serving: int) -> None:
        """The run goes on without the engine at `url`: it is ended and its slot freed, not replaced."""
        log.warning("%s: the run goes on with the other %d engine(s)", limit, serving)
        self.job.engines.kill(url)
        await self.job.engines.remove(url, alive=False)
        self.job.elastic.set_state(url, "failed")
        entry = {"engine": name, "at": time.time(), "old_url": url, "new_url": None, "reason": reason,
                 "took_s": 0.0, "left_out": True, "serving": serving}
        self.records.append(entry)
        self.job.run.update_state(engine_restarts=self.records)
        if self.on_restart is not None:
            self.on_restart(entry)

    def _name(self, url: str) -> str:
        record = self.job.elastic.record_of(url) if self.job.elastic is not None else None
        return record.id if record is not None else url
