"""Convert one checkpoint iteration into a Hugging Face model directory.

`relax convert-ckpt CKPT --out HF_DIR` lands here: the "model" section of
the DCP checkpoint is read shard by shard (the optimizer is never touched,
and memory stays about one output shard), weight names are mapped to HF
names, and safetensors shards (+ `model.safetensors.index.json` when there
is more than one) are written together with the config, generation config
and tokenizer files copied into `CKPT/hf_config/` at save time. The result
loads with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`.
A Qwen3-VL / Qwen3-Omni checkpoint is written under the directory's own names
and with its untrained talker copied (`hf_media`), so it loads with its own
class (`Qwen3OmniMoeForConditionalGeneration`, ...) and with the processor
files copied next to it. `hf_verify.verify_export` checks it against the checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from relax_core.checkpoint import dcp_io, layout
from relax_core.checkpoint.dcp import read_saved_paths
from relax_core.checkpoint.hf_files import copy_config_files
from relax_core.checkpoint.hf_media import MediaLayout, media_layout, read_untrained, untrained_weights
from relax_core.checkpoint.layout import CheckpointError

DEFAULT_SHARD_BYTES = 5_000_000_000  # transformers' default max_shard_size "5GB"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CKPT, SOURCE = "checkpoint", "source"  # where a planned tensor is read from

# (checkpoint weight name, tensor, HF config) -> [(HF name, tensor), ...]. A list,
# because a backend with fused weights (Megatron's linear_qkv) maps one tensor to several.
NameMapper = Callable[[str, torch.Tensor, dict[str, Any]], list[tuple[str, torch.Tensor]]]


def _hf_names(name: str, tensor: torch.Tensor, config: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor)]  # the torch backend trains the HF model itself


def _megatron_names(name: str, tensor: torch.Tensor, config: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    from relax_core.train.megatron.hf_weights import checkpoint_to_hf  # torch only, no megatron-core

    return checkpoint_to_hf(name, tensor, config)


# The one place where checkpoint weight names become HF names, keyed by the
# `model_naming` recorded in relax_meta.json ("megatron": a Megatron distributed checkpoint's global keys).
NAME_MAPPERS: dict[str, NameMapper] = {"hf": _hf_names, "megatron": _megatron_names}


def register_name_mapper(naming: str, mapper: NameMapper) -> None:
    NAME_MAPPERS[naming] = mapper


def name_mapper(naming: str, meta_path: Path) -> NameMapper:
    if naming not in NAME_MAPPERS:
        raise CheckpointError(
            f"{meta_path}: model_naming {naming!r} has no HF name mapping (known: {', '.join(sorted(NAME_MAPPERS))})"
        )
    return NAME_MAPPERS[naming]


class ModelSection:
    """The model weights of one iteration, readable in groups without loading the rest."""

    def __init__(
        self,
        ckpt_dir: str | os.PathLike,
        iteration: int | None,
        config_dir: str | os.PathLike | None = None,
        fallback_config_dir: str | os.PathLike | None = None,
    ):
        """HF config from `config_dir`, else the checkpoint's `hf_config/`, else `fallback_config_dir`."""
        self.iteration, self.iter_dir = layout.resolve_iteration(ckpt_dir, iteration)
        self.meta = layout.read_meta(self.iter_dir)
        self.config_dir = _config_dir(Path(ckpt_dir), self.iter_dir, self.meta, config_dir, fallback_config_dir)
        self.config: dict[str, Any] = json.loads((self.config_dir / "config.json").read_text())
        self.metadata: Metadata = dcp_io.read_metadata(self.iter_dir)
        self.mapper = name_mapper(self.meta.get("model_naming", "hf"), self.iter_dir / layout.META_FILENAME)
        self.entries = self._tensor_entries()

    def _tensor_entries(self) -> dict[str, str]:
        """DCP name -> checkpoint weight name, for the tensors of the model section."""
        key = self.meta.get("model_key", "model")
        if self.meta.get("model_naming") == "megatron":  # no paths object: the DCP keys are the names
            from relax_core.checkpoint.megatron import model_keys

            return {name: name for name in model_keys(self.metadata)}
        paths = read_saved_paths(self.iter_dir, self.metadata, collective=False)
        saved = self.metadata.state_dict_metadata
        entries = {
            name: str(path[1][0])
            for name, path in paths.items()
            if path[0][0] == key and len(path) == 2 and isinstance(saved[name], TensorStorageMetadata)
        }
        if not entries:
            raise CheckpointError(f"{self.iter_dir} holds no model weights (no '{key}' section)")
        return entries

    def nbytes(self, name: str) -> int:
        entry = self.metadata.state_dict_metadata[name]
        return entry.size.numel() * entry.properties.dtype.itemsize

    def read_hf(self, names: list[str]) -> dict[str, torch.Tensor]:
        """HF-named tensors for the given DCP names (tied output embedding left out)."""
        flat = {name: dcp_io.empty_entry(self.metadata, name) for name in names}
        dcp_io.load_flat(self.iter_dir, flat, collective=False)
        out: dict[str, torch.Tensor] = {}
        for name in names:
            out.update(self.mapper(self.entries[name], flat.pop(name), self.config))
        if self.config.get("tie_word_embeddings"):
            out.pop("lm_head.weight", None)  # transformers re-ties it to the input embedding
        return out


