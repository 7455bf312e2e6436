"""The small non-weight files of a Hugging Face model directory.

A checkpoint keeps a copy of the model's `config.json`,
`generation_config.json`, tokenizer and processor files (`CKPT/hf_config/`),
written once by the first save, so `relax convert-ckpt` can rebuild a
complete HF directory from the checkpoint alone, even after the original
model directory is gone. Stdlib only.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from relax_core.checkpoint.layout import HF_CONFIG_DIRNAME, CheckpointError, fsync_dir, tmp_dir_for

# Weight files stay behind: the weights come from the checkpoint itself.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
_WEIGHT_INDEX_SUFFIX = ".index.json"


def is_config_file(path: Path) -> bool:
    """True for config, tokenizer, processor and chat-template files; False for weights."""
    name = path.name
    return path.is_file() and not name.startswith(".") and not name.endswith(_WEIGHT_SUFFIXES + (_WEIGHT_INDEX_SUFFIX,))


def copy_config_files(src: Path, dst: Path) -> list[str]:
    """Copy the top-level non-weight files of `src` into `dst`; returns their names."""
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src / 'config.json'} not found: {src} is not a Hugging Face model directory")
    dst.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in src.iterdir() if is_config_file(p))
    for name in names:
        shutil.copyfile(src / name, dst / name)
    return names


def ensure_hf_config(ckpt_dir: Path, hf_dir: str | os.PathLike) -> Path:
    """`CKPT/hf_config/`, copied from `hf_dir` the first time (staged, then renamed)."""
    final = ckpt_dir / HF_CONFIG_DIRNAME
    if final.is_dir():
        return final
    staging = tmp_dir_for(ckpt_dir, HF_CONFIG_DIRNAME)
    shutil.rmtree(staging, ignore_errors=True)
    copy_config_files(Path(hf_dir), staging)
    fsync_dir(staging)
    os.rename(staging, final)
    return final
