"""The sample bus: TransferQueue as the data plane of the asynchronous modes.

    rollout service --put--> [ partition "step-<n>" ] <--process-- reference, advantage services
                                      |                           (each reads the columns it needs and
                                      |                            writes its own on the same rows)
        driver --claim--> row metadata only --> trainer ranks --fetch--> their own shard of complete rows

This is the only module that touches the `transferqueue` package (see DESIGN.md,
"The engine"). Every process of the job reaches the same bus: the driver
starts it (`start`), the services and trainer ranks `attach` to it. The
driver only ever claims rows (`claim`: a `BatchMeta`, indexes and field
names, no tensors) and hands the claimed metadata to the trainer ranks, which
read the tensors straight from TransferQueue's storage (`fetch`).
One partition holds the rows of one training step; each row is
one `Sample` spread over columns. A column with one value per token (token ids,
log-probs, loss mask, each token's policy version, a service's reference log-probs: `TOKEN_COLUMNS`) travels
as one packed array per row, raw bytes of the column's dtype (int32 ids, int8
mask, float32 log-probs: 4 bytes a token where msgpack spends 5 on an id and 9
on a float, and a storage unit holds one bytes object per row instead of a
Python object per token), and comes back as a list. Log-probs come back rounded
to float32: the trainer makes float32 tensors of them anyway (train/batching.py),
so no number it computes changes. Scalars travel as plain Python values and the
free-form columns (finish_reason, label, metadata) as JSON strings, so they come
back exactly (JSON types: a tuple comes back as a list). A multimodal sample's
processor tensors (pixel values, audio features, grid sizes) travel as they are,
never through JSON, and once per put for all the rows that share them (a group's
rows share their prompt's): as a media row of the same partition, under a key of
its own, which the rows' `multimodal` column names; a reader looks its rows'
keys up and gives every row of a key the same dict of tensors, whichever rows
of the group it read.

A service's column is either one number per row (advantages) or one number
per response token (reference log-probs: packed as the log-probs).

Which rows a consumer gets and that it gets each row once is TransferQueue's
consumption tracking (one task name per consumer). TransferQueue reuses the
row indexes of cleared partitions, so its default sampler (lowest index first)
would not return rows in put order; the sampler here orders ready rows by a
per-partition sequence number written with each put. A take therefore returns
the earliest-put complete rows, in put order: when the rollout puts whole
groups and `count` is a multiple of the group size, a group's rows arrive
together in one take.

TransferQueue keeps process-wide state: one SampleBus per process, and one per
Ray cluster (its controller is a named actor). Only the bus that started it
stops it; an attached bus closes just its own client.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from relax_core.data.sample import Sample

ROLLOUT_FIELDS = ("prompt_ids", "response_ids", "rollout_logprobs", "loss_mask", "reward", "group_id",
                  "policy_version", "token_versions", "sample_id", "finish_reason", "label", "metadata", "multimodal")
# columns with one value per token, each row one packed array of this numpy dtype (`pack_tokens`): a
# per-token column, of the rollout or of a service, is one line here
TOKEN_COLUMNS = {"prompt_ids": "int32", "response_ids": "int32", "loss_mask": "int8",
                 "rollout_logprobs": "float32", "token_versions": "int32", "ref_logprobs": "float32"}
MEDIA = "relax_media"  # the column of a partition's media rows: one `multimodal` dict each (`_to_columns`)
TRAINER = "trainer"  # the consumer the trainer ranks' rows are claimed for
SEQ = "relax_seq"  # put order, in each row's custom_meta
TOKENS = "relax_tokens"  # prompt + response tokens, in each row's custom_meta: what the ranks are balanced by
POLL_S = 0.005  # TransferQueue's controller answers "not ready" at once in polling mode; we wait here
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


def import_tq():
    """The `transfer_queue` module, imported with its thread count set for this machine, and without
    torch's compiler (cluster/tq_import.py). The first import still costs 2-3 CPU-seconds (torch,
    tensordict, TransferQueue's own modules): a process that attaches later imports it while the job
    starts (its constructor, the local driver while Ray starts), not in its first step. Call it from one
    thread at a time: two threads importing torch's modules at once may each see the other's
    half-initialised."""
    import psutil

    from relax_core.cluster.tq_import import install

    # TQ warns on every put/get when its thread count exceeds the cores; read at its import
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, psutil.cpu_count(logical=False) or 1)))
    install()
    import transfer_queue

    return transfer_queue


def _storage_units() -> int:
    """One storage unit per training node (the rows' readers): Relax's own actors hold no Ray CPU, and
    each training node adds one CPU for its unit (cluster/node.py; two on one machine, local_driver.py)."""
    import ray

    from relax_core.cluster.placement import TRAIN_RESOURCE

    free = int(ray.available_resources().get("CPU", 0))
    if free < 2:
        raise RuntimeError(f"TransferQueue needs 2 free Ray CPUs (controller + 1 storage unit), the cluster has "
                           f"{free}: start Ray with num_cpus 2 higher")
    nodes = sum(1 for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(TRAIN_RESOURCE, 0) > 0)
    return max(1, min(nodes, free - 1))


class SampleBus:
    """TransferQueue as the data bus: one partition per training step ("step-<n>")."""

    def __init__(self, client: Any, owner: bool = True) -> None:
        self._client = client
        self._owner = owner  # started TransferQueue (and stops it on close), or attached to it
        self._next_seq: dict[int, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def start(cls, samples_per_step: int, max_partitions: int) -> SampleBus:
        """Start TransferQueue's controller/storage in the connected Ray cluster."""
        import ray

        tq = import_tq()
        from omegaconf import OmegaConf

        from relax_core.cluster.placement import TRAIN_RESOURCE

        try:
            ray.get_actor(*_TQ_ACTOR)
            raise RuntimeError("a TransferQueue already runs in this Ray cluster; close its SampleBus first")
        except ValueError:
            pass  # none yet: tq.init would otherwise attach to it and ignore our config
        units = _storage_units()
        # a safety limit, not flow control (the staleness bound is): rows are routed to units by
        # index modulo units, and TQ reuses indexes, so units fill unevenly; hence the factor 2. A step
        # holds at most one media row per sample row (one per group in practice): the second factor 2
        capacity = 2 * 2 * samples_per_step * max_partitions
        conf = OmegaConf.create({
            "controller": {"sampler": _put_order_sampler(), "polling_mode": True},
            "backend": {"storage_backend": "SimpleStorage",
                        "SimpleStorage": {"num_data_storage_units": units, "total_storage_size": capacity,
                                          "required_node_resource": TRAIN_RESOURCE}},
        }, flags={"allow_objects": True})
        tq.init(conf)
        return cls(tq.get_client())

    @classmethod
    def attach(cls) -> SampleBus:
        """The bus the driver started, from another process of the same Ray cluster (a service, a rank)."""
        tq = import_tq()
        tq.init()  # a controller runs: this only connects a client to it
        return cls(tq.get_client(), owner=False)

    def put(self, step: int, samples: list[Sample]) -> int:
        """Write the rollout fields of `samples` as new rows of partition `step` (callable repeatedly).
        Returns the bytes of their per-token columns and media (what a row's size grows with)."""
        from tensordict import TensorDict

        if not samples:
            return 0
        with self._lock:
            first = self._next_seq.get(step, 0)
            self._next_seq[step] = first + len(samples)
        data, media, nbytes = _to_columns(samples)
        if media:  # before the rows that name them: a reader that sees a row finds its media
            meta = self._client.kv_retrieve_meta(keys=list(media), partition_id=partition_id(step), create=True)
            self._client.put(TensorDict({MEDIA: plain_column(list(media.values()))}, batch_size=len(media)),
                             metadata=meta)
        # rows are registered and tagged with their sequence number before any field is written,
        # so the sampler never sees a complete row without its place in the order
        meta = self._client.get_meta(data_fields=list(ROLLOUT_FIELDS), batch_size=len(samples),
                                     partition_id=partition_id(step), mode="insert")
        meta.update_custom_meta([{SEQ: first + i, TOKENS: s.num_tokens} for i, s in enumerate(samples)])
        self._client.set_custom_meta(meta)
        self._client.put(data, metadata=meta)
        return nbytes

    def process(self, step: int, consumer: str, inputs: tuple[str, ...], output: str,
                fn: Callable[[dict[str, list]], list], rows: int, timeout_s: float = 600) -> int:
        """A service's turn: compute `fn(columns)` for `rows` rows of partition `step` that `consumer` has
        not processed yet and write the result as column `output` of the same rows.

        `fn` gets the `inputs` columns as lists (one value per row: a per-token column's a list, the
        `multimodal` column's a dict of tensors or None) and returns one value per row: a number, or a
        list of numbers (a per-token column, one of `TOKEN_COLUMNS`). Several workers of one service share a
        partition by asking for their own number of rows. Returns the number of rows processed;
        they count as processed once read, so rows whose `fn` raised are not offered again.
        """
        meta = self._claim(step, rows, list(inputs), consumer, timeout_s)
        self.write(meta, output, fn(self._read(meta)), consumer)
        return meta.size

    def write(self, meta, name: str, values: list, writer: str) -> None:
        """Write `values`, one per row of `meta` (claimed rows: a number, or a list of numbers for a
        per-token column, one of `TOKEN_COLUMNS`), as column `name` of those rows."""
        from tensordict import TensorDict

        if len(values) != meta.size:
            raise ValueError(f"{writer}: computed {len(values)} values of {name!r} for {meta.size} rows")
        if meta.size == 0:
            return
        if name in TOKEN_COLUMNS:
            rows = [pack_tokens(v, TOKEN_COLUMNS[name]) for v in values]
        elif any(isinstance(v, (list, tuple)) for v in values):
            raise ValueError(f"{writer}: {name!r} has a list per row; a per-token column must be in "
                             f"relax_core/data/bus.py's TOKEN_COLUMNS, with its dtype")
        else:
            rows = [float(v) for v in values]
        self._client.put(TensorDict({name: plain_column(rows)}, batch_size=meta.size), metadata=meta)

    def add_field(self, step: int, name: str, consumer: str, fn: Callable[[list[Sample]], list[float]]) -> int:
        """`process` of every row not yet processed, with whole `Sample`s as the input (every rollout column)."""
        ready = self._ready(partition_id(step), list(ROLLOUT_FIELDS), consumer)
        if ready == 0:
            return 0
        return self.process(step, consumer, ROLLOUT_FIELDS, name, lambda columns: fn(_samples_of(columns)), ready)

    def claim(self, step: int, count: int, fields: tuple[str, ...] = (), consumer: str = TRAINER,
              timeout_s: float = 600, stop: threading.Event | None = None):
        """Block until `count` complete rows (rollout columns and `fields`) of partition `step` are there;
        claim them for `consumer` (once each) and return their metadata: a TransferQueue `BatchMeta`
        (row indexes and field names; no tensors), which `fetch` turns into data in any process."""
        return self._claim(step, count, list(ROLLOUT_FIELDS) + list(fields), consumer, timeout_s, stop)

    def _claim(self, step: int, count: int, needed: list[str], consumer: str, timeout_s: float,
               stop: threading.Event | None = None):
        if count < 1:
            raise ValueError(f"claim: count must be >= 1, got {count}")
        pid = partition_id(step)
        deadline, pause = time.monotonic() + timeout_s, POLL_S / 5
        while True:
            # polling mode: all `count` rows, or none yet
            meta = self._client.get_meta(data_fields=needed, batch_size=count, partition_id=pid,
                                         mode="fetch", task_name=consumer)
            if meta.size:
                return meta
            if stop is not None and stop.is_set():
                raise InterruptedError(f"step {step}: stopped while waiting for its rows")
            if time.monotonic() > deadline:
                ready = self._ready(pid, needed, consumer)
                raise TimeoutError(f"step {step}: {count} rows with fields {needed} for {consumer!r} not there "
                                   f"after {timeout_s:g} s ({ready} ready)")
            time.sleep(pause)
            pause = min(pause * 2, POLL_S)

    @staticmethod
    def rank_shards(meta, parts: int) -> list:
        """Claimed rows (`meta`) split over `parts` trainer ranks, each a `BatchMeta` of about the same number
        of tokens (`balance.balanced_shards`, from the token counts `put` gave each row)."""
        from relax_core.data.balance import balanced_shards

        lengths = [row.get(TOKENS, 1) for row in meta.get_all_custom_meta()]
        return [meta.select_samples(shard) for shard in balanced_shards(lengths, parts)]

    def fetch(self, meta, fields: tuple[str, ...] = ()) -> tuple[list[Sample], dict[str, list]]:
        """The claimed rows of `meta` as `Sample`s, and the extra `fields` as one value per row."""
        if meta.size == 0:
            return [], {f: [] for f in fields}
        columns = self._read(meta)
        extra = {f: columns[f] if f in TOKEN_COLUMNS else [scalar(v) for v in columns[f]] for f in fields}
        return _samples_of(columns), extra

    def take(self, step: int, count: int, fields: tuple[str, ...] = (), consumer: str = TRAINER,
             timeout_s: float = 600) -> tuple[list[Sample], dict[str, list]]:
        """`claim` and `fetch` in one process: `count` complete rows of partition `step`, once per consumer."""
        return self.fetch(self.claim(step, count, fields, consumer, timeout_s), fields)

    def clear(self, step: int) -> None:
        """Drop partition `step` (after the trainer consumed it)."""
        self._client.clear_partition(partition_id(step))
        with self._lock:
            self._next_seq.pop(step, None)

    def close(self) -> None:
        """Stop what start() started (TQ actors), or close an attached bus's own client; idempotent."""
        if not self._closed:
            self._closed = True
            if not self._owner:
                self._client.close()
                return
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

    def _read(self, meta) -> dict[str, list]:
        """The columns of the claimed rows `meta` as lists, one value per row: per-token columns unpacked,
        `multimodal` the media its keys name (one dict per key, the same object for every row of a key)."""
        data = self._client.get_data(meta)
        columns = {f: _column(data[f], meta.size) for f in meta.field_names}
        for name in columns.keys() & TOKEN_COLUMNS.keys():
            columns[name] = [unpack_tokens(row, TOKEN_COLUMNS[name]) for row in columns[name]]
        if "multimodal" in columns:
            keys = sorted({key for key in columns["multimodal"] if key is not None})
            media = {}
            if keys:
                found = self._client.kv_retrieve_meta(keys=keys, partition_id=meta.partition_ids[0], create=False)
                media = dict(zip(keys, _column(self._client.get_data(found.select_fields([MEDIA]))[MEDIA],
                                               len(keys))))
            columns["multimodal"] = [None if key is None else media[key] for key in columns["multimodal"]]
        return columns


def _to_columns(samples: list[Sample]):
    """Samples -> (a TensorDict with one column per rollout field, the media rows: key -> `multimodal`, the
    bytes of the per-token columns and the media tensors).

    Per-token columns go as one packed array per row (`pack_tokens`), scalars as plain Python
    values, labels and metadata as JSON text. TransferQueue stores and sends a column row by row:
    raw bytes go inline in its msgpack message, where a tensor per row costs it a pickled header
    and a message frame of its own, and a list a msgpack number per token (put and get through its
    serializer, per-token ids and log-probs: 128 rows of 21 tokens 4 ms as bytes, 15 ms as lists,
    17 ms as tensors; 8 rows of 8704 tokens 19, 61 and 23 ms).
    Rows that share one `multimodal` object (a group's rows: the rollout manager gives them their
    prompt's) share one media row: their `multimodal` column holds its key.
    """
    import torch
    from tensordict import TensorDict

    keys: dict[int, str] = {}  # id(multimodal) -> its media row's key
    media: dict[str, dict] = {}
    for s in samples:
        if s.multimodal is not None and id(s.multimodal) not in keys:
            keys[id(s.multimodal)] = key = uuid.uuid4().hex
            media[key] = s.multimodal

    def values(name: str, kind):
        return plain_column([kind(getattr(s, name)) for s in samples])

    def text(name: str):
        return plain_column([json.dumps(getattr(s, name)) for s in samples])

    nbytes = sum(t.numel() * t.element_size() for m in media.values() for t in m.values()
                 if isinstance(t, torch.Tensor))

    def tokens(name: str):
        nonlocal nbytes
        # an empty row stands for None (token_versions: every token at policy_version)
        rows = [pack_tokens(getattr(s, name) or [], TOKEN_COLUMNS[name]) for s in samples]
        nbytes += sum(len(row) for row in rows)
        return plain_column(rows)

    return TensorDict({
        "prompt_ids": tokens("prompt_ids"), "response_ids": tokens("response_ids"),
        "rollout_logprobs": tokens("rollout_logprobs"), "loss_mask": tokens("loss_mask"),
        "reward": values("reward", float), "group_id": values("group_id", int),
        "policy_version": values("policy_version", int), "token_versions": tokens("token_versions"),
        "sample_id": values("sample_id", int), "finish_reason": text("finish_reason"), "label": text("label"),
        "metadata": text("metadata"),
        "multimodal": plain_column([None if s.multimodal is None else keys[id(s.multimodal)] for s in samples]),
    }, batch_size=len(samples)), media, nbytes


def pack_tokens(values, dtype: str) -> bytes:
    """One row of a per-token column as the raw bytes of a `dtype` array (an id beyond int32 raises)."""
    import numpy as np

    return np.asarray(values, dtype=dtype).tobytes()


def unpack_tokens(row: bytes, dtype: str) -> list:
    """`pack_tokens` undone: the row as a list of Python numbers."""
    import numpy as np

    return np.frombuffer(row, dtype=dtype).tolist()


def plain_column(rows: list):
    """One value per row (a number, a string, bytes or a dict of tensors), stored as Python objects."""
    from tensordict.tensorclass import NonTensorStack

    return NonTensorStack(*rows)


def _column(value: Any, n: int) -> list:
    """One column from get_data as n plain Python values (TQ may return dense columns as nested tensors)."""
    import torch

    if isinstance(value, torch.Tensor) and value.is_nested and value.layout == torch.jagged:
        flat, bounds = value.values().tolist(), value.offsets().tolist()  # one conversion for the whole column
        rows = [flat[a:b] for a, b in zip(bounds, bounds[1:])]
    elif isinstance(value, torch.Tensor):
        rows = [row.tolist() for row in value.unbind(0)]
    else:
        rows = list(value.tolist() if hasattr(value, "tolist") else value)
    if len(rows) != n:
        raise RuntimeError(f"TransferQueue returned {len(rows)} values for {n} rows")
    return rows


def scalar(value: Any) -> Any:
    while isinstance(value, list):  # a scalar stored as [B] may come back as [B, 1]
        value = value[0]
    return value


def _samples_of(cols: dict[str, list]) -> list[Sample]:
    n = len(cols["sample_id"])
    return [Sample(prompt_ids=cols["prompt_ids"][i], response_ids=cols["response_ids"][i],
                   rollout_logprobs=cols["rollout_logprobs"][i], loss_mask=cols["loss_mask"][i],
                   reward=float(scalar(cols["reward"][i])), group_id=int(scalar(cols["group_id"][i])),
                   policy_version=int(scalar(cols["policy_version"][i])),
                   token_versions=cols["token_versions"][i] or None,
                   sample_id=int(scalar(cols["sample_id"][i])),
                   finish_reason=json.loads(cols["finish_reason"][i]), label=json.loads(cols["label"][i]),
                   metadata=json.loads(cols["metadata"][i]), multimodal=cols["multimodal"][i])
            for i in range(n)]
