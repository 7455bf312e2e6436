"""A run's ClearML task (`logging.backends: [clearml]`), one across resumes and requeues.

- Offline by default: compute nodes of many clusters have no route out, so the
  task is written under RUN/clearml/offline/<task id>/ (ClearML's offline
  session: task.json, metrics.jsonl, log.jsonl, and <task id>.zip at each
  close), to be uploaded later with ClearML's own
  `clearml-task --import-offline-session RUN/clearml/offline/<task id>.zip`.
  `CLEARML_OFFLINE_MODE=0` in the driver's environment reports to the server
  of the user's clearml.conf (or `CLEARML_API_*` variables) instead.
- One task for the Relax run: its id is kept in RUN/clearml_task_id, and every
  later attempt (a resume, a Slurm requeue) continues it
  (`Task.init(continue_last_task=<id>)`, the offline session's folder too) with
  no iteration offset, so iterations are Relax's steps. Steps an interrupted
  attempt logged after its checkpoint are reported again by the next one, as
  with W&B; metrics.jsonl and TensorBoard drop them. A run keeps the mode
  (offline or online) of its first attempt.
- ClearML runs in a child process of the driver (`python -m
  relax_core.metrics.clearml_run`), fed one JSON line per step on its stdin:
  `Task.init` installs SIGINT/SIGTERM handlers and an exception hook of its own
  and patches `os.fork` in the process that calls it, where the driver has its
  own (preemption). The child keeps ClearML's reporter in a thread: its default
  on Linux, a forked reporter process, waits 5 to 6 s at every flush and close.
  It ends when its stdin closes, so it never outlives the driver.
- Nothing that may hold a token is recorded: the configuration is the recipe
  without the values of its environment variables (`public_recipe`); the
  child's environment holds only what ClearML and Python need (no variable of
  the driver's besides those, so a clearml.conf that logs environment variables
  finds none of the run's); and neither the repository, the script, its
  requirements, the console output nor any framework is captured.
- clearml is imported only in that child, and only when the recipe lists it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ID_FILE = "clearml_task_id"
FOLDER = "clearml"  # RUN/clearml: ClearML's cache directory for the run, its offline sessions in offline/
# No framework hook and no repository detection (ClearML would record the git diff, which may hold anything)
NOTHING_CAPTURED = {name: False for name in (
    "matplotlib", "tensorflow", "tensorboard", "pytorch", "xgboost", "scikit", "fastai", "lightgbm", "hydra",
    "detect_repository", "tfdefines", "joblib", "megengine", "catboost", "gradio")}
START_TIMEOUT_S = 120  # Task.init (online: ClearML retries an unreachable server for minutes)
CLOSE_TIMEOUT_S = 60
# What the child's environment keeps of the driver's (besides ClearML's own CLEARML_* and TRAINS_*): what
# Python, ClearML's configuration and an online connection (certificates, proxies) read.
KEPT_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV",
            "CONDA_PREFIX", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
            "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")


def child_env(run_dir: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The ClearML child's environment: the kept variables, ClearML's own, its cache in the run directory,
    offline unless the driver's environment says `CLEARML_OFFLINE_MODE=0`."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if k in KEPT_ENV or k.startswith(("CLEARML_", "TRAINS_"))}
    # this process's relax_core, whatever put it on sys.path (an install, a checkout on PYTHONPATH)
    source = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([source, *filter(None, [env.get("PYTHONPATH")])])
    env["CLEARML_CACHE_DIR"] = str(run_dir / FOLDER)
    env.setdefault("CLEARML_OFFLINE_MODE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class ClearMLRun:
    """Started at the first `log`; `close` ends its task (the child process closes it and exits)."""

    def __init__(self, run_dir: Path, project: str, task_name: str, config: dict[str, Any], log_path: Path):
        self.run_dir, self.project, self.task_name, self.config = run_dir, project, task_name, config
        self.log_path = log_path  # the child's output (ClearML's own messages)
        self._child: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        id_file = self.run_dir / ID_FILE
        previous = id_file.read_text().strip() if id_file.exists() else None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=out, env=child_env(self.run_dir), cwd=self.run_dir, text=True)
        self._child = child
        self._send({"project": self.project, "task": self.task_name, "continue": previous, "config": self.config})
        answer = _read_line(child, START_TIMEOUT_S)  # read at call time (a test shortens it)
        if not answer or "task_id" not in answer:
            child.kill()  # it may still be trying to reach a server
            self.close()
            raise RuntimeError(f"logging.backends: the ClearML task did not start (its log: {self.log_path})")
        if answer["task_id"] != previous:
            partial = id_file.with_name(f".{ID_FILE}.{os.getpid()}")
            partial.write_text(answer["task_id"] + "\n")
            os.replace(partial, id_file)
        return child

    def _send(self, message: dict) -> None:
        try:
            self._child.stdin.write(json.dumps(message) + "\n")
            self._child.stdin.flush()
        except (BrokenPipeError, OSError) as error:
            raise RuntimeError(f"logging.backends: the ClearML process ended (its log: {self.log_path})") from error

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self._child is None:
            self._start()
        values = {k: v for k, v in metrics.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        self._send({"step": step, "metrics": values})

    def close(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        try:
            child.stdin.close()  # the child closes its task (writes the offline session's zip) and exits
        except OSError:
            pass
        try:
            child.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        child.stdout.close()


def _read_line(child: subprocess.Popen, timeout_s: float) -> dict | None:
    """The child's next answer, or None once it ended or after `timeout_s`."""
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(child.stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            return None
    line = child.stdout.readline()
    return json.loads(line) if line.strip() else None


# ------------------------------------------------------------------ the child process
def _serve() -> int:
    """Read the task's settings, start (or continue) it, answer its id, then report each step's line until
    stdin closes."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # ClearML prints to stdout: into the log, not into the answers
    sys.stdout = sys.stderr
    settings = json.loads(sys.stdin.readline())
    from clearml import Task
    from clearml.backend_interface.task.task import Task as TaskBackend

    TaskBackend._report_subprocess_enabled = False  # the reporter as a thread (see the module docstring)
    Task.set_offline(os.environ.get("CLEARML_OFFLINE_MODE", "1").lower() not in ("0", "false", "no"))
    task = Task.init(project_name=settings["project"], task_name=settings["task"], reuse_last_task_id=False,
                     continue_last_task=settings["continue"] or False, auto_connect_arg_parser=False,
                     auto_connect_frameworks=NOTHING_CAPTURED, auto_resource_monitoring=False,
                     auto_connect_streams=False)
    task.set_initial_iteration(0)  # iterations are Relax's steps, also in a continued task
    if not settings["continue"]:
        task.connect_configuration(settings["config"], name="recipe")
    answers.write(json.dumps({"task_id": task.id}) + "\n")
    answers.flush()
    logger = task.get_logger()
    for line in sys.stdin:
        row = json.loads(line)
        for name, value in row["metrics"].items():
            logger.report_scalar(title=name, series=name, value=value, iteration=row["step"])
    task.close()
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
