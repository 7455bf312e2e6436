"""Notifications of a run's events to the services its recipe names (`logging.notify`), through Apprise.

    started           job id, run directory
    every K steps     step, reward (and its trend), throughput, staleness   (`logging.notify_every`)
    checkpoint        the step saved, and where
    engine restarted  which engine, why, how long it took (controller/recovery.py)
    stopped           preempted or signalled: the last completed step is checkpointed
    requeued          the Slurm job goes back to the queue and resumes from it (entrypoints/slurm_job.py)
    finished          steps, final reward, wall time
    failed            the cause and the log to read

Each URL is an Apprise URL (`mailto://`, `slack://`, `matrix://`, `ntfy://`, `json://` for a webhook
of one's own, ...; https://github.com/caronc/apprise/wiki). Messages go out from a thread of their own,
in order; a notifier that is down or slow is logged and never slows or fails the run. The URLs often
hold a token: put them in the environment and write `${NTFY_URL}` in the recipe (the W&B config
leaves such values out, metrics/wandb_run.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

log = logging.getLogger(__name__)
CLOSE_WAIT_S = 15.0  # at the end of a run, the last messages get this long to go out


class Notifier:
    """Sends a run's events to `urls` (none: it does nothing and imports nothing)."""

    def __init__(self, urls: list[str], run_name: str, every: int = 0):
        self.run_name, self.every = run_name, every
        self._queue: queue.Queue = queue.Queue()
        self._apprise = None
        self._thread = None
        self._rewards: list[float] = []
        self._started = time.monotonic()
        if urls:
            import apprise

            self._apprise = apprise.Apprise()
            for url in urls:
                self._apprise.add(url)
            self._thread = threading.Thread(target=self._send_all, name="relax-notify", daemon=True)
            self._thread.start()

    @property
    def active(self) -> bool:
        return self._apprise is not None

    # ------------------------------------------------------------ events
    def send(self, event: str, body: str, kind: str = "info") -> None:
        """Queue one message (`kind`: info, success, warning, failure: Apprise's notify types)."""
        if self.active:
            self._queue.put((f"relax {self.run_name}: {event}", body, kind))

    def started(self, run_dir: str, job_id: str | None, steps: int) -> None:
        where = f"Slurm job {job_id}" if job_id else "this machine"
        self.send("started", f"{steps} steps on {where}; run directory {run_dir}")

    def step(self, step: int, total: int, metrics: dict[str, Any]) -> None:
        """Every `every` steps: a summary of the step."""
        reward = metrics.get("reward_mean")
        if isinstance(reward, (int, float)):
            self._rewards.append(float(reward))
        if not self.active or not self.every or step % self.every:
            return
        parts = [f"step {step}/{total}"]
        if reward is not None:
            recent = self._rewards[-self.every:]
            parts.append(f"reward {reward:.3f} (mean of the last {len(recent)}: {sum(recent) / len(recent):.3f})")
        for key, label, fmt in (("tokens_per_s", "throughput", "{:,.0f} tok/s"),
                                ("samples_per_s", "", "{:.1f} samples/s"),
                                ("staleness_max", "staleness max", "{:.0f}")):
            if isinstance(metrics.get(key), (int, float)):
                parts.append(f"{label} {fmt.format(metrics[key])}".strip())
        self.send(f"step {step}", ", ".join(parts))

    def checkpoint(self, step: int, where: str) -> None:
        self.send("checkpoint", f"step {step} saved in {where}")

    def engine_restarted(self, record: dict[str, Any]) -> None:
        if record.get("left_out"):
            self.send("engine left out", f"engine {record['engine']} failed ({record['reason']}) past "
                                         f"recovery.max_engine_restarts; the run goes on with {record['serving']} "
                                         "engine(s)", "warning")
            return
        self.send("engine restarted", f"engine {record['engine']} failed ({record['reason']}); "
                                      f"{record['new_url']} serves in its place after {record['took_s']:.1f}s",
                  "warning")

    def restarted(self, count: int, limit: int, cause: str, step: int) -> None:
        """The job failed and starts again from its checkpoint of `step` (controller/restarts.py)."""
        where = f"its checkpoint of step {step}" if step else "the start (no checkpoint yet)"
        self.send("restarted", f"{cause}; restarting from {where} (restart {count} of at most {limit})", "warning")

    def stopped(self, step: int) -> None:
        self.send("stopped", f"preempted or signalled at step {step}; the last completed step is checkpointed",
                  "warning")

    def requeued(self, job_id: str, step: int) -> None:
        self.send("requeued", f"Slurm job {job_id} is back in the queue; it resumes from step {step}", "warning")

    def finished(self, steps: int) -> None:
        reward = f", final reward {self._rewards[-1]:.3f}" if self._rewards else ""
        self.send("finished", f"{steps} steps in {time.monotonic() - self._started:.0f}s{reward}", "success")

    def failed(self, cause: str, log_path: str) -> None:
        self.send("failed", f"{cause}; see {log_path}", "failure")

    # ------------------------------------------------------------ delivery
    def _send_all(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            title, body, kind = item
            try:
                if not self._apprise.notify(title=title, body=body, notify_type=kind):
                    log.warning("a notification (%s) was not delivered to every logging.notify URL", title)
            except Exception as exc:  # a notifier never ends the run
                log.warning("notification %s failed: %s", title, exc)
            finally:
                self._queue.task_done()

    def close(self) -> None:
        """Send what is queued (for at most CLOSE_WAIT_S), then stop."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout=CLOSE_WAIT_S)
        if self._thread.is_alive():
            log.warning("notifications still unsent after %.0fs are dropped", CLOSE_WAIT_S)
        self._thread = None
