"""One engine server as a child process: started in a session of its own, waited for, stopped as a group.

`EngineWorker` (rollout/engine_worker.py) starts every engine this way:

- the CPU engine is handed a socket that already listens on its port
  (`--fd`), so nobody can take the port between choosing and binding it;
- SGLang cannot be handed a socket and binds its port itself: a free one is
  picked (`candidate_port`), and when another process took it first (what
  this start wrote to the log says "address already in use") the engine is
  started again on a fresh port, up to `BIND_ATTEMPTS` times.

The health wait polls `/health` (SGLang answers 503 until it has loaded and
warmed up) until a deadline; an engine that exits first, or is not healthy in
time, raises `EngineStartError` naming the engine, its URL and its log, with
the tail of what this start wrote there. The server is a `cluster.lifetime.Child`
that dies with the actor: stopping signals its whole process group (SGLang's
scheduler and detokenizer processes are in it), SIGTERM, then SIGKILL to what
is left after `lifetime.STOP_GRACE_S`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

from relax_core.cluster.lifetime import STOP_GRACE_S, Child
from relax_core.cluster.ports import candidate_port

BIND_ATTEMPTS = 5  # fresh ports tried when another process took the picked one first
PORT_TAKEN = "address already in use"  # uvicorn's and the kernel's words, compared in lower case
TAIL_LINES = 20


class EngineStartError(RuntimeError):
    """An engine exited before it was healthy, or was not healthy in time."""


class EngineProcess:
    """One engine server process.

    Args:
        name: how errors call it ("engine 3").
        host: the address it serves on.
        log_path: its stdout and stderr (appended to; created readable by this user only: SGLang
            logs its server arguments, the API key among them).
        command: its argv for a given port (called as `command(port=...)`).
        env: its environment.
        cpus: the cores it runs on (None: the actor's).
        sock: a socket already listening on `host`, handed to the server (the CPU engine); None:
            the server binds a port picked here (SGLang).
    """

    def __init__(self, name: str, host: str, log_path: Path, command: Callable[[int], list[str]],
                 env: dict[str, str], cpus: list[int] | None = None, sock: socket.socket | None = None):
        self.name, self.host, self.log_path, self.command = name, host, Path(log_path), command
        self.env, self.cpus, self.sock = env, cpus, sock
        self.port = sock.getsockname()[1] if sock is not None else 0
        self.proc: Child | None = None
        self._attempts = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Start the server (on a freshly picked port, unless it was handed a socket)."""
        self._attempts += 1
        if self.sock is None:
            self.port = candidate_port(self.host)
        fds = [self.sock.fileno()] if self.sock is not None else []
        # die with the actor: an actor killed by Ray would leave it behind
        self.proc = Child(self.command(port=self.port), log=self.log_path, log_mode=0o600, env=self.env,
                          pass_fds=fds, die_with_parent=True, cpus=self.cpus)
        if self.sock is not None:
            self.sock.close()  # the server holds it now

    def wait_ready(self, timeout_s: float) -> str:
        """Wait until `/health` answers 200; returns the URL. Restarts on a port another process took."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if not self._port_was_taken():
                    raise EngineStartError(f"{self.name} at {self.url} exited with code {self.proc.returncode} "
                                           f"before it was healthy; {self._log_end()}")
                self.proc.stop(grace_s=0)  # what the failed start left (its GPU memory)
                self.start()
                continue
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self.url
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        raise EngineStartError(f"{self.name} at {self.url} not healthy after {timeout_s:.0f} s; {self._log_end()}")

    def _port_was_taken(self) -> bool:
        return (self.sock is None and self._attempts < BIND_ATTEMPTS
                and PORT_TAKEN in self._log_tail(lines=None).lower())

    def _log_end(self) -> str:
        return f"the last lines it wrote to {self.log_path}:\n{self._log_tail()}"

    def _log_tail(self, lines: int | None = TAIL_LINES) -> str:
        """What this start wrote to the log (its last `lines` lines; None: all)."""
        text = self.proc.output() if self.proc is not None else ""
        return text if lines is None else "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left of it after `timeout_s` (idempotent)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.stop(grace_s=timeout_s)
