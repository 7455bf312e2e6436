"""The processes the controller places with Ray: trainer ranks and engine servers.

`TrainerWorker` is one data-parallel rank of the torch backend (rank 0 also
owns the weight broadcaster). `EngineWorker` starts one rollout engine server
(the CPU engine here, SGLang on GPU nodes) as a child process, waits until it
is healthy, and stops it by PID. Both are plain classes; the controller wraps
them with `ray.remote` and places them with the `relax_train` /
`relax_rollout` resources.

No port is chosen and then bound later by someone else: the engine server is
handed a socket already listening on its port, the data-parallel rendezvous
store and the weight-update group listen on port 0 and report the port the
kernel gave them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from relax_core.cluster.lifetime import die_with_parent
from relax_core.cluster.ports import listening_socket
from relax_core.services.critic import RETURN_COLUMN, VALUE_COLUMN

log = logging.getLogger(__name__)
ENGINE_READY_TIMEOUT_S = 300.0
RENDEZVOUS_TIMEOUT = 600  # seconds the data-parallel ranks wait for each other


def node_ip() -> str:
    """The address this node's servers bind to: the one the node was started with
    (RELAX_NODE_IP, set by the executor for every Ray node), else Ray's view."""
    if os.environ.get("RELAX_NODE_IP"):
        return os.environ["RELAX_NODE_IP"]
    import ray

    return ray.util.get_node_ip_address()


def end_actors(ray, actors: list, what: str, method: str = "stop", timeout_s: float = 30) -> None:
    """Call `method` on every actor (it stops what the actor started), then end their processes now,
    not whenever the handles are collected. Shutting down: a failure is reported, the rest go on."""
    refs = [getattr(actor, method).remote() for actor in actors]
    try:
        ray.get(refs, timeout=timeout_s)
    except Exception as exc:
        log.warning("stopping %d %s failed: %s", len(refs), what, exc)
    for actor in actors:
        ray.kill(actor)


def pin_process(cpus: list[int]) -> None:
    """Run every thread of this process (and the threads they start later) on `cpus`.

    `sched_setaffinity(0)` would pin only the calling thread; an actor's
    methods may run on other threads of its pool.
    """
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread ended meanwhile
            pass


def collective_backend() -> str:
    """gloo, also on a node with GPUs: the torch trainer and the cpu engine hold CPU tensors (GPU recipes are
    refused by launch/preflight.py), which an NCCL group cannot carry. NCCL comes with the GPU backends."""
    return "gloo"


