"""Check an exported HF directory against the checkpoint it came from (`convert-ckpt --verify`).

Two independent routes to the same model: (a) the checkpoint's own HF
config with the weights read straight from the DCP files into a model
built by `from_config` (a Megatron checkpoint: the megatron-core model built
from that config, its weights loaded by `dist_checkpointing`, on one rank),
and (b) `AutoModelForCausalLM.from_pretrained` on the exported directory,
which exercises the safetensors shards, the index and the config as any
downstream user would. Both run on a fixed batch of token ids; their
logits must agree. A Megatron checkpoint's weights must also be the
exported ones, bit for bit (the megatron-core model's, rebuilt as HF
tensors by `hf_weights.gather_hf`, against the exported files).

Memory stays about one model: the two are built one after the other (the
first one's logits kept, the model dropped), each in the model's own dtype
(what a Megatron checkpoint holds its weights in; for the torch backend's,
whose checkpoints hold fp32 master weights, the config's `dtype`), on the
GPU when there is one, the inputs with it. In fp32 the logits agree to
`atol`; in bf16 / fp16 the two implementations round differently, so the
bound grows with the logits' scale (`tolerance`).

A Qwen3-VL / Qwen3-Omni export is loaded with the directory's own class
(for Omni the full `Qwen3OmniMoeForConditionalGeneration`, every weight
present, its `.thinker` compared) and both models see one chat prompt
with an image (and a second of audio for Omni), made by the exported
processor files through `models.multimodal`, the code the run fed its
policy with (fp32, on the CPU: `hf_media`).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import torch

from relax_core.checkpoint.hf_export import CKPT, ModelSection, _plan_shards
from relax_core.checkpoint.hf_media import MediaLayout, media_layout
from relax_core.checkpoint.layout import CheckpointError

DEFAULT_ATOL = 1e-5
# bf16 / fp16: the share of the largest |logit| two implementations may differ by, each rounding its activations
# in its own order (4 units in the last place of bf16's 8-bit mantissa). A wrong weight, which such a bound
# could hide, is caught exactly by the weight comparison (Megatron checkpoints).
HALF_RTOL = 2 ** -6
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
        {"iteration", "max_abs_diff", "atol" (the bound applied), "dtype", "device", "tokens": [batch, seq],
         "num_parameters", "tokenizer": class name or None}.

    Raises:
        VerificationError: logits differ by more than the bound, weights are
            missing or differ, or the exported tokenizer does not load.
    """
    # A checkpoint saved without hf_dir was exported with an explicit config dir: use the export's copy.
    section = ModelSection(ckpt_dir, iteration, fallback_config_dir=out_dir)
    if "auto_map" in section.config and not trust_remote_code:
        raise CheckpointError(f"{section.config_dir / 'config.json'}: the model ships its own code (auto_map); "
                              "verifying it runs that code: pass --trust-remote-code if you trust it")
    out = Path(out_dir)
    media = media_layout(section.config_dir)
    megatron = section.meta.get("model_naming") == "megatron"
    device = "cuda" if torch.cuda.is_available() and media is None else "cpu"
    dtype = torch.float32 if media is not None else _model_dtype(section, megatron)
    if megatron:  # the Megatron model itself, built from the checkpoint
        from relax_core.checkpoint.megatron import reference_model

        reference = reference_model(section.iter_dir, section.config, dtype=dtype, device=device)
    else:
        reference = _model_from_checkpoint(section, trust_remote_code, media, dtype, device)
    if media is None:
        inputs = {"input_ids": _fixed_batch(reference.config.vocab_size, batch_size, seq_len, seed).to(device)}
    else:
        inputs = _media_batch(out, reference, seed)
    expected = _logits(reference, inputs)
    if megatron:
        _check_weights(reference.model, section.config, out)
    del reference
    _release(device)
    exported = media.load_exported(out) if media is not None else _load_exported(out, trust_remote_code, dtype,
                                                                                   device)
    diff = (_logits(exported, inputs) - expected).abs().max().item()
    num_parameters = sum(p.numel() for p in exported.parameters())
    del exported
    _release(device)
    bound = tolerance(atol, dtype, expected)
    if not diff <= bound:  # also catches NaN
        raise VerificationError(f"{out_dir}: logits differ from checkpoint {section.iter_dir} by {diff:.3g} > "
                                f"{bound:.3g} ({str(dtype).removeprefix('torch.')})")
    return {
        "iteration": section.iteration,
        "max_abs_diff": diff,
        "atol": bound,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "tokens": list(inputs["input_ids"].shape),
        "num_parameters": num_parameters,
        "tokenizer": _tokenizer_class(out, trust_remote_code),
    }


