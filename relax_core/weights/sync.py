"""Trainer side of the weight sync: bucketed broadcast into every rollout engine.

After a training step, the trainer's rank 0 holds the new weights under their
Hugging Face names (the Megatron backend gathers and converts them first). A
`WeightBroadcaster` pushes them to all engines over a torch.distributed group
(`rollout/weight_group.py`; gloo on CPU, NCCL on GPU) in which it is rank 0 and the
engines are ranks 1..N, using SGLang's protocol:

    POST /begin_weight_update to every engine (SGLang's weight-update session)
    per bucket:  POST /update_weights_from_distributed {names, dtypes, shapes,
                 load_format: "flattened_bucket"} to every engine (concurrently)
                 ||  broadcast the bucket from rank 0 as one byte tensor, the
                 tensors' bytes in the order of `names` (`flattened`)
    POST /end_weight_update

In the asynchronous modes the engines are generating when a version arrives:
`broadcast(..., while_generating=True)` wraps the above in SGLang's
`/pause_generation {"mode": "retract"}` ... `/continue_generation`, so the
requests in flight go on under the new weights (see `broadcast`).

Buckets bound the memory in flight and let the HTTP round trip of one bucket
overlap the broadcasts. Over NCCL (SGLang on GPUs) a bucket goes as one byte
tensor: one collective per bucket, not one kernel launch and one receiving
Python call per tensor, and packing it costs a copy at the GPU memory's speed,
a small fraction of the link's time. Over gloo (CPU engines) packing and
taking apart cost two copies at about the speed of the transfer itself, while
one broadcast per tensor lands straight in the engine's parameters and gloo
pipelines them: there large tensors go as they are, and a bucket of small ones
(`FLAT_BELOW_BYTES` on average), where each collective's fixed cost dominates,
as one byte tensor (`flatten`; measured by tests/benchmarks/bench_weight_sync.py).
While the engines generate, the first bucket is packed before they are paused. Only the last bucket carries the new
`weight_version`, so an engine reports the new version only once every
tensor has arrived. When the set of engines changes (elastic rollout),
`set_engines` tears the group down and builds a new one.

A broadcast that fails half-way leaves the engines with some of the new
version's buckets under their old label: `partial` names that version until a
broadcast completes, and whoever holds the weights sends it whole again before
the engines serve (controller/workers.py `set_engines`, also when a failed
engine is only left out).

An engine that answers an announce with an error (or whose connection
fails) never posts its side of the broadcast, so rank 0's collective would
wait for the group's timeout (NCCL: possibly forever). The sync fails at
once instead: `WeightSyncError` names the engine, the group is given up
(`process_group.abort_weight_update_group`) and `init`/`set_engines` form a
new one (the controller's recovery does, controller/recovery.py). The
collectives run in daemon threads that nothing waits for once given up: a
gloo operation cannot be interrupted (torch 2.13) and ends when the engines
destroy their side of the group, which `close` asks them to. Creating the
group fails as fast when an engine refuses to join.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from statistics import fmean

import torch
import torch.distributed as dist

from relax_core.cluster.ports import listening_socket
from relax_core.rollout.client import EngineClient
from relax_core.rollout.weight_group import (
    DEFAULT_TIMEOUT,
    abort_weight_update_group,
    destroy_weight_update_group,
    init_weight_update_group,
)

NamedTensor = tuple[str, torch.Tensor]
FLATTENED = "flattened_bucket"  # SGLang's load_format for a bucket sent as one byte tensor
# Over gloo, a bucket whose tensors average less goes as one byte tensor: measured on this 2-core machine, a
# 2.3 MiB model (about 60 KiB a tensor) syncs in 8 ms flattened against 11 ms tensor by tensor, a 46 MiB one
# (about 1.1 MiB a tensor) in 68 ms against 29 ms.
FLAT_BELOW_BYTES = 256 << 10
REPORT_GRACE_S = 2.0  # after rank 0's own part failed: how long the engines' calls get to say which engine failed
CLEANUP_TIMEOUT_S = 30.0  # per engine call after a failure: an engine stuck in the collective answers late or never


class WeightSyncError(RuntimeError):
    """An engine refused to join the group or to load a bucket."""


@dataclass
class BroadcastStats:
    """What one `WeightBroadcaster.broadcast` moved, and how fast."""

    version: int
    num_tensors: int
    num_buckets: int
    total_bytes: int
    seconds: float
    paused_s: float = 0.0  # while_generating: each engine's idle time, from its pause to its continue (mean)

    @property
    def gbytes_per_s(self) -> float:
        return self.total_bytes / max(self.seconds, 1e-9) / 1e9


@dataclass
class Bucket:
    """Tensors sent together: `flat` is their bytes as one tensor when they go that way (`flattened`)."""

    names: list[str]
    tensors: list[torch.Tensor]
    flat: torch.Tensor | None


class WeightBroadcaster:
    """Rank 0 of the weight-update group; pushes named tensors to all engines.

    Args:
        clients: one client per engine.
        master_address: this (trainer) host's address as the engines reach it.
        master_port: TCP port on this host for the group's rendezvous; 0: a free one, bound before
            the engines are told it (`self.master_port` says which, after `init`).
        group_name: name of the group on both sides.
        backend: "gloo" (CPU engines) or "nccl" (SGLang on GPU).
        bucket_bytes: upper bound of one bucket (a larger tensor goes alone).
        ranks_per_engine: ranks each engine contributes (SGLang: its TP size).
        flatten: send each bucket as one byte tensor (`load_format="flattened_bucket"`); None: over NCCL, and
            over gloo a bucket of small tensors (`flat_pays`).
    """

    def __init__(
        self,
        clients: list[EngineClient],
        master_address: str,
        master_port: int = 0,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
        bucket_bytes: int = 512 << 20,
        ranks_per_engine: int = 1,
        timeout: timedelta = DEFAULT_TIMEOUT,
        flatten: bool | None = None,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be positive")
        self.clients = list(clients)
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.ranks_per_engine = ranks_per_engine
        self.timeout = timeout
        self.flatten = flatten
        self.group: dist.ProcessGroup | None = None
        self.partial: int | None = None  # a failed broadcast's version: the engines hold part of it

    @property
    def world_size(self) -> int:
        return 1 + self.ranks_per_engine * len(self.clients)

    async def init(self) -> None:
        """Create the group: this process as rank 0 while every engine joins."""
        if self.group is not None:
            raise RuntimeError("the weight-update group already exists; call close() or set_engines()")
        sock = listening_socket(self.master_address, self.master_port)
        self.master_port = sock.getsockname()[1]
        own = _in_thread(init_weight_update_group, self.master_address, self.master_port, 0, self.world_size,
                         self.group_name, self.backend, self.timeout, sock)
        joins = {asyncio.ensure_future(self._join(i, client)): client for i, client in enumerate(self.clients)}
        failure = await _until_failure(own, joins)
        if own.done() and not own.cancelled() and own.exception() is None:
            self.group = own.result()
        if failure is not None:
            # An engine that refused never joins: rank 0's rendezvous is left to its timeout, in its thread.
            await self.close()
            raise WeightSyncError(f"creating the weight-update group failed: {failure[0]}") from failure[1]

    def _join(self, index: int, client: EngineClient):
        return client.init_weights_update_group(
            self.master_address,
            self.master_port,
            rank_offset=1 + index * self.ranks_per_engine,
            world_size=self.world_size,
            group_name=self.group_name,
            backend=self.backend,
        )

    async def broadcast(self, named_tensors: Iterable[NamedTensor], version: int,
                        while_generating: bool = False) -> BroadcastStats:
        """Send all tensors (streamed: the iterable may produce them lazily).

        `while_generating`: the engines may have requests in flight (the asynchronous modes). Each engine is
        paused first with SGLang's `retract` mode, which takes its running requests back to its queue with
        their tokens so far, and continued after the update, also when it failed. A retracted request's cache
        entries are freed, so the flush with the last bucket succeeds (SGLang's scheduler `flush_cache` ignores
        the queue while paused) and the request continues under the new weights, its cache recomputed from
        its prompt and the tokens it has; the engine notes on each such request how many tokens the old
        version made (SGLang's `record_weight_version_change`), and its response names the version of every
        token span (`meta_info["weight_versions"]`). `in_place` would keep the old cache and fail the flush."""
        if self.group is None:
            raise RuntimeError("no weight-update group: call init() (after a failed sync: set_engines())")
        if not while_generating:
            return await self._broadcast(self._buckets(named_tensors), version)
        stopped: dict[EngineClient, float] = {}  # when each engine answered that it stopped generating

        async def pause(client: EngineClient) -> None:
            await client.pause_generation("retract")  # answered once its scheduler took its requests back
            stopped[client] = time.perf_counter()

        async def resume(client: EngineClient) -> float:
            await client.continue_generation()
            return time.perf_counter() - stopped[client]

        buckets = self._buckets(named_tensors)
        first = next(buckets, None)  # packed while the engines still generate: they are paused only to load
        buckets = itertools.chain([] if first is None else [first], buckets)
        paused = await asyncio.gather(*(pause(c) for c in self.clients), return_exceptions=True)
        idle: list = []
        try:
            failed = next(((c, r) for c, r in zip(self.clients, paused) if isinstance(r, BaseException)), None)
            if failed is not None:
                raise WeightSyncError(f"pausing {failed[0].base_url} for the weight update failed: "
                                      f"{failed[1]!r}") from failed[1]
            stats = await self._broadcast(buckets, version)
        finally:  # every engine that paused generates again, with whatever weights it holds
            idle = await asyncio.gather(*(asyncio.wait_for(resume(c), CLEANUP_TIMEOUT_S) for c in stopped),
                                        return_exceptions=True)
        stats.paused_s = fmean(s for s in idle if isinstance(s, float)) if idle else 0.0
        return stats

    def _buckets(self, named_tensors: Iterable[NamedTensor]) -> Iterator[Bucket]:
        """The tensors in buckets of at most `bucket_bytes`, each ready to send (on the group's device, packed
        into one byte tensor where that pays), one at a time as the iterator is read."""
        for bucket in iter_buckets(named_tensors, self.bucket_bytes):
            tensors = [self._on_device(t) for _, t in bucket]
            flat = flattened(tensors) if self._flat_pays(tensors) else None
            yield Bucket([name for name, _ in bucket], tensors, flat)

    def _flat_pays(self, tensors: list[torch.Tensor]) -> bool:
        """Whether to send a bucket as one byte tensor: over NCCL always (packing runs at the GPU memory's
        speed); over gloo when its tensors average under FLAT_BELOW_BYTES, where the fixed cost of one
        collective per tensor outweighs packing them (tests/benchmarks/bench_weight_sync.py)."""
        if self.flatten is not None:
            return self.flatten
        if self.backend == "nccl":
            return True
        return sum(t.numel() * t.element_size() for t in tensors) < FLAT_BELOW_BYTES * len(tensors)

    async def _broadcast(self, buckets: Iterator[Bucket], version: int) -> BroadcastStats:
        start = time.perf_counter()
        stats = BroadcastStats(version, 0, 0, 0, 0.0)
        self.partial = version
        results = await asyncio.gather(*(c.begin_weight_update() for c in self.clients), return_exceptions=True)
        opened = [c for c, was in zip(self.clients, results) if was is True]
        try:
            failed = next(((c, r) for c, r in zip(self.clients, results) if isinstance(r, BaseException)), None)
            if failed is not None:
                raise WeightSyncError(f"weight update failed: {failed[0].base_url}: {failed[1]!r}") from failed[1]
            for bucket, is_last in _with_last(buckets):
                await self._send_bucket(bucket, str(version) if is_last else None)
                stats.num_buckets += 1
                stats.num_tensors += len(bucket.names)
                stats.total_bytes += sum(t.numel() * t.element_size() for t in bucket.tensors)
        except BaseException:
            # The others' sessions end, so they serve again (with what they got, until the update is sent again
            # once the failed engine is replaced, controller/recovery.py); the failure is the error to report.
            await _bounded(c.end_weight_update() for c in opened)
            raise
        ended = await asyncio.gather(*(c.end_weight_update() for c in opened), return_exceptions=True)
        problem = next((r for r in ended if isinstance(r, BaseException)), None)
        if problem is not None:
            raise WeightSyncError(f"ending the weight update failed: {problem!r}") from problem
        self.partial = None
        stats.seconds = time.perf_counter() - start
        return stats

    async def _send_bucket(self, bucket: Bucket, weight_version: str | None) -> None:
        tensors, flat = bucket.tensors, bucket.flat
        announce = [
            asyncio.ensure_future(
                client.update_weights_from_distributed(
                    names=bucket.names,
                    dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
                    shapes=[list(t.shape) for t in tensors],
                    group_name=self.group_name,
                    weight_version=weight_version,
                    flush_cache=weight_version is not None,  # the KV cache goes once, with the last bucket
                    load_format=FLATTENED if flat is not None else None,
                )
            )
            for client in self.clients
        ]
        sent = _in_thread(_broadcast_all, [flat] if flat is not None else tensors, self.group)
        failure = await _until_failure(sent, dict(zip(announce, self.clients)))
        if failure is None:
            return
        given_up = ""
        if not sent.done() or sent.cancelled() or sent.exception() is not None:
            # The collective is in flight (an engine will never post its side) or broken: nothing may wait on it.
            group, self.group = self.group, None
            abort_weight_update_group(group)
            given_up = "; the weight-update group was given up (set_engines() or init() forms a new one)"
        raise WeightSyncError(f"weight update failed: {failure[0]}{given_up}") from failure[1]

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if self.backend == "nccl" and not tensor.is_cuda:
            tensor = tensor.cuda()
        elif self.backend == "gloo" and tensor.device.type != "cpu":
            tensor = tensor.cpu()
        return tensor.contiguous()

    async def close(self) -> None:
        """Destroy the group on the engines (best effort) and here; close the clients (the broadcaster owns
        them)."""
        await self._leave_group()
        await asyncio.gather(*(c.aclose() for c in self.clients))

    async def _leave_group(self) -> None:
        await _bounded(c.destroy_weights_update_group(self.group_name) for c in self.clients)
        if self.group is not None:
            group, self.group = self.group, None
            await asyncio.to_thread(destroy_weight_update_group, group)

    async def set_engines(self, clients: list[EngineClient], master_port: int | None = None) -> None:
        """Re-create the group for a new set of engines (e.g. after a scale-out); the clients of engines no
        longer in the set are closed.

        The new group rendezvous on `master_port`, by default on a fresh free port (the old one may
        still be held by the closed group's store).
        """
        await self._leave_group()
        await asyncio.gather(*(c.aclose() for c in self.clients if c not in clients))
        self.clients = list(clients)
        self.master_port = master_port or 0
        await self.init()


def iter_buckets(named_tensors: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Group tensors, in order, into lists of at most `bucket_bytes` bytes
    (a tensor larger than that forms a bucket of its own)."""
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _with_last(items: Iterator) -> Iterator[tuple[object, bool]]:
    """(item, is_last) pairs, looking one item ahead."""
    previous = next(items, _END)
    while previous is not _END:
        current = next(items, _END)
        yield previous, current is _END
        previous = current


_END = object()


def flattened(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The bucket as one byte tensor, the tensors' bytes one after another in order: what SGLang receives with
    `load_format="flattened_bucket"` (`FlattenedTensorBucket`, sglang/srt/weight_sync/tensor_bucket.py), in
    one broadcast instead of one per tensor. None when a tensor would start at an offset that is not a
    multiple of its element size (SGLang refuses those; mixed dtypes can cause it): then one per tensor."""
    offset = 0
    for t in tensors:
        if offset % t.element_size():
            return None
        offset += t.numel() * t.element_size()
    if len(tensors) < 2:
        return None  # one tensor is one broadcast either way
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])


def _broadcast_all(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    handles = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    for handle in handles:
        handle.wait()


def _in_thread(fn, *args) -> asyncio.Future:
    """`fn(*args)` in a daemon thread, as a future of the running loop. Unlike `asyncio.to_thread`, a
    thread left blocked in a collective that was given up holds neither the loop's executor nor the
    interpreter's exit (the executor's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    future.add_done_callback(_retrieved)

    def settle(result, error) -> None:
        if not future.done():  # cancelled: nobody waits any more
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop has closed: nobody waits
            pass

    threading.Thread(target=run, name=f"relax-{fn.__name__}", daemon=True).start()
    return future


def _retrieved(future: asyncio.Future) -> None:
    """Mark an error as seen: a part that was given up may fail long after nobody waits for it."""
    if not future.cancelled():
        future.exception()


async def _until_failure(own: asyncio.Future, calls: dict[asyncio.Future, EngineClient]):
    """Wait for rank 0's part (`own`) and every engine's call, or only until the first failure.

    Returns None when all succeeded, else `(what failed, its exception)`, naming the engines whose calls
    failed (when `own` failed first, the engines get `REPORT_GRACE_S` to tell: a dead engine's call fails
    at once). Calls still running are cancelled; `own`, in its thread, is left to end by itself.
    """
    pending: set[asyncio.Future] = {own, *calls}
    failed = False
    while pending and not failed:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        failed = any(f.exception() is not None for f in done)
    if not failed:
        return None
    if own.done() and own.exception() is not None and pending & calls.keys():
        await asyncio.wait(pending & calls.keys(), timeout=REPORT_GRACE_S)
    engines = [(calls[f], f.exception()) for f in calls if f.done() and f.exception() is not None]
    for f in [own, *calls]:
        f.cancel()  # no-op when done
    if engines:
        return "; ".join(f"engine {client.base_url}: {error}" for client, error in engines), engines[0][1]
    return f"this trainer's side (rank 0): {own.exception()!r}", own.exception()


async def _bounded(calls) -> None:
    """Await calls to the engines together, each for at most CLEANUP_TIMEOUT_S; errors are ignored."""
    await asyncio.gather(*(asyncio.wait_for(c, CLEANUP_TIMEOUT_S) for c in calls), return_exceptions=True)
