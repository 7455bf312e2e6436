"""Colocate's weight hand-over: the trainer's tensors passed to the engines by reference.

When the engines and the trainer ranks share GPUs (colocate on GPU nodes, no
rollout group), NCCL cannot broadcast between them: two ranks of one group on
one device. SGLang takes the tensors by reference instead,
`/update_weights_from_tensor`: the trainer sends handles (CUDA IPC for CUDA
tensors, a shared-memory file for CPU tensors), the engine opens them and
copies the values into its own weights. `TensorHandover` does this with the
same interface as `sync.WeightBroadcaster` (init / broadcast / set_engines /
close). An engine's TP rank sees only its own GPU, so the trainer rank on that
GPU hands it the weights; rank 0 talks to the engines (controller/workers.py
`hand_over_weights`, called on every trainer rank):

    rank 0: POST /begin_weight_update to every engine (SGLang's weight-update session)
    per bucket, every rank:  stage its copy (CPU: into one shared-memory buffer; CUDA: as it is),
                             serialize it once for each engine rank on its device
               rank 0:       gather the payloads, POST /update_weights_from_tensor to every engine at once
               every rank:   keep the bucket referenced until rank 0 says every engine answered
    last bucket: weight_version and flush_cache
    rank 0: POST /end_weight_update

The payloads are in the engines' wire format (`relax_core/rollout/weight_wire.py`): CUDA tensors
named by device UUID, CPU tensors by a /dev/shm file name.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlparse

import torch

from relax_core.rollout.client import EngineClient
from relax_core.rollout.weight_wire import file_system_sharing, serialize
from relax_core.weights.sync import BroadcastStats, NamedTensor, WeightSyncError, _with_last, iter_buckets

ALIGN = 64  # bytes; every staged tensor starts at a multiple of it (any dtype may view it)


class SharedStaging:
    """One shared-memory buffer that a bucket's CPU tensors are copied into, reused bucket after bucket.

    The engine maps one file per bucket and the trainer's own tensors stay
    private memory (sharing them by name would move every parameter into
    /dev/shm). It grows to the largest bucket; a bucket may be staged again
    once every engine answered for the one before.
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def stage(self, bucket: list[NamedTensor]) -> list[NamedTensor]:
        cpu = [t for _, t in bucket if t.device.type == "cpu"]
        need = sum(_aligned(_nbytes(t)) for t in cpu)
        if cpu and (self.buffer is None or self.buffer.numel() < need):
            with file_system_sharing():
                self.buffer = torch.empty(need, dtype=torch.uint8).share_memory_()
        staged, offset = [], 0
        for name, tensor in bucket:
            tensor = tensor.detach()
            if tensor.device.type == "cpu":
                view = self.buffer[offset : offset + _nbytes(tensor)].view(tensor.dtype).view(tensor.shape)
                tensor = view.copy_(tensor)
                offset += _aligned(_nbytes(tensor))
            staged.append((name, tensor))
        return staged


