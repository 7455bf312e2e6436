"""The trainer ranks the controller places with Ray (engine servers: rollout/engine_worker.py).

`TrainerWorker` is one rank of the trainer world (the torch backend's data-parallel
ranks, or the megatron backend's data x tensor x pipeline grid; rank 0 also
owns the weight broadcaster). It is a plain class; the controller wraps it with
`ray.remote` and places it with the `relax_train` resource.

No port is chosen and then bound later by someone else: the data-parallel rendezvous
store and the weight-update group listen on port 0 and report the port the
kernel gave them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from relax_core.cluster.actors import accelerator, node_ip, pin_process
from relax_core.cluster.ports import listening_socket

log = logging.getLogger(__name__)
RENDEZVOUS_TIMEOUT = 600  # seconds the data-parallel ranks wait for each other


def collective_backend(device: str = "cpu") -> str:
    """The trainers' group: NCCL between ranks on GPUs, gloo between ranks on CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


def trainer_device(config) -> str:
    """The trainer rank's device as its config says (`accelerator`)."""
    return accelerator(config.device, "cluster.train.gpus_per_node")


def set_aside(named, parameters) -> list:
    """`(name, tensor)` pairs that later steps leave alone, in host memory: rank 0 keeps the whole weights
    for engines on GPUs of their own, which the broadcaster moves to the GPU a bucket at a time
    (`weights/sync.py`), so its GPU never holds a second whole model (a 32B model's 64 GB in bf16). On the
    host a tensor is copied only when it shares its storage with a parameter (one gathered from shards,
    or cast to the compute dtype, is apart already)."""
    owned = None
    kept = []
    for name, tensor in named:
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        else:
            if owned is None:
                owned = {_storage(p) for p in parameters} - {None}
            if _storage(tensor) in owned:
                tensor = tensor.clone()
        kept.append((name, tensor))
    return kept


def _storage(tensor) -> int | None:
    """Where a tensor's storage starts (an FSDP2 parameter's: its local shard's); None when it has none."""
    tensor = getattr(tensor, "_local_tensor", tensor)
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


@dataclasses.dataclass(frozen=True)
class RankSetup:
    """What each trainer rank loads, and how (`Job` makes it from the recipe; `TrainerWorker.setup`).

    Args:
        config: the trainer's `TrainConfig` (train/settings.py `trainer_config`).
        threads, cpus: torch threads; the cores to pin the rank to (None: not pinned).
        keep_live (sharded): rank 0 keeps the whole weights after every change (`_gather_live`); off where
            every rank hands its own buckets over instead (engines on the trainer ranks' GPUs).
        checkpoint_names (SGLang engines): weights go to the engines under the model directory's own names
            (`hf_media.checkpoint_named`: a multimodal model's differ from its parameters').
        megatron (`MegatronOptions`): the megatron backend with this parallel layout; None: torch/FSDP2.
        bus: the rows come from TransferQueue (asynchronous modes), imported at set-up rather than in the
            first step's read.
        overlap: the engines generate while the ranks train (asynchronous modes): what rank 0 sends them is
            a copy that later steps leave alone, so a resend (an engine joins or replaces one) gives the
            version it is labelled with, never the weights trained since.
    """

    model_dir: str
    config: Any
    threads: int
    cpus: list[int] | None = None
    keep_live: bool = True
    checkpoint_names: bool = False
    megatron: Any = None
    bus: bool = False
    overlap: bool = False


