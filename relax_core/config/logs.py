"""The recipe's `logging:` section: where runs and each step's metrics go (TensorBoard, W&B, ...) and the
URLs that get the run's notifications (metrics/notify.py sends them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from relax_core.config.section import Section


class WandbConfig(Section):
    """Weights & Biases (`logging.backends: [wandb]`)."""

    project: str | None = None
    """The W&B project (default: the recipe's name)."""


class ClearMLConfig(Section):
    """ClearML (`logging.backends: [clearml]`)."""

    project: str | None = None
    """The ClearML project (default: the recipe's name); the task is named after the run directory."""


class LoggingConfig(Section):
    """Where runs and metrics go."""

    run_root: str = "runs"
    """Folder under which each run gets its own directory."""
    backends: list[Literal["tensorboard", "wandb", "clearml", "jsonl"]] = Field(
        default_factory=lambda: ["tensorboard"])
    """Where each step's metrics go besides `metrics.jsonl`, which is always written (`jsonl` may be
    listed; `[]` or `[jsonl]`: nothing else). `tensorboard`: event files in RUN/tensorboard. `wandb`:
    a W&B run in RUN/wandb, offline unless `WANDB_MODE=online` is in the driver's environment (upload it
    later with `wandb sync RUN/wandb/offline-run-*`); its id is kept in RUN/wandb_run_id, so a resumed or
    requeued run continues the same W&B run. `clearml`: a ClearML task, offline in RUN/clearml/offline/
    unless `CLEARML_OFFLINE_MODE=0` is in the driver's environment (upload it later with
    `clearml-task --import-offline-session RUN/clearml/offline/<task id>.zip`); its id is kept in
    RUN/clearml_task_id, so a resumed or requeued run continues the same task. Each is imported only when
    listed."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """W&B settings (read when `backends` lists wandb)."""
    clearml: ClearMLConfig = Field(default_factory=ClearMLConfig)
    """ClearML settings (read when `backends` lists clearml)."""
    notify: list[str] = Field(default_factory=list)
    """Apprise URLs that get the run's events (started, a summary every `notify_every` steps, checkpoints,
    engine restarts, stopped, requeued, finished, failed with its cause): `ntfy://`, `slack://`,
    `mailto://`, `json://host:port/path` for a webhook of one's own... Write a URL that holds a token as
    `${VARIABLE}` from the environment. A notifier that is down never slows or fails the run."""
    notify_every: int = Field(50, ge=1)
    """Steps between two summaries sent to `notify` (step, reward, throughput, staleness)."""

    @field_validator("backends")
    @classmethod
    def _each_once(cls, value: list[str]) -> list[str]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} listed more than once")
        return value

    @model_validator(mode="after")
    def _settings_need_their_backend(self) -> LoggingConfig:
        for name, settings, default in (("wandb", self.wandb, WandbConfig()),
                                        ("clearml", self.clearml, ClearMLConfig())):
            if settings != default and name not in self.backends:  # a setting nothing would read
                raise ValueError(f"logging.{name} is set but logging.backends does not list {name}: add {name} "
                                 f"to logging.backends, or drop logging.{name}")
        return self

    @field_validator("notify")
    @classmethod
    def _apprise_urls(cls, value: list[str]) -> list[str]:
        if value:
            bad = [value.index(url) + 1 for url in unusable(value)]
            if bad:
                schemes = ", ".join(f"entry {i} ({value[i - 1].split('://', 1)[0]}://...)" for i in bad)
                raise ValueError(f"{schemes}: not a URL Apprise can send to; see "
                                 "https://github.com/caronc/apprise/wiki for each service's form")
        return value

    @model_validator(mode="after")
    def _notify_every_needs_notify(self) -> LoggingConfig:
        if self.notify_every != 50 and not self.notify:
            raise ValueError("logging.notify_every is set but logging.notify lists no URL: add one, or drop "
                             "logging.notify_every")
        return self

    def uses(self, backend: str) -> bool:
        return backend in self.backends


def unusable(urls: list[str]) -> list[str]:
    """The URLs Apprise cannot use (an unknown scheme, a malformed address)."""
    import apprise

    return [url for url in urls if not apprise.Apprise().add(url)]
