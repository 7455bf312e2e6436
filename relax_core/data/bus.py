"""The sample bus: TransferQueue between rollout and training in the asynchronous modes.

    RolloutManager --put--> [ partition "step-<n>" ] --add_field--> advantage stage
                                      |                 (writes field "advantages" on the same rows)
                                      +--take--> Trainer

This is the only module that touches the `transferqueue` package (see DESIGN.md,
"The engine"). One partition holds the rows of one training step; each row is
one `Sample` spread over columns. Variable-length columns (token ids, log-probs,
loss mask) travel as jagged nested tensors, scalars as 1-D tensors, and the
free-form columns (finish_reason, label, metadata) as JSON strings, so they come
back exactly (JSON types: a tuple comes back as a list).

Which rows a consumer gets and that it gets each row once is TransferQueue's
consumption tracking (one task name per consumer). TransferQueue reuses the
row indexes of cleared partitions, so its default sampler (lowest index first)
would not return rows in put order; the sampler here orders ready rows by a
per-partition sequence number written with each put. A take therefore returns
the earliest-put complete rows, in put order: when the rollout puts whole
groups and `count` is a multiple of the group size, a group's rows arrive
together in one take.

TransferQueue keeps process-wide state: one SampleBus per process, and one per
Ray cluster (its controller is a named actor).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from relax_core.rollout.types import Sample

ROLLOUT_FIELDS = ("prompt_ids", "response_ids", "rollout_logprobs", "loss_mask", "reward", "group_id",
                  "policy_version", "sample_id", "finish_reason", "label", "metadata")
TRAINER = "trainer"  # the consumer whose takes `depth` counts
SEQ = "relax_seq"  # put order, in each row's custom_meta
POLL_S = 0.05  # TransferQueue's controller answers "not ready" at once in polling mode; we wait here
_TQ_ACTOR = ("TransferQueueController", "transfer_queue")  # (name, namespace) of TQ's controller


def partition_id(step: int) -> str:
    return f"step-{step}"


def _put_order_sampler():
    """A TransferQueue sampler that hands out ready rows in put order (by SEQ)."""
    from transfer_queue import BaseSampler

    class PutOrderSampler(BaseSampler):
        def sample(self, ready_indexes, batch_size, *args, partition=None, **kwargs):
            custom = partition.custom_meta if partition is not None else {}
            order = sorted(ready_indexes, key=lambda i: (custom.get(i, {}).get(SEQ, float("inf")), i))
            chosen = order[:batch_size]
            return chosen, chosen  # every row handed out is consumed for this task

    return PutOrderSampler()


def _storage_units() -> int:
    """One storage unit per node, as far as free CPUs allow (TQ actors take 1 CPU each)."""
    import ray

    free = int(ray.available_resources().get("CPU", 0))
    if free < 2:
        raise RuntimeError(f"TransferQueue needs 2 free Ray CPUs (controller + 1 storage unit), the cluster has "
                           f"{free}: start Ray with num_cpus 2 higher")
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return max(1, min(nodes, free - 1))


class SampleBus:
    """TransferQueue as the data bus: one partition per training step ("step-<n>")."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._next_seq: dict[int, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def start(cls, samples_per_step: int, max_partitions: int) -> SampleBus:
        """Start TransferQueue's controller/storage in the connected Ray cluster."""
        import psutil
        import ray

        # TQ warns on every put/get when its thread count exceeds the cores; read at its import
        os.environ.setdefault("TQ_NUM_THREADS", str(min(8, psutil.cpu_count(logical=False) or 1)))
        import transfer_queue as tq
        from omegaconf import OmegaConf

        try:
            ray.get_actor(*_TQ_ACTOR)
            raise RuntimeError("a TransferQueue already runs in this Ray cluster; close its SampleBus first")
        except ValueError:
            pass  # none yet: tq.init would otherwise attach to it and ignore our config
        units = _storage_units()
        # a safety limit, not flow control (the staleness bound is): rows are routed to units by
        # index modulo units, and TQ reuses indexes, so units fill unevenly; hence the factor 2
        capacity = 2 * samples_per_step * max_partitions
        conf = OmegaConf.create({
            "controller": {"sampler": _put_order_sampler(), "polling_mode": True},
            "backend": {"storage_backend": "SimpleStorage",
                        "SimpleStorage": {"num_data_storage_units": units, "total_storage_size": capacity}},
        }, flags={"allow_objects": True})
        tq.init(conf)
        return cls(tq.get_client())

    def put(self, step: int, samples: list[Sample]) -> None:
        """Write the rollout fields of `samples` as new rows of partition `step` (callable repeatedly)."""
        if not samples:
            return
        with self._lock:
            first = self._next_seq.get(step, 0)
            self._next_seq[step] = first + len(samples)
        data = _to_columns(samples)
        # rows are registered and tagged with their sequence number before any field is written,
        # so the sampler never sees a complete row without its place in the order
        meta = self._client.get_meta(data_fields=list(ROLLOUT_FIELDS), batch_size=len(samples),
                                     partition_id=partition_id(step), mode="insert")
        meta.update_custom_meta([{SEQ: first + i} for i in range(len(samples))])
        self._client.set_custom_meta(meta)
        self._client.put(data, metadata=meta)

    def add_field(self, step: int, name: str, consumer: str, fn: Callable[[list[Sample]], list[float]]) -> int:
        """Compute `fn(samples)` for the rows `consumer` has not processed yet; write it as field `name`.

        Returns the number of rows processed. The rows count as processed once read: if `fn`
        raises, they are not offered to this consumer again (the run should stop).
        """
        import torch
        from tensordict import TensorDict

        pid = partition_id(step)
        ready = self._ready(pid, list(ROLLOUT_FIELDS), consumer)
        if ready == 0:
            return 0
        meta = self._client.get_meta(data_fields=list(ROLLOUT_FIELDS), batch_size=ready, partition_id=pid,
                                     mode="fetch", task_name=consumer)
        if meta.size == 0:
            return 0
        values = fn(_to_samples(self._client.get_data(meta), meta.size))
        if len(values) != meta.size:
            raise ValueError(f"add_field {name!r}: fn returned {len(values)} values for {meta.size} samples")
        column = torch.tensor([float(v) for v in values], dtype=torch.float64)
        self._client.put(TensorDict({name: column}, batch_size=meta.size), metadata=meta)
        return meta.size

    def take(self, step: int, count: int, fields: tuple[str, ...] = (), consumer: str = TRAINER,
             timeout_s: float = 600) -> tuple[list[Sample], dict[str, list]]:
        """Block until `count` complete rows of partition `step` are there; return them once per consumer."""
        if count < 1:
            raise ValueError(f"take: count must be >= 1, got {count}")
        pid, needed = partition_id(step), list(ROLLOUT_FIELDS) + list(fields)
        deadline = time.monotonic() + timeout_s
        while True:
            meta = self._client.get_meta(data_fields=needed, batch_size=count, partition_id=pid,
                                         mode="fetch", task_name=consumer)
            if meta.size:
                break
            if time.monotonic() > deadline:
                ready = self._ready(pid, needed, consumer)
                raise TimeoutError(f"step {step}: {count} rows with fields {needed} for {consumer!r} not there "
                                   f"after {timeout_s:g} s ({ready} ready)")
            time.sleep(POLL_S)
        data = self._client.get_data(meta)
        return _to_samples(data, meta.size), {f: [_scalar(v) for v in _column(data[f], meta.size)] for f in fields}

    def depth(self) -> int:
        """Rows written and not yet taken by the trainer, over all partitions."""
        total = 0
        for pid in self._client.get_partition_list():
            if pid.startswith("step-"):
                total += self._ready(pid, list(ROLLOUT_FIELDS), TRAINER)
        return total

    def clear(self, step: int) -> None:
        """Drop partition `step` (after the trainer consumed it)."""
        self._client.clear_partition(partition_id(step))
        with self._lock:
            self._next_seq.pop(step, None)

    def close(self) -> None:
        """Stop what start() started (TQ actors), idempotent."""
        if not self._closed:
            self._closed = True
            import transfer_queue as tq

            tq.close()

    def _ready(self, pid: str, fields: list[str], consumer: str) -> int:
        """Rows of `pid` that have all `fields` and that `consumer` has not taken."""
        _, produced = self._client.get_production_status(data_fields=fields, partition_id=pid)
        if produced is None:
            return 0
        _, consumed = self._client.get_consumption_status(consumer, pid)
        done = produced.reshape(produced.shape[0], -1).all(dim=1)
        return int((done & (consumed.reshape(-1) == 0)).sum())


