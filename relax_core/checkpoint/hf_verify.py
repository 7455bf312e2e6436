"""Check an exported HF directory against the checkpoint it came from (`convert-ckpt --verify`).

Two independent routes to the same model: (a) the checkpoint's own HF
config with the weights read straight from the DCP files into a model
built by `from_config` (a Megatron checkpoint: the megatron-core model built
from that config, its weights loaded by `dist_checkpointing`, on one rank),
and (b) `AutoModelForCausalLM.from_pretrained` on the exported directory,
which exercises the safetensors shards, the index and the config as any
downstream user would. Both run on a fixed batch of token ids in fp32; their
logits must agree.

A Qwen3-VL / Qwen3-Omni export is loaded with the directory's own class
(for Omni the full `Qwen3OmniMoeForConditionalGeneration`, every weight
present, its `.thinker` compared) and both models see one chat prompt
with an image (and a second of audio for Omni), made by the exported
processor files through `models.multimodal`, the code the run fed its
policy with.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from relax_core.checkpoint.hf_export import ModelSection
from relax_core.checkpoint.hf_media import MediaLayout, media_layout
from relax_core.checkpoint.layout import CheckpointError

DEFAULT_ATOL = 1e-5
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class VerificationError(CheckpointError):
    """The exported model does not reproduce the checkpoint's model."""


def verify_export(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    iteration: int | None = None,
    *,
    atol: float = DEFAULT_ATOL,
    batch_size: int = 2,
    seq_len: int = 16,
    seed: int = 0,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Compare logits of the checkpoint's model and the exported model.

    `trust_remote_code`: load a model that ships its own code (`auto_map`), as the run did.

    Returns:
        {"iteration", "max_abs_diff", "atol", "tokens": [batch, seq],
         "num_parameters", "tokenizer": class name or None}.

    Raises:
        VerificationError: logits differ by more than `atol`, weights are
            missing, or the exported tokenizer does not load.
    """
    # A checkpoint saved without hf_dir was exported with an explicit config dir: use the export's copy.
    section = ModelSection(ckpt_dir, iteration, fallback_config_dir=out_dir)
    if "auto_map" in section.config and not trust_remote_code:
        raise CheckpointError(f"{section.config_dir / 'config.json'}: the model ships its own code (auto_map); "
                              "verifying it runs that code: pass --trust-remote-code if you trust it")
    media = media_layout(section.config_dir)
    if section.meta.get("model_naming") == "megatron":  # the Megatron model itself, built from the checkpoint
        from relax_core.checkpoint.megatron import reference_model

        reference = reference_model(section.iter_dir, section.config)
    else:
        reference = _model_from_checkpoint(section, trust_remote_code, media)
    if media is None:
        exported = _load_exported(Path(out_dir), trust_remote_code)
        inputs = {"input_ids": _fixed_batch(reference.config.vocab_size, batch_size, seq_len, seed)}
    else:
        exported = media.load_exported(Path(out_dir))
        inputs = _media_batch(Path(out_dir), reference, seed)
    diff = _max_logit_diff(reference, exported, inputs)
    if not diff <= atol:  # also catches NaN
        raise VerificationError(f"{out_dir}: logits differ from checkpoint {section.iter_dir} by {diff:.3g} > {atol:g}")
    return {
        "iteration": section.iteration,
        "max_abs_diff": diff,
        "atol": atol,
        "tokens": list(inputs["input_ids"].shape),
        "num_parameters": sum(p.numel() for p in exported.parameters()),
        "tokenizer": _tokenizer_class(Path(out_dir), trust_remote_code),
    }


def _model_from_checkpoint(section: ModelSection, trust_remote_code: bool,
                           media: MediaLayout | None) -> torch.nn.Module:
    """The policy the run trained (for Omni the thinker alone), holding the checkpoint's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if media is not None:
        model, config = media.build_policy(), media.policy_config
    else:
        config = AutoConfig.from_pretrained(section.config_dir, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32,
                                                 trust_remote_code=trust_remote_code)
    weights = section.read_hf(list(section.entries))
    result = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise VerificationError(
            f"{section.iter_dir}: weights do not fit {config.architectures}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}"
        )
    return model.float().eval()


def _load_exported(out_dir: Path, trust_remote_code: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager", dtype=torch.float32,
                                                 trust_remote_code=trust_remote_code)
    return model.float().eval()


def _fixed_batch(vocab_size: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)


def _media_batch(out_dir: Path, model: torch.nn.Module, seed: int) -> dict[str, Any]:
    """`model(**kwargs)` for one chat prompt with a random 64x64 image (and 1 s of audio for Omni)."""
    import numpy as np

    from relax_core.models import multimodal

    processor = multimodal.load_processor(out_dir)
    omni = processor.family == "qwen3_omni"
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    audios = [0.1 * rng.standard_normal(16000).astype(np.float32)] if omni else []
    text, _ = multimodal.chat_prompt(processor, "verify", n_images=1, n_audios=len(audios))
    sample = multimodal.process(processor, text, images=[image], audios=audios)
    ids = torch.tensor([sample.input_ids])
    return multimodal.model_inputs(model, ids, torch.ones_like(ids), [sample.tensors])


@torch.no_grad()
def _max_logit_diff(a: torch.nn.Module, b: torch.nn.Module, inputs: dict[str, Any]) -> float:
    return (a(**inputs).logits - b(**inputs).logits).abs().max().item()


def _tokenizer_class(out_dir: Path, trust_remote_code: bool) -> str | None:
    """Load the exported tokenizer when the export has one; a broken one fails verification."""
    if not any((out_dir / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(out_dir, trust_remote_code=trust_remote_code)
        tokenizer("verify")
    except Exception as err:
        raise VerificationError(f"{out_dir}: tokenizer does not load ({type(err).__name__}: {err})") from err
    return type(tokenizer).__name__