def export_hf(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    iteration: int | None = None,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    config_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the model of one iteration (latest when None) as an HF directory.

    Args:
        shard_bytes: largest size of one safetensors file (a larger tensor gets a file of its own).
        config_dir: HF directory to take config/tokenizer files from, for
            checkpoints saved without `hf_dir` (default: `CKPT/hf_config/`).
        overwrite: replace an existing non-empty `out_dir`.

    Returns:
        `out_dir`.
    """
    if shard_bytes < 1:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    section = ModelSection(ckpt_dir, iteration, config_dir)
    media = media_layout(section.config_dir)
    untrained = untrained_weights(media, _source_dir(section, config_dir)) if media else {}
    out = Path(out_dir)
    staging = _staging_for(out, overwrite)
    sizes = {**{(CKPT, name): section.nbytes(name) for name in section.entries},
             **{(SOURCE, name): size for name, (_, size) in untrained.items()}}
    shards = _plan_shards(sizes, shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(shards):
        filename = SAFE_WEIGHTS_NAME if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = _read_shard(section, media, untrained, group)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(_write_shard(staging / filename, tensors))
    if len(shards) > 1:
        _write_index(staging, weight_map, total)
    copy_config_files(section.config_dir, staging)
    _publish(staging, out)
    return out


def _config_dir(root: Path, iter_dir: Path, meta: dict[str, Any], explicit, fallback) -> Path:
    if explicit is not None:
        path = Path(explicit)
    elif meta.get("hf_config_dir"):
        path = root / meta["hf_config_dir"]
    elif fallback is not None:
        path = Path(fallback)
    else:
        raise CheckpointError(
            f"{iter_dir / layout.META_FILENAME} names no HF config (saved without hf_dir); "
            "pass the model directory as config_dir"
        )
    if not (path / "config.json").is_file():
        raise CheckpointError(f"missing {path / 'config.json'}: the HF config of this checkpoint is gone")
    return path


def _source_dir(section: ModelSection, explicit) -> Path | None:
    """The model directory the run started from: where the weights it did not train are."""
    source = explicit if explicit is not None else section.meta.get("hf_source")
    return Path(source) if source else None


def _read_shard(section: ModelSection, media: MediaLayout | None, untrained: dict, group: list[tuple[str, str]]):
    """HF-named tensors of one planned shard: checkpoint weights (renamed for a multimodal directory),
    then weights copied from the source directory."""
    tensors = section.read_hf([name for kind, name in group if kind == CKPT])
    if media is not None:
        tensors = media.saved(tensors)
    return tensors | read_untrained([name for kind, name in group if kind == SOURCE], untrained)


def _plan_shards(sizes: dict[tuple[str, str], int], shard_bytes: int) -> list[list[tuple[str, str]]]:
    """Greedy, in order: start a new shard when the next tensor would overflow it."""
    shards: list[list[tuple[str, str]]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    from safetensors.torch import save_file

    # safetensors refuses tensors that share memory (a mapper may return views of one fused tensor).
    seen: set[int] = set()
    for name, tensor in tensors.items():
        ptr = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.contiguous().clone() if ptr in seen else tensor.contiguous()
        seen.add(ptr)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return {name: path.name for name in tensors}


def _write_index(directory: Path, weight_map: dict[str, str], total: int) -> None:
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _staging_for(out: Path, overwrite: bool) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise CheckpointError(f"{out} exists and is not empty; choose another --out or allow overwriting")
    staging = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _publish(staging: Path, out: Path) -> None:
    """Rename the finished directory into place, so `out` is never half written."""
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    os.rename(staging, out)