async def _all(calls) -> None:
    """Await the calls to every engine together; raise the first failure."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise WeightSyncError(f"weight hand-over failed: {errors[0]}") from errors[0]


async def _end_quietly(clients: list[EngineClient]) -> None:
    """Close the sessions of a failed hand-over (its own error is the one to report)."""
    await asyncio.gather(*(c.end_weight_update() for c in clients), return_exceptions=True)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass
class _Plan:
    """What rank 0 tells every rank at the start of a hand-over."""

    sources: list[list[int]]  # per engine, the trainer rank whose device holds each of its TP ranks
    bucket_bytes: int
    error: str | None = None


class TensorHandover:
    """Hands named tensors to every engine by reference; rank 0 talks to the engines.

    Colocated on a node of GPUs, TP rank k of an engine sits on the GPU of
    trainer rank `sources[url][k]`, and sees only its own GPUs: each trainer
    rank serializes its own copy of a bucket for the engine ranks on its GPU,
    rank 0 gathers those payloads (`gather_object` over the trainers' default
    group) and posts them, and every rank keeps its bucket referenced until
    rank 0 tells them the engines answered. So every trainer rank calls
    `broadcast` with the same tensors, in step; rank 0 tells the others the
    sources and the bucket size, which they need not know beforehand.

    Args:
        clients: rank 0: one client per engine; the other ranks: none.
        host: this host's address, as the engines' URLs name theirs.
        bucket_bytes: upper bound of one bucket (a larger tensor goes alone).
        ranks_per_engine: TP ranks of an engine (one payload each), all fed by rank 0 (`sources` None).
        sources: engine URL -> the trainer rank feeding each of its TP ranks.
        rank, world_size: this process in the trainers' default group.
    """

    def __init__(self, clients: list[EngineClient], host: str, bucket_bytes: int = 512 << 20,
                 ranks_per_engine: int = 1, sources: dict[str, list[int]] | None = None,
                 rank: int = 0, world_size: int = 1) -> None:
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be positive")
        self.clients, self.host, self.bucket_bytes = list(clients), host, bucket_bytes
        self.ranks_per_engine, self.sources = ranks_per_engine, sources
        self.rank, self.world_size = rank, world_size
        self.staging = SharedStaging()

    async def init(self) -> None:
        """No group to form: checks that a handle reaches every engine."""
        if self.sources is None:
            away = [c.base_url for c in self.clients if urlparse(c.base_url).hostname != self.host]
            if away:
                raise WeightSyncError(f"engines {away} run on another host than trainer rank 0 ({self.host}); "
                                      "weights handed over by reference reach this host's engines only")
            return
        missing = [c.base_url for c in self.clients if c.base_url not in self.sources]
        if missing:
            raise WeightSyncError(f"engines {missing} share no trainer rank's GPUs: colocate on shared GPUs hands "
                                  "the weights only to the engines started in the GPU slots of the run")

    async def broadcast(self, named_tensors: Iterable[NamedTensor], version: int) -> BroadcastStats:
        """Hand over all tensors (streamed: the iterable may produce them lazily) as `version`."""
        start = time.perf_counter()
        stats = BroadcastStats(version, 0, 0, 0, 0.0)
        opened, plan = await self._open()
        try:
            for bucket, is_last in _with_last(iter_buckets(named_tensors, plan.bucket_bytes)):
                await self._send_bucket(plan, bucket, str(version) if is_last else None)
                stats.num_buckets += 1
                stats.num_tensors += len(bucket)
                stats.total_bytes += sum(_nbytes(t) for _, t in bucket)
        except BaseException:
            await _end_quietly(opened)
            raise
        await _all(c.end_weight_update() for c in opened)
        stats.seconds = time.perf_counter() - start
        return stats

    async def _open(self) -> tuple[list[EngineClient], _Plan]:
        """Rank 0: open every engine's weight-update session; every rank: the plan (raises on rank 0's error)."""
        opened, plan = [], None
        if self.rank == 0:
            results = await asyncio.gather(*(c.begin_weight_update() for c in self.clients), return_exceptions=True)
            opened = [c for c, result in zip(self.clients, results) if result is True]
            errors = [r for r in results if isinstance(r, BaseException)]
            plan = _Plan(self._engine_sources(), self.bucket_bytes,
                         f"opening the weight-update session failed: {errors[0]}" if errors else None)
        plan = self._from_rank0(plan)
        if plan.error:
            await _end_quietly(opened)
            raise WeightSyncError(plan.error)
        return opened, plan

    def _engine_sources(self) -> list[list[int]]:
        if self.sources is None:
            return [[0] * self.ranks_per_engine for _ in self.clients]
        return [self.sources[c.base_url] for c in self.clients]

    async def _send_bucket(self, plan: _Plan, bucket: list[NamedTensor], weight_version: str | None) -> None:
        fed = [(e, k) for e, ranks in enumerate(plan.sources) for k, source in enumerate(ranks) if source == self.rank]
        staged = self.staging.stage(bucket) if fed else bucket  # referenced until rank 0 says all engines answered
        mine = {key: serialize(staged) for key in fed}
        payloads, error = self._gather(mine), None
        if self.rank == 0:
            try:
                await _all(c.update_weights_from_tensor([payloads[e, k] for k in range(len(ranks))],
                                                        flush_cache=weight_version is not None,
                                                        weight_version=weight_version)
                           for e, (c, ranks) in enumerate(zip(self.clients, plan.sources)))
            except WeightSyncError as exc:
                error = exc
        error = self._from_rank0(error and str(error))
        if error:
            raise WeightSyncError(error)

    def _gather(self, mine: dict) -> dict | None:
        """Rank 0: every rank's payloads; the others: None."""
        if self.world_size == 1:
            return mine
        import torch.distributed as dist

        parts = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        return {key: payload for part in parts for key, payload in part.items()} if self.rank == 0 else None

    def _from_rank0(self, obj):
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    async def set_engines(self, clients: list[EngineClient]) -> None:
        """A new set of engines (rank 0, elastic rollout): nothing to re-form, only the checks of `init`; the
        clients of engines no longer in the set are closed (the handover owns its clients)."""
        await asyncio.gather(*(c.aclose() for c in self.clients if c not in clients))
        self.clients = list(clients)
        await self.init()

    async def close(self) -> None:
        self.staging = SharedStaging()  # the buffer's file goes once the engines dropped their mappings
        await asyncio.gather(*(c.aclose() for c in self.clients))
