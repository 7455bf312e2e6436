"""Read a W&B run's `run-<id>.wandb` file back, for the tests: the records wandb itself wrote.

The file is W&B's transaction log: a 7-byte header (`:W&B`, 0xBEE1, version 0),
then LevelDB's log format (32 KiB blocks of chunks, each `crc32c, length,
type`: 1 full, 2 first, 3 middle, 4 last), each record a `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B transaction log"
    offset, pending = 7, b""
    while offset + HEADER.size <= len(data):
        room = BLOCK - offset % BLOCK
        if room < HEADER.size:  # the block's tail is padding
            offset += room
            continue
        _, length, kind = HEADER.unpack_from(data, offset)
        if kind == 0 and length == 0:  # zeros: the rest of the block is unused
            offset += room
            continue
        chunk = data[offset + HEADER.size: offset + HEADER.size + length]
        offset += HEADER.size + length
        if kind in (FULL, FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def history(path: Path) -> list[dict]:
    """Every `run.log` row of the file, as {metric: value}."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def run_info(path: Path) -> tuple[str, str]:
    """(run id, project) of the file's run record."""
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run.run_id, record.run.project
    raise AssertionError(f"{path}: no run record")
