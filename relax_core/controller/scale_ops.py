"""A scale operation and the engines it brings or takes, as the control API shows them (elastic.py runs
them; scale_out.py starts a scale-out's engines where the executor puts them)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("relax_core.controller.elastic")
FINAL = ("active", "stopped", "failed", "cancelled")
URL_PATTERN = re.compile(r"^https?://[^/\s]+:\d+/?$")


class ScaleError(Exception):
    """A request the API refuses: `status` is its HTTP code (400 impossible, 404 unknown, 409 busy)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def iso_time(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 1000):03d}"


@dataclass
class Engine:
    """One rollout engine of the run, as the API shows it."""

    id: str
    origin: str  # "original" (started with the run), "added" (by a scale-out), "external" (added by URL)
    url: str | None = None
    op: str | None = None  # the scale-out that brought it
    node: str | None = None
    state: str = "active"  # starting, healthy, active, draining, stopped, failed, lost (its node left)
    actor: Any = None
    ready_ref: Any = None
    failed_checks: int = 0
    retiring: bool = False  # its scale-out job is ending: removed (drained) at the next safe point
    restarts: int = 0  # times it died or hung and was replaced (controller/recovery.py)
    pid: int | None = None  # its server's process id (None: an engine someone else started)

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "url": self.url, "node": self.node, "origin": self.origin, "state": self.state,
                "op": self.op, "restarts": self.restarts, "pid": self.pid}


@dataclass
class ScaleOp:
    id: str
    kind: str  # "out" or "in"
    count: int
    source: str  # out: "local", "slurm" or "url"; in: the engines' origins
    request_id: str | None = None
    url: str | None = None
    engines: list[str] = field(default_factory=list)  # engine ids
    job_id: str | None = None  # the scale-out's Slurm job
    state: str = "pending"
    error: str | None = None
    history: list[tuple[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.history.append((self.state, time.time()))

    def to(self, state: str, error: str | None = None) -> None:
        self.state, self.error = state, error or self.error
        self.history.append((state, time.time()))
        log.info("scale %s (%s %d): %s%s", self.id, self.kind, self.count, state, f": {error}" if error else "")

    @property
    def final(self) -> bool:
        return self.state in FINAL

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "count": self.count, "source": self.source,
                "request_id": self.request_id, "url": self.url, "engines": list(self.engines),
                "slurm_job_id": self.job_id, "state": self.state, "error": self.error,
                "history": [{"state": s, "at": iso_time(t), "t": t} for s, t in self.history]}


def engine_pids(actors: list) -> list[int | None]:
    """The engine servers' process ids (None for an engine this run did not start)."""
    import ray

    started = [a for a in actors if a is not None]
    pids = iter(ray.get([a.pid.remote() for a in started], timeout=30) if started else [])
    return [next(pids) if a is not None else None for a in actors]


def host_of(url: str) -> str:
    """The host part of an engine's base URL."""
    return url.split("//", 1)[-1].rsplit(":", 1)[0]


def check_engine_url(url: str, delta: int | None, target: int | None, engines: Iterable[Engine]) -> None:
    """Refuse (`ScaleError` 400) a request to add the engine at `url` that cannot be carried out."""
    if target is not None or delta not in (None, 1):
        raise ScaleError(400, "an engine added by URL is one engine: give 'url' alone")
    if not URL_PATTERN.match(url):
        raise ScaleError(400, f"url '{url}': give the engine's base URL, http://HOST:PORT")
    if any(e.url == url.rstrip("/") and e.state not in ("stopped", "failed", "lost") for e in engines):
        raise ScaleError(400, f"{url} is one of the run's engines already")