class TrainerWorker:
    """One data-parallel training rank; `setup` joins the group and loads the model."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.loop = asyncio.new_event_loop()
        self.broadcaster = None
        self.trainer = None
        self.snapshot = None  # (version, [(name, tensor)]) taken after a step in the asynchronous modes
        self.sent = None  # (version, tensors or None for the live weights) of the last broadcast
        self.store = None  # rank 0: the data-parallel group's rendezvous store, which it hosts
        self.bus = None  # TransferQueue, attached on the first step read from it (asynchronous modes)
        self._prefetched: dict[int, list] = {}  # step -> [read, (samples, columns, seconds) or the error]
        self._prefetch_lock = threading.Lock()

    def rendezvous_address(self) -> str:
        """Rank 0: host the data-parallel group's store on its node; returns its address:port
        ("" for a single rank, which forms no group)."""
        import torch.distributed as dist

        if self.world_size == 1:
            return ""
        host = node_ip()
        sock = listening_socket(host)  # the store takes this socket over: it listens on `host` only
        port = sock.getsockname()[1]
        self.store = dist.TCPStore(host, port, self.world_size, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT), master_listen_fd=sock.detach())
        return f"{host}:{port}"

    def _rendezvous_store(self, master: str):
        import torch.distributed as dist

        if self.store is not None:
            return self.store
        host, _, port = master.rpartition(":")
        return dist.TCPStore(host, int(port), self.world_size, is_master=False,
                             timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT))

    def setup(self, master: str, model_dir: str, config, threads: int, cpus: list[int] | None = None) -> int:
        import torch
        import torch.distributed as dist

        from relax_core.train.torch_backend import TorchTrainer

        if cpus:
            pin_process(cpus)
        torch.set_num_threads(threads)
        if self.world_size > 1:
            dist.init_process_group(collective_backend(), store=self._rendezvous_store(master), rank=self.rank,
                                    world_size=self.world_size)
        self.model_dir = model_dir
        self.trainer = TorchTrainer(model_dir, config)
        return self.rank

    def node_id(self) -> str:
        from relax_core.services.placement import node_id

        return node_id()

    def train_step(self, samples: list, advantages: list[float] | None = None,
                   snapshot_version: int | None = None, ref_logprobs: list | None = None,
                   old_logprobs: list | None = None, values: list | None = None) -> dict[str, float]:
        """One optimizer step. With `snapshot_version` (asynchronous modes, rank 0) the new weights are
        copied aside as that version, so `sync_weights` can broadcast them while the next step trains."""
        metrics = self.trainer.train_step(samples, advantages, ref_logprobs, old_logprobs, values)
        if snapshot_version is not None and self.rank == 0:
            self.snapshot = (snapshot_version, [(n, t.detach().clone()) for n, t in
                                                self.trainer.named_parameters_for_sync()])
        return metrics

    def prefetch(self, meta, fields: tuple[str, ...], step: int) -> None:
        """Read step `step`'s shard (`meta`) from TransferQueue now, while the step before trains."""
        slot = self._slot(step)
        try:
            slot[1] = self._fetch(meta, fields)
        except BaseException as exc:  # raised again by the step that trains on these rows
            slot[1] = exc
        finally:
            slot[0].set()

    def _slot(self, step: int) -> list:
        """[read event, fetched] of a prefetched step (whichever of prefetch and train comes first makes it)."""
        import threading

        with self._prefetch_lock:
            return self._prefetched.setdefault(step, [threading.Event(), None])

    def train_from_bus(self, meta, fields: tuple[str, ...], snapshot_version: int) -> dict[str, Any]:
        """One optimizer step on the rows `meta` claims, read here straight from TransferQueue (the
        driver handed over their metadata only), or (`meta` None) on those `prefetch` read for step
        `snapshot_version`. With the critic service, the step's GAE returns of these rows are written
        back as their `returns` column (the critic's targets). Returns the metrics and which samples
        were trained on (ids and policy versions), for the driver's exactly-once and staleness checks."""
        if meta is None:
            slot = self._slot(snapshot_version)
            slot[0].wait()
            with self._prefetch_lock:
                fetched = self._prefetched.pop(snapshot_version)[1]
            if isinstance(fetched, BaseException):
                raise RuntimeError(f"step {snapshot_version}: reading its rows from TransferQueue failed") from fetched
        else:
            fetched = self._fetch(meta, fields)
        meta, samples, extra, fetch_s = fetched
        metrics = self.train_step(samples, extra.get("advantages"), snapshot_version, extra.get("ref_logprobs"),
                                  extra.get("old_logprobs"), extra.get(VALUE_COLUMN))
        if self.trainer.config.critic_service:
            self.bus.write(meta, RETURN_COLUMN, self.trainer.last_returns)
        return {"metrics": metrics | {"fetch_s": fetch_s}, "sample_ids": [s.sample_id for s in samples],
                "versions": [s.policy_version for s in samples]}

    def _fetch(self, meta, fields: tuple[str, ...]) -> tuple[Any, list, dict, float]:
        from relax_core.data.bus import SampleBus

        with self._prefetch_lock:  # a step's read and the next one's prefetch may both come first
            if self.bus is None:
                self.bus = SampleBus.attach()
        start = time.perf_counter()
        samples, extra = self.bus.fetch(meta, fields)
        return meta, samples, extra, time.perf_counter() - start

    def policy_weights(self, version: int | None = None) -> tuple[int, list]:
        """Rank 0: `(version, [(name, tensor), ...])` for the actor-forward service: the newest snapshot
        (asynchronous modes, while the next step trains), or (`version` given, nothing training) the
        live weights as that version."""
        if version is None and self.snapshot is not None:
            return self.snapshot
        version = self.trainer.step if version is None else version
        return version, [(n, t.detach().clone()) for n, t in self.trainer.named_parameters_for_sync()]

    def connect_engines(self, urls: list[str], api_key: str, bucket_bytes: int) -> None:
        """Rank 0: form the weight-update group with every engine."""
        from relax_core.rollout.client import EngineClient
        from relax_core.weights.sync import WeightBroadcaster

        host = node_ip()
        self.api_key = api_key
        clients = [EngineClient(url, api_key=api_key) for url in urls]
        self.broadcaster = WeightBroadcaster(clients, host, backend=collective_backend(), bucket_bytes=bucket_bytes)
        self.loop.run_until_complete(self.broadcaster.init())

    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        """Rank 0: broadcast weights to every engine. `version` given: the live weights as that version
        (colocate: nothing trains meanwhile); None: the newest snapshot (asynchronous modes)."""
        if self.broadcaster is None:
            return {}
        if version is None:
            version, tensors = self.snapshot
        else:
            tensors = None  # live weights, read lazily bucket by bucket
        self.sent = (version, tensors)
        return self._broadcast(version, tensors)

    def _broadcast(self, version: int, tensors: list | None) -> dict[str, float]:
        named = tensors if tensors is not None else self.trainer.named_parameters_for_sync()
        stats = self.loop.run_until_complete(self.broadcaster.broadcast(named, version))
        return {"sync_bytes": float(stats.total_bytes), "sync_buckets": float(stats.num_buckets),
                "sync_version": float(version)}

    def set_engines(self, urls: list[str], resend: bool = True) -> None:
        """Rank 0: re-form the weight group for a new set of engines (one added or removed between
        steps); with `resend`, broadcast the weights last sent again, so an added engine holds the
        version every other engine holds before it gets a request."""
        from relax_core.rollout.client import EngineClient

        clients = [EngineClient(url, api_key=self.api_key) for url in urls]
        self.loop.run_until_complete(self.broadcaster.set_engines(clients))
        if resend and self.sent is not None:
            self._broadcast(*self.sent)

    def save_checkpoint(self, ckpt_dir: str, iteration: int, extra: dict[str, Any], keep_last: int,
                        critic: dict | None = None) -> str:
        """Save this rank's state (every rank calls it); `critic`: the critic service's state (rank 0,
        fully_async), saved under the "critic" key, where the trainer's own critic would be."""
        from relax_core.checkpoint import save_checkpoint

        state = {**self.trainer.state_dict(), **({"critic": critic} if critic is not None else {}), "progress": extra}
        return str(save_checkpoint(ckpt_dir, iteration, state, keep_last=keep_last, hf_dir=self.model_dir))

    def load_checkpoint(self, ckpt_dir: str) -> dict[str, Any]:
        """Load the latest checkpoint into this rank; returns the saved progress."""
        from relax_core.checkpoint import load_checkpoint

        state = {**self.trainer.state_dict(), "progress": {}}
        load_checkpoint(ckpt_dir, state)
        self.trainer.load_state_dict({k: v for k, v in state.items() if k != "progress"})
        return state["progress"]

    def close(self) -> None:
        if self.broadcaster is not None:
            self.loop.run_until_complete(self.broadcaster.close())
        if self.bus is not None:
            self.bus.close()


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
    """Starts one engine server process and stops it by PID."""

    def __init__(self, index: int, model_dir: str, log_path: str, api_key: str,
                 threads: int, seed: int, max_running_requests: int, cpus: list[int] | None = None,
                 trust_remote_code: bool = False):
        self.host = node_ip()  # bind to the cluster's interface only
        sock = listening_socket(self.host)  # the engine serves on this very socket: its port stays ours
        self.port = sock.getsockname()[1]
        self.log_path = Path(log_path)
        command = [
            sys.executable, "-m", "relax_core.rollout.cpu_engine", "--model-path", model_dir, "--host", self.host,
            "--port", str(self.port), "--fd", str(sock.fileno()), "--num-threads", str(threads),
            "--seed", str(seed + index), "--max-running-requests", str(max_running_requests), "--weight-version", "0",
        ] + (["--trust-remote-code"] if trust_remote_code else [])
        # The key travels in the environment, which other users cannot read (unlike the command line).
        env = os.environ | {"OMP_NUM_THREADS": str(threads), "RELAX_ENGINE_API_KEY": api_key}
        parent = os.getpid()
        with self.log_path.open("ab") as log, sock:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         pass_fds=[sock.fileno()], start_new_session=True,
                                         preexec_fn=lambda: _in_child(parent, cpus))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def node_id(self) -> str:
        from relax_core.services.placement import node_id

        return node_id()

    def wait_ready(self, timeout_s: float = ENGINE_READY_TIMEOUT_S) -> str:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with code {self.proc.returncode}; see {self.log_path}:\n"
                                   f"{self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self.url
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"engine not healthy after {timeout_s:.0f}s; see {self.log_path}")

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
