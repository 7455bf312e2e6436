"""The recipe's `checkpoint:` and `recovery:` sections: how a run keeps its state, and what it does when one of
its processes fails (replace an engine, restart the job from its latest checkpoint)."""

from __future__ import annotations

from pydantic import Field

from relax_core.config.section import Section


class CheckpointConfig(Section):
    """Megatron-format checkpoints."""

    dir: str | None = None
    """Checkpoint folder; `<run dir>/checkpoints` if unset."""
    interval: int = Field(50, ge=1)
    """Save every this many steps (and at the end)."""
    keep_last: int = Field(3, ge=1)
    """Checkpoints kept; older ones are deleted."""
    resume: bool = True
    """Resume from the latest checkpoint of the run directory when there is one."""


class RecoveryConfig(Section):
    """What a run does when one of its processes fails (controller/recovery.py)."""

    health_timeout_s: float = Field(60.0, gt=0.0)
    """Every engine must answer /health within this while the run generates; one that does not (hung,
    stopped) is ended and replaced. An engine that dies is replaced as soon as a request to it fails;
    either way its lost requests are sent again, so no sample is lost or trained twice."""
    max_engine_restarts: int = Field(3, ge=0)
    """Replacements of one engine within an hour; after its next failure it is left out and the run goes on
    with the other engines, or, when it was the last, ends naming the engine and its log (0: no
    replacement)."""
    max_restarts: int = Field(3, ge=0)
    """Restarts of the whole job from its latest checkpoint, inside the same driver, after a trainer rank or a
    service that holds training state died (or ran out of memory once); the next such failure ends the run
    with its cause (0: the first one does). Errors that would only happen again (a bad recipe found late,
    out of memory twice the same way) end the run at once."""
