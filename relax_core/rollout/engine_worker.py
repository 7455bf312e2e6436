"""The actor that runs one engine server: started by the controller (the rollout engines) and the judge
(rewards/judge_service.py) alike, with Ray; it starts the server as a child process
(`engine_process.py`), waits until it is healthy, and stops its process group.

The CPU engine is handed a socket already listening on its port, so no port is
chosen and then bound later by someone else; SGLang, which cannot be, is
restarted on a fresh port when its port was taken (`engine_process.py`).
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path

from relax_core.cluster.actors import node_ip
from relax_core.cluster.lifetime import die_with_parent
from relax_core.cluster.ports import listening_socket
from relax_core.config.engines import engine_kind


def _in_child(parent_pid: int, cpus: list[int] | None) -> None:
    """In the engine's process before it starts: die with the actor, run on the given cores.

    The engine runs in its own session (so a Ctrl-C meant for the driver does
    not reach it); without dying with the actor, an actor killed by Ray would
    leave it behind.
    """
    die_with_parent(parent_pid)
    if cpus:
        os.sched_setaffinity(0, cpus)


class EngineWorker:
    """Starts one engine server on this actor's node (and GPUs) and stops it by its process group.

    `engine`: "cpu" (Relax's own engine) or "sglang" (`sglang.launch_server` with `--tp-size tp_size` on
    the GPUs Ray gave the actor, which CUDA_VISIBLE_DEVICES names, or on `gpus`: colocate on GPUs, the ids
    of the trainer ranks' GPUs it shares, controller/gpu_slots.py); `engine_args`: the recipe's
    `rollout.engine_args` (checked at submit); `python`: the interpreter that runs the server.
    """

    def __init__(self, index: int, model_dir: str, log_path: str, api_key: str,
                 threads: int, seed: int, max_running_requests: int, cpus: list[int] | None = None,
                 trust_remote_code: bool = False, *, engine: str = "cpu", engine_args: dict | None = None,
                 tp_size: int = 1, python: str = sys.executable, gpus: list[str] | None = None,
                 video: dict | None = None):
        from relax_core.rollout.engine_process import EngineProcess
        from relax_core.rollout.router import ENGINE_KEEP_ALIVE_S, KEEP_ALIVE_ENV

        host = node_ip()  # bind to the cluster's interface only
        kind = engine_kind(engine)
        self.ready_timeout_s = kind.ready_timeout_s
        # The key travels in the environment, which other users cannot read (unlike the command line).
        env = os.environ | {"OMP_NUM_THREADS": str(threads), "RELAX_ENGINE_API_KEY": api_key,
                            KEEP_ALIVE_ENV: str(ENGINE_KEEP_ALIVE_S)}  # why: rollout/router.py (Keep-alive)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        parent = os.getpid()
        common = dict(model_dir=model_dir, host=host, seed=seed + index, max_running_requests=max_running_requests,
                      trust_remote_code=trust_remote_code, python=python)
        if kind.binds_own_port:
            from relax_core.rollout.sglang_engine import INITIAL_WEIGHT_VERSION, server_command

            sock = None
            command = partial(server_command, tp_size=tp_size, weight_version=INITIAL_WEIGHT_VERSION,
                              engine_args=engine_args or {}, **common)
        else:
            sock = listening_socket(host)  # the engine serves on this very socket: its port stays ours
            command = partial(cpu_engine_command, fd=sock.fileno(), threads=threads, video=video, **common)
        self.server = EngineProcess(f"engine {index}", host, Path(log_path), command, env,
                                    preexec_fn=lambda: _in_child(parent, cpus), sock=sock)
        self.server.start()

    @property
    def url(self) -> str:
        return self.server.url

    def node_id(self) -> str:
        from relax_core.cluster.actors import node_id

        return node_id()

    def where(self) -> str:
        """The name of the node the engine runs on (Slurm's, else the host's)."""
        import socket

        return os.environ.get("SLURMD_NODENAME") or socket.gethostname()

    def pid(self) -> int:
        """The engine server's process id (what `relax status` shows, and an operator may signal)."""
        return self.server.proc.pid

    def wait_ready(self, timeout_s: float | None = None) -> str:
        """The engine's URL once it is healthy (`timeout_s`: default, the engine kind's own limit)."""
        return self.server.wait_ready(timeout_s or self.ready_timeout_s)

    def stop(self) -> None:
        self.server.stop()


def cpu_engine_command(*, python: str, model_dir: str, host: str, port: int, fd: int, threads: int, seed: int,
                       max_running_requests: int, trust_remote_code: bool, video: dict | None = None) -> list[str]:
    """The argv of one CPU engine server (`fd`: its listening socket; the API key is in its environment;
    `video`: the data set's `video_fps` / `video_min_frames` / `video_max_frames`)."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in (video or {}).items()]
    return [
        python, "-m", "relax_core.rollout.cpu_engine", "--model-path", model_dir, "--host", host,
        "--port", str(port), "--fd", str(fd), "--num-threads", str(threads),
        "--seed", str(seed), "--max-running-requests", str(max_running_requests), "--weight-version", "0",
    ] + (["--trust-remote-code"] if trust_remote_code else []) + flags
