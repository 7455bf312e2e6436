"""The weight names of a Qwen3-VL / Qwen3-Omni HF directory, for `relax convert-ckpt`.

The torch backend checkpoints the policy's `state_dict()`: for Qwen3-VL the
names of `Qwen3VLForConditionalGeneration`, for Qwen3-Omni those of the
thinker alone. Neither is what the model directory holds: transformers 5
loads a checkpoint through conversions (per-expert MoE weights fused into
one tensor per layer) that its `save_pretrained` reverts, and a full
Qwen3-Omni directory keeps the thinker under `thinker.`, next to the talker
and code2wav. `MediaLayout.saved` turns one shard of checkpoint tensors into
the directory's names with transformers' own `revert_weight_conversion`,
run against the directory's class built on the meta device (no memory), so
the export is exactly what `save_pretrained` would write.

The talker and code2wav were never trained (the run loads the thinker only):
`untrained_weights` lists them in the model directory the run started from,
and the export copies them unchanged.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relax_core.checkpoint.layout import CheckpointError

# model_type -> (class of the whole directory, class Relax trains, prefix of the policy's weights in the directory)
_CLASSES = {
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLForConditionalGeneration", ""),
    "qwen3_omni_moe": ("Qwen3OmniMoeForConditionalGeneration", "Qwen3OmniMoeThinkerForConditionalGeneration",
                       "thinker."),
    "qwen3_omni_moe_thinker": ("Qwen3OmniMoeThinkerForConditionalGeneration",
                               "Qwen3OmniMoeThinkerForConditionalGeneration", ""),
}
# Eager attention and fp32 on both sides of `--verify`, so equal weights give equal logits.
_EXACT = {"attn_implementation": "eager", "dtype": torch.float32}


@dataclass
class MediaLayout:
    """How the policy of a multimodal directory is named and built (see the module docstring)."""

    config: Any  # the directory's PretrainedConfig
    directory_class: type
    policy_class: type
    prefix: str
    meta_model: torch.nn.Module

    @property
    def policy_config(self):
        return self.config.thinker_config if self.prefix else self.config

    def saved(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint-named tensors -> the names `save_pretrained` writes (tied copies left out)."""
        from transformers.core_model_loading import revert_weight_conversion

        tied = self.meta_model.all_tied_weights_keys
        named = {self.prefix + name: t for name, t in tensors.items() if self.prefix + name not in tied}
        return revert_weight_conversion(self.meta_model, named)

    def build_policy(self) -> torch.nn.Module:
        """The policy with random weights, from the config (fp32, eager attention)."""
        return self.policy_class._from_config(self.policy_config, **_EXACT)

    def load_exported(self, out_dir: Path) -> torch.nn.Module:
        """The policy of an exported directory loaded with the directory's own class; missing weights raise."""
        model, info = self.directory_class.from_pretrained(out_dir, output_loading_info=True, **_EXACT)
        if info["missing_keys"]:
            raise CheckpointError(f"{out_dir}: {self.directory_class.__name__} finds no weights for "
                                  f"{sorted(info['missing_keys'])[:5]}")
        return (model.thinker if self.prefix else model).eval()


def media_layout(config_dir: Path) -> MediaLayout | None:
    """The layout of a Qwen3-VL / Qwen3-Omni directory; None for any other model (exported name for name)."""
    import transformers

    model_type = json.loads((config_dir / "config.json").read_text()).get("model_type")
    if model_type not in _CLASSES:
        return None
    directory, policy, prefix = _CLASSES[model_type]
    config = transformers.AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        meta_model = getattr(transformers, directory)._from_config(config)
    return MediaLayout(config, getattr(transformers, directory), getattr(transformers, policy), prefix, meta_model)


def untrained_weights(layout: MediaLayout, source: Path | None) -> dict[str, tuple[Path, int]]:
    """Saved name -> (safetensors file, bytes) of the directory's weights outside the policy (talker, code2wav).

    `source` is the model directory the run started from. Raises when the
    config has a talker (`enable_audio_output`) whose weights are not there.
    """
    if not layout.prefix:
        return {}
    found = {name: entry for path in _weight_files(source) for name, entry in _header_sizes(path).items()
             if not name.startswith(layout.prefix)}
    if not found and getattr(layout.config, "enable_audio_output", False):
        raise CheckpointError(
            f"the talker and code2wav weights are not in the checkpoint (the run trained the thinker only) and "
            f"not in {source}, the model directory it started from: put that directory back to export them")
    return found


def read_untrained(names: list[str], index: dict[str, tuple[Path, int]]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path in dict.fromkeys(index[name][0] for name in names):
        with safe_open(str(path), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in names if index[name][0] == path})
    return out


def _weight_files(source: Path | None) -> list[Path]:
    if source is None or not source.is_dir():
        return []
    return sorted(source.glob("*.safetensors"))


def _header_sizes(path: Path) -> dict[str, tuple[Path, int]]:
    """Tensor name -> (path, bytes), from the safetensors header alone."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return {name: (path, end - start) for name, (start, end) in ((n, h["data_offsets"]) for n, h in header.items())}


def checkpoint_named(model_dir: Path):
    """For engines that load weights by the model directory's own names (SGLang: `load_weights` of its
    Qwen3-VL / Qwen3-Omni model), a function turning the trainer's (name, tensor) stream into those names,
    one parameter at a time (`MediaLayout.saved`: the `thinker.` prefix, fused experts split per expert);
    None for a text model, whose parameter names already are the checkpoint's."""
    layout = media_layout(Path(model_dir))
    if layout is None:
        return None

    def rename(named):
        for name, tensor in named:
            yield from layout.saved({name: tensor}).items()

    return rename
