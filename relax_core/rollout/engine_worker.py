"""The actor that runs one engine server: started by the controller (the rollout engines) and the judge
(rewards/judge_service.py) alike, with Ray; it starts the server as a child process
(`engine_process.py`) with the command line `engine_command.py` builds, waits until it is healthy,
and stops its process group.

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
from relax_core.cluster.ports import listening_socket
from relax_core.config.engines import engine_kind
from relax_core.rollout.engine_command import EngineSettings, engine_command


class EngineWorker:
    """Starts one engine server on this actor's node (and GPUs) and stops it by its process group.

    `settings`: what the run's engines start with, of which this one is number `index`; its command line is
    `engine_command(settings, index, ...)` (rollout/engine_command.py), run by `python`. An engine on GPUs
    runs on the GPUs Ray gave the actor, which CUDA_VISIBLE_DEVICES names, or on `gpus`: colocate on GPUs,
    the ids of the trainer ranks' GPUs it shares (controller/gpu_slots.py).
    """

    def __init__(self, index: int, settings: EngineSettings, log_path: str, api_key: str,
                 cpus: list[int] | None = None, *, python: str = sys.executable, gpus: list[str] | None = None):
        from relax_core.rollout.engine_process import EngineProcess
        from relax_core.rollout.router import ENGINE_KEEP_ALIVE_S, KEEP_ALIVE_ENV

        host = node_ip()  # bind to the cluster's interface only
        kind = engine_kind(settings.engine)
        self.ready_timeout_s = kind.ready_timeout_s
        # The key travels in the environment, which other users cannot read (unlike the command line).
        env = os.environ | {"OMP_NUM_THREADS": str(settings.threads), "RELAX_ENGINE_API_KEY": api_key,
                            KEEP_ALIVE_ENV: str(ENGINE_KEEP_ALIVE_S)}  # why: rollout/router.py (Keep-alive)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        # An engine that binds its port itself is given a port; else it serves on this very socket: its port
        # stays ours.
        sock = None if kind.binds_own_port else listening_socket(host)
        command = partial(engine_command, settings, index, python=python, host=host,
                          fd=None if sock is None else sock.fileno())
        self.server = EngineProcess(f"engine {index}", host, Path(log_path), command, env, cpus=cpus, sock=sock)
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
