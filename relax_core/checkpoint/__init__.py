"""Checkpoints in Megatron's layout (torch.distributed.checkpoint) and conversion to Hugging Face.

    layout.py     names (iter_0000100/, latest_checkpointed_iteration.txt), tracker, atomic publish, CheckpointError
    dcp.py        save_checkpoint / load_checkpoint of the whole training state (+ RNG of every rank)
    hf_export.py  export_hf: model section -> safetensors shards + config + tokenizer
    hf_media.py   Qwen3-VL / Qwen3-Omni: the directory's weight names, the untrained talker copied
    hf_verify.py  verify_export: logits of the checkpoint's model vs. the exported one

The names below resolve lazily, so `from relax_core.checkpoint import
CheckpointError` (the CLI) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from relax_core.checkpoint.layout import (
    CheckpointError,
    find_latest,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    list_iterations,
)

_LAZY = {
    "save_checkpoint": "dcp",
    "load_checkpoint": "dcp",
    "export_hf": "hf_export",
    "register_name_mapper": "hf_export",
    "verify_export": "hf_verify",
    "VerificationError": "hf_verify",
}

__all__ = [
    "CheckpointError",
    "find_latest",
    "get_checkpoint_name",
    "get_checkpoint_tracker_filename",
    "list_iterations",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"relax_core.checkpoint.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'relax_core.checkpoint' has no attribute {name!r}")