def _to_columns(samples: list[Sample]):
    """Samples -> a TensorDict with one column per rollout field."""
    import torch
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorStack

    def jagged(name: str, dtype):
        rows = [torch.tensor(getattr(s, name), dtype=dtype) for s in samples]
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)

    def scalar(name: str, dtype):
        return torch.tensor([getattr(s, name) for s in samples], dtype=dtype)

    def text(name: str):
        return NonTensorStack(*[json.dumps(getattr(s, name)) for s in samples])

    return TensorDict({
        "prompt_ids": jagged("prompt_ids", torch.int64), "response_ids": jagged("response_ids", torch.int64),
        "rollout_logprobs": jagged("rollout_logprobs", torch.float64), "loss_mask": jagged("loss_mask", torch.int64),
        "reward": scalar("reward", torch.float64), "group_id": scalar("group_id", torch.int64),
        "policy_version": scalar("policy_version", torch.int64), "sample_id": scalar("sample_id", torch.int64),
        "finish_reason": text("finish_reason"), "label": text("label"), "metadata": text("metadata"),
    }, batch_size=len(samples))


def _column(value: Any, n: int) -> list:
    """One column from get_data as n plain Python values (TQ may return dense columns as nested tensors)."""
    import torch

    if isinstance(value, torch.Tensor):
        rows = [row.tolist() for row in value.unbind(0)]
    else:
        rows = list(value.tolist() if hasattr(value, "tolist") else value)
    if len(rows) != n:
        raise RuntimeError(f"TransferQueue returned {len(rows)} values for {n} rows")
    return rows


def _scalar(value: Any) -> Any:
    while isinstance(value, list):  # a scalar stored as [B] may come back as [B, 1]
        value = value[0]
    return value


def _to_samples(data: Any, n: int) -> list[Sample]:
    cols = {f: _column(data[f], n) for f in ROLLOUT_FIELDS}
    return [Sample(prompt_ids=cols["prompt_ids"][i], response_ids=cols["response_ids"][i],
                   rollout_logprobs=cols["rollout_logprobs"][i], loss_mask=cols["loss_mask"][i],
                   reward=float(_scalar(cols["reward"][i])), group_id=int(_scalar(cols["group_id"][i])),
                   policy_version=int(_scalar(cols["policy_version"][i])),
                   sample_id=int(_scalar(cols["sample_id"][i])),
                   finish_reason=json.loads(cols["finish_reason"][i]), label=json.loads(cols["label"][i]),
                   metadata=json.loads(cols["metadata"][i]))
            for i in range(n)]
