"""Fixtures and helpers for tests that run the real CPU engine server.

`EngineServer` starts `python -m relax_core.rollout.cpu_engine` as a
subprocess bound to 127.0.0.1 on a free port, waits for `/health`, and stops
it (by its own PID) afterwards. The session fixtures `tiny_model_dir` and
`engine` (one engine server on that model, key `ENGINE_API_KEY`) are registered
once for all integration modules by tests/integration/conftest.py; a module that
imports one gets a copy of its own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
ENGINE_API_KEY = "engine-test-key-5d1e"  # the shared `engine`'s


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class EngineServer:
    """A CPU engine subprocess; use as a context manager."""

    def __init__(self, model_dir: Path, log_path: Path, api_key: str | None = None, *extra: str) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.base_url = f"http://{HOST}:{self.port}"
        self.log_path = log_path
        self.args = [
            sys.executable, "-m", "relax_core.rollout.cpu_engine",
            "--model-path", str(model_dir), "--host", HOST, "--port", str(self.port), "--seed", "0",
            *(["--api-key", api_key] if api_key else []), *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> EngineServer:
        if self.proc is None:
            self.start()
        self.wait_healthy()
        return self

    def start(self) -> EngineServer:
        """Start the process without waiting for it; pair with `stop()`."""
        log = open(self.log_path, "w")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=subprocess_env())
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"engine not healthy after {timeout}s:\n{self.log()}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random-weight Qwen3 (hidden 64, 2 layers, fp32) with a char tokenizer."""
    from relax_core.models.tiny import materialize_tiny_model

    return materialize_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def engine(tiny_model_dir, tmp_path_factory) -> Iterator[EngineServer]:
    """One engine server on `tiny_model_dir` for every module that only sends it requests.

    Nothing may change its weights, labels or settings (a test that does starts an
    `EngineServer` of its own), and its counters are read as differences, since
    other tests' requests count too.
    """
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with EngineServer(tiny_model_dir, log, ENGINE_API_KEY) as server:
        yield server