class TrainerWorker:
    """One data-parallel training rank; `setup` joins the group and loads the model."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.loop = asyncio.new_event_loop()
        self.broadcaster = None
        self._engine_names = None  # setup: renames the weights for SGLang engines (checkpoint_names)
        self.trainer = None
        self.snapshot = None  # (version, [(name, tensor)]) taken after a step in the asynchronous modes
        self.live = None  # sharded trainer, rank 0: the whole current weights (`_gather_live`)
        self.sent = None  # (version, tensors or None for the live weights) of the last broadcast
        self.store = None  # rank 0: the data-parallel group's rendezvous store, which it hosts
        self.bus = None  # TransferQueue, attached on the first step read from it (asynchronous modes)
        self._prefetched: dict[int, list] = {}  # step -> [read, (samples, columns, seconds) or the error]
        self._prefetch_lock = threading.Lock()

    def process(self) -> dict:
        """This rank's process id and node name: run.json lists them (an operator may signal one), and a
        rank that does not answer this is gone."""
        return {"rank": self.rank, "pid": os.getpid(),
                "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname()}

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

    def setup(self, master: str, how: RankSetup) -> int:
        """Join the group (rank 0's rendezvous at `master`) and load the model as `how` says."""
        import torch
        import torch.distributed as dist

        if how.cpus:
            pin_process(how.cpus)
        torch.set_num_threads(how.threads)
        config, model_dir, megatron = how.config, how.model_dir, how.megatron
        device = trainer_device(config)
        if self.world_size > 1:
            dist.init_process_group(collective_backend(device), store=self._rendezvous_store(master),
                                    rank=self.rank, world_size=self.world_size)
        self.model_dir = model_dir
        self._engine_names = None
        self._fuse = None  # megatron backend, MoE: per-expert tensors -> the transformers model's fused ones
        if how.checkpoint_names:
            from relax_core.checkpoint.hf_media import checkpoint_named

            self._engine_names = checkpoint_named(model_dir)
        self.keep_live, self.overlap = how.keep_live, how.overlap
        config = dataclasses.replace(config, device=device)
        if megatron is not None:
            from relax_core.train.megatron.hf_weights import transformers_named
            from relax_core.train.megatron.trainer import MegatronTrainer

            self.trainer = MegatronTrainer(model_dir, config, megatron.parallel,
                                           distributed_optimizer=megatron.distributed_optimizer)
            self._fuse = transformers_named(self.trainer.hf_config)
            if not how.checkpoint_names:  # the CPU engine loads by the transformers model's parameter names
                self._engine_names = self._fuse
        else:
            from relax_core.train.torch_backend import TorchTrainer

            self.trainer = TorchTrainer(model_dir, config)
        self._gather_live()
        if how.bus:
            from relax_core.data.bus import import_tq

            import_tq()
        return self.rank

    @property
    def _collective(self) -> bool:
        """Reading the whole weights takes every rank (FSDP's shards; Megatron's TP/PP/EP shards)."""
        return bool(getattr(self.trainer, "collective_weights", self.trainer.sharded))

    def _gather_live(self) -> None:
        """Sharded: gather the weights whole after every change (every rank takes part), rank 0 keeping
        them, so what reads the live weights on rank 0 alone (weight sync,
        an added engine's resend) needs no other rank. Unsharded, rank 0 reads its own parameters."""
        if not (self._collective and self.keep_live):
            return
        gathered = set_aside(self.trainer.named_parameters_for_sync(), self.trainer.model.parameters())
        self.live = gathered if self.rank == 0 else None

    def _live_weights(self):
        """Rank 0: (name, tensor) of the current weights, full and in the compute dtype."""
        return iter(self.live) if self._collective else self.trainer.named_parameters_for_sync()

    def node_id(self) -> str:
        from relax_core.cluster.actors import node_id

        return node_id()

    def train_step(self, samples: list, advantages: list[float] | None = None,
                   snapshot_version: int | None = None, ref_logprobs: list | None = None) -> dict[str, float]:
        """One optimizer step. With `snapshot_version` (asynchronous modes, rank 0) the new weights are
        copied aside as that version, so `sync_weights` can broadcast them while the next step trains."""
        metrics = self.trainer.train_step(samples, advantages, ref_logprobs)
        self._gather_live()
        if snapshot_version is not None and self.rank == 0:
            self.snapshot = (snapshot_version, self._set_aside_live())
        return metrics

    def _set_aside_live(self) -> list:
        """Rank 0: the current weights, which later steps leave alone (`live` is gathered anew each step)."""
        return self.live if self._collective else set_aside(self._live_weights(), self.trainer.model.parameters())

    def offload(self, parts: list[str]) -> None:
        """Hand this rank's GPU back to the engines that share it (colocate on GPU nodes): `parts` "optimizer"
        (gradients, optimizer and critic state, reference: what a hand-over does not read), "model"."""
        self.trainer.offload(parts)

    def reload(self) -> None:
        """Take the GPU again (the engines released their memory): everything `offload` moved."""
        self.trainer.reload()

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
        `snapshot_version`. Returns the metrics and which samples were trained on (ids, and for each how many
        of its tokens each policy version generated), for the driver's exactly-once and per-token staleness
        checks."""
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
        metrics = self.train_step(samples, extra.get("advantages"), snapshot_version, extra.get("ref_logprobs"))
        return {"metrics": metrics | {"fetch_s": fetch_s}, "sample_ids": [s.sample_id for s in samples],
                "versions": [s.version_counts() for s in samples]}

    def _fetch(self, meta, fields: tuple[str, ...]) -> tuple[Any, list, dict, float]:
        from relax_core.data.bus import SampleBus

        with self._prefetch_lock:  # a step's read and the next one's prefetch may both come first
            if self.bus is None:
                self.bus = SampleBus.attach()
        start = time.perf_counter()
        samples, extra = self.bus.fetch(meta, fields)
        return meta, samples, extra, time.perf_counter() - start

    def connect_engines(self, urls: list[str], api_key: str, bucket_bytes: int, ranks_per_engine: int,
                        backend: str, sources: dict[str, list[int]] | None = None) -> None:
        """Rank 0: form the weight-update group with every engine (`ranks_per_engine`: each engine's TP
        ranks; `backend`: "nccl" to engines on GPUs); with `sources` (engines on the trainer ranks' GPUs:
        url -> the trainer rank on each of its GPUs), hand the weights over by reference instead
        (weights/ipc.py, `hand_over_weights`)."""
        from relax_core.rollout.client import EngineClient
        from relax_core.weights.ipc import TensorHandover
        from relax_core.weights.sync import WeightBroadcaster

        host = node_ip()
        self.api_key = api_key
        clients = [EngineClient(url, api_key=api_key) for url in urls]
        if sources is not None:
            self.broadcaster = TensorHandover(clients, host, bucket_bytes, ranks_per_engine, sources, rank=0,
                                              world_size=self.world_size)
        else:
            self.broadcaster = WeightBroadcaster(clients, host, backend=backend, bucket_bytes=bucket_bytes,
                                                 ranks_per_engine=ranks_per_engine)
        self.loop.run_until_complete(self.broadcaster.init())

    def hand_over_weights(self, version: int) -> dict[str, float]:
        """Every rank (engines on the trainer ranks' GPUs): the live weights, gathered bucket by bucket in
        step, handed by each rank to the engine ranks on its GPU as `version`; rank 0 talks to the engines."""
        from relax_core.weights.ipc import TensorHandover

        if self.broadcaster is None:  # rank > 0: rank 0 tells it the engines' sources and the bucket size
            self.broadcaster = TensorHandover([], node_ip(), rank=self.rank, world_size=self.world_size)
        stats = self.loop.run_until_complete(
            self.broadcaster.broadcast(self._for_engines(self.trainer.named_parameters_for_sync()), version))
        self.sent = (version, None)
        return {"sync_bytes": float(stats.total_bytes), "sync_buckets": float(stats.num_buckets),
                "sync_version": float(version)}

    def sync_weights(self, version: int | None = None, while_generating: bool = False) -> dict[str, float]:
        """Rank 0: broadcast weights to every engine. `version` given: the live weights as that version
        (colocate: nothing trains meanwhile; asynchronous modes, a resume's: a copy, as later steps train
        while the engines keep it); None: the newest snapshot (asynchronous modes, where the engines may be
        generating: `while_generating`, weights/sync.py)."""
        if self.broadcaster is None:
            return {}
        if version is None:
            version, tensors = self.snapshot
        elif self.overlap:
            tensors = self._set_aside_live()
        else:
            tensors = None  # live weights, read lazily bucket by bucket
        self.sent = (version, tensors)
        return self._broadcast(version, tensors, while_generating)

    def _broadcast(self, version: int, tensors: list | None, while_generating: bool = False) -> dict[str, float]:
        named = tensors if tensors is not None else self._live_weights()
        with quick_gil_handoff(while_generating):
            stats = self.loop.run_until_complete(self.broadcaster.broadcast(self._for_engines(named), version,
                                                                            while_generating))
        return {"sync_bytes": float(stats.total_bytes), "sync_buckets": float(stats.num_buckets),
                "sync_version": float(version), "sync_paused_s": stats.paused_s}

    def _for_engines(self, named):
        """(name, tensor) as the engines load them (`setup`'s `checkpoint_names`)."""
        return named if self._engine_names is None else self._engine_names(named)

    def set_engines(self, urls: list[str], resend: bool = True) -> None:
        """Rank 0: re-form the weight group for a new set of engines (one added or removed between
        steps); with `resend`, broadcast the weights last sent again, so an added engine holds the
        version every other engine holds before it gets a request. After a broadcast that failed half-way
        they are sent again in any case: the engines left hold part of that version under their old label."""
        from relax_core.rollout.client import EngineClient

        clients = [EngineClient(url, api_key=self.api_key) for url in urls]
        self.loop.run_until_complete(self.broadcaster.set_engines(clients))
        if (resend or self.broadcaster.partial is not None) and self.sent is not None:
            self._broadcast(*self.sent)

    @property
    def _megatron(self) -> bool:
        return hasattr(self.trainer, "sharded_state_dict")

    def save_checkpoint(self, ckpt_dir: str, iteration: int, extra: dict[str, Any], keep_last: int) -> str:
        """Save this rank's state (every rank calls it)."""
        if self._megatron:
            from relax_core.checkpoint import megatron as megatron_ckpt

            return str(megatron_ckpt.save(ckpt_dir, iteration, self.trainer, extra, keep_last=keep_last,
                                          hf_dir=self.model_dir))
        from relax_core.checkpoint import save_checkpoint

        state = {**self.trainer.state_dict(), "progress": extra}
        return str(save_checkpoint(ckpt_dir, iteration, state, keep_last=keep_last, hf_dir=self.model_dir))

    def load_checkpoint(self, ckpt_dir: str) -> dict[str, Any]:
        """Load the latest checkpoint into this rank; returns the saved progress."""
        if self._megatron:
            from relax_core.checkpoint import megatron as megatron_ckpt

            progress = megatron_ckpt.load(ckpt_dir, self.trainer)
            self._gather_live()
            return progress
        from relax_core.checkpoint import load_checkpoint

        state = {**self.trainer.state_dict(), "progress": {}}
        load_checkpoint(ckpt_dir, state)
        self.trainer.load_state_dict({k: v for k, v in state.items() if k != "progress"})
        self._gather_live()
        return state["progress"]

    def close(self) -> None:
        if self.broadcaster is not None:
            self.loop.run_until_complete(self.broadcaster.close())
        if self.bus is not None:
            self.bus.close()


SYNC_SWITCH_INTERVAL_S = 0.0002  # Python's default is 0.005


@contextmanager
def quick_gil_handoff(active: bool):
    """While the engines wait for this rank's weights (paused mid-generation), the next step trains in another
    thread of this process and holds the GIL most of the time (a small model's step is mostly Python): with
    Python's 5 ms switch interval each HTTP answer and collective of the sync waits for it, and the engines idle
    meanwhile. A shorter interval for the sync's few milliseconds hands the GIL over sooner (measured with
    tests/benchmarks/bench_modes.py --long-tail: the engines' idle time per sync 38 ms -> 16-23 ms)."""
    if not active:
        yield
        return
    previous = sys.getswitchinterval()
    sys.setswitchinterval(SYNC_SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)