def tolerance(atol: float, dtype: torch.dtype, logits: torch.Tensor) -> float:
    """The largest logit difference allowed: `atol` in fp32; in a half type also `HALF_RTOL` of the
    largest |logit| (each implementation rounds its activations to the dtype in its own order)."""
    if dtype == torch.float32:
        return atol
    return atol + HALF_RTOL * logits.abs().max().item()


def _model_dtype(section: ModelSection, megatron: bool) -> torch.dtype:
    """A Megatron checkpoint's weights are the run's parameters (bf16 in a bf16 run); the torch backend's are
    fp32 master weights, verified in the model's own dtype (its config's)."""
    if megatron:
        from relax_core.checkpoint.megatron import saved_dtype

        return saved_dtype(section.metadata)
    name = section.config.get("dtype") or section.config.get("torch_dtype") or "float32"
    return getattr(torch, name) if name in ("float32", "bfloat16", "float16") else torch.float32


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _check_weights(model: torch.nn.Module, config: dict[str, Any], out_dir: Path) -> None:
    """Every HF tensor of the megatron-core model (`gather_hf`) equals the exported one, one at a time."""
    from safetensors import safe_open

    from relax_core.train.megatron.hf_weights import gather_hf
    from relax_core.train.megatron.trainer import _safetensors

    handles = _safetensors(out_dir, safe_open)
    for name, tensor in gather_hf(model, config):
        if name not in handles:
            raise VerificationError(f"{out_dir}: {name} is not in the exported files")
        if not torch.equal(handles[name].get_tensor(name), tensor.cpu()):
            raise VerificationError(f"{out_dir}: {name} differs from the checkpoint's")


def _model_from_checkpoint(section: ModelSection, trust_remote_code: bool, media: MediaLayout | None,
                           dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The policy the run trained (for Omni the thinker alone), holding the checkpoint's weights, built in
    `dtype` on `device` and filled a group of tensors at a time (never the whole checkpoint in memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if media is not None:
        model, config = media.build_policy(), media.policy_config
    else:
        config = AutoConfig.from_pretrained(section.config_dir, trust_remote_code=trust_remote_code)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
    expected, loaded = set(model.state_dict()), set()
    for group in _groups(section):
        weights = section.read_hf(group)
        model.load_state_dict(weights, strict=False)
        loaded |= set(weights)
        del weights
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing, unexpected = expected - loaded - tied, loaded - expected
    if missing or unexpected:
        raise VerificationError(
            f"{section.iter_dir}: weights do not fit {config.architectures}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    return model.eval()


def _groups(section: ModelSection, limit: int = 1 << 30) -> list[list[str]]:
    """The checkpoint's model tensors in groups of about `limit` bytes (a larger tensor alone)."""
    planned = _plan_shards({(CKPT, name): section.nbytes(name) for name in section.entries}, limit)
    return [[name for _, name in group] for group in planned]


def _load_exported(out_dir: Path, trust_remote_code: bool, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager", dtype=dtype,
                                                 trust_remote_code=trust_remote_code)
    return model.to(device).eval()


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
def _logits(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    return model(**inputs).logits.float().cpu()


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
