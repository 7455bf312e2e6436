"""Tiny random-weight models and character-level tokenizers, built locally.

The quick start and the tests need a real causal LM and a real tokenizer
without downloading anything. This module writes an ordinary Hugging Face
model directory (Qwen3 architecture, random weights, a character-level
`tokenizers` tokenizer with a Qwen-style chat template), which every other
part of Relax then loads through the same code as a real checkpoint:
`AutoModelForCausalLM.from_pretrained(dir)` / `AutoTokenizer.from_pretrained(dir)`.

The multimodal architectures (`qwen3_vl`, `qwen3_omni`) write what the real
Qwen3-VL / Qwen3-Omni checkpoints hold, shrunk: the model (for Omni the full
`Qwen3OmniMoeForConditionalGeneration` without the talker, so the weights sit
under `thinker.` as in Qwen3-Omni-30B-A3B), the tokenizer extended with the
family's media tokens, the family's chat template and a processor saved with
`save_pretrained`; `models/multimodal.py` loads them like a real checkpoint.
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Characters the chat template itself needs ("user", "assistant", "system", newlines).
TEMPLATE_CHARS = "\n :" + "".join(sorted(set("systemuserassistant")))
DEFAULT_ALPHABET = string.ascii_lowercase + string.digits + " +-=?.,"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# The media tokens of the real Qwen3-VL / Qwen3-Omni tokenizers, by the tokenizer attribute the
# processors read them from (Qwen3OmniMoeProcessor requires the attributes; Qwen3VLProcessor uses them when set).
VISION_TOKENS = {
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
}
AUDIO_TOKENS = {
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "audio_token": "<|audio_pad|>",
}
# Qwen3-VL's processor writes "<1.5 seconds>" before each video frame.
TIMESTAMP_CHARS = "<>.0123456789 seconds"


def _vocabulary(alphabet: str, media_tokens: tuple[str, ...] = (), extra_chars: str = "") -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + media_tokens)}
    for ch in dict.fromkeys(TEMPLATE_CHARS + extra_chars + alphabet):  # ordered, unique
        vocab.setdefault(ch, len(vocab))
    return vocab


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, media_tokens: dict[str, str] | None = None):
    """A fast tokenizer with one token per character plus Qwen's special tokens.

    A BPE model with no merges splits any string into single characters, so
    every character of `alphabet` (and of the chat template) is one token.
    `media_tokens` (tokenizer attribute -> token, e.g. VISION_TOKENS) adds a
    multimodal family's special tokens and the characters of its processor's
    video timestamps.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    media = tuple((media_tokens or {}).values())
    vocab = _vocabulary(alphabet, media, TIMESTAMP_CHARS if media else "")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.decoder = decoders.Fuse()  # join characters back without separators
    backend.add_special_tokens(list(SPECIAL_TOKENS + media))
    extra = {"extra_special_tokens": dict(media_tokens)} if media else {}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
        **extra,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_qwen3_config(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
):
    """A Qwen3 config small enough to train on two CPU cores."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        intermediate_size=intermediate_size or 2 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )


def _media_chat_template(audio: bool) -> str:
    """The Qwen3-VL / Qwen3-Omni chat template, reduced to what Relax renders.

    A message's content is a string or a list of items; an image, video or
    audio item becomes its placeholder between the family's start/end tokens
    (the processor expands the pad token to one per encoder output), exactly
    as the real templates write them.
    """
    audio_item = (
        "{% elif item['type'] == 'audio' or 'audio' in item %}{{ '<|audio_start|><|audio_pad|><|audio_end|>' }}"
        if audio else ""
    )
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for item in message['content'] %}"
        "{% if item['type'] == 'image' or 'image' in item %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
        "{% elif item['type'] == 'video' or 'video' in item %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
        + audio_item +
        "{% elif 'text' in item %}{{ item['text'] }}"
        "{% endif %}{% endfor %}{% endif %}"
        "{{ '<|im_end|>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )


# Tiny vision tower: 16-pixel patches merged 2x2, two frames per temporal patch, so a 64x64 image is
# 4 tokens; images and frames are resized to between 32x32 and 128x128 pixels (at most 16 tokens each).
VISION = {"patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}
IMAGE_PIXELS = {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}
VIDEO_PIXELS = {"shortest_edge": 2 * 32 * 32, "longest_edge": 8 * 128 * 128}  # summed over frames


def _mrope(head_dim: int) -> dict:
    """Interleaved M-RoPE over (t, h, w), the rotary half of `head_dim` split as evenly as it goes."""
    half = head_dim // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    return {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": section, "mrope_interleaved": True}


def _vision_config(out_hidden_size: int) -> dict:
    return dict(VISION, depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=out_hidden_size,
                num_position_embeddings=64, deepstack_visual_indexes=[0])


def _text_config(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                 max_position_embeddings, eos_token_id, pad_token_id) -> dict:
    head_dim = hidden_size // num_heads
    return dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                intermediate_size=intermediate_size or 2 * hidden_size,
                max_position_embeddings=max_position_embeddings, rope_parameters=_mrope(head_dim),
                eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None)


def tiny_qwen3_vl_config(vocab_size: int, *, token_ids: dict[str, int], hidden_size: int = 64, num_layers: int = 2,
                         num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int | None = None,
                         max_position_embeddings: int = 512, eos_token_id: int | None = None,
                         pad_token_id: int | None = None):
    """A Qwen3-VL config: the text part from the recipe's sizes, a 2-block 32-wide vision tower."""
    from transformers import Qwen3VLConfig

    text = _text_config(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                        max_position_embeddings, eos_token_id, pad_token_id)
    return Qwen3VLConfig(
        text_config=text, vision_config=_vision_config(hidden_size), tie_word_embeddings=False,
        image_token_id=token_ids["image_token"], video_token_id=token_ids["video_token"],
        vision_start_token_id=token_ids["vision_bos_token"], vision_end_token_id=token_ids["vision_eos_token"],
        eos_token_id=eos_token_id, pad_token_id=pad_token_id,
    )


def tiny_qwen3_omni_config(vocab_size: int, *, token_ids: dict[str, int], hidden_size: int = 64,
                           num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                           intermediate_size: int | None = None, max_position_embeddings: int = 512,
                           eos_token_id: int | None = None, pad_token_id: int | None = None):
    """A Qwen3-Omni config without the talker: a thinker whose text model is a 4-expert MoE (2 per token)
    of the recipe's sizes, with the VL tiny vision tower and a 1-layer 32-wide audio encoder."""
    from transformers import Qwen3OmniMoeConfig

    text = _text_config(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                        max_position_embeddings, eos_token_id, pad_token_id)
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=text["intermediate_size"])
    audio = dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=hidden_size, downsample_hidden_size=8, n_window=50, n_window_infer=100,
                 max_source_positions=1500)
    thinker = dict(
        text_config=text, vision_config=_vision_config(hidden_size), audio_config=audio,
        audio_token_id=token_ids["audio_token"], image_token_id=token_ids["image_token"],
        video_token_id=token_ids["video_token"], audio_start_token_id=token_ids["audio_bos_token"],
        vision_start_token_id=token_ids["vision_bos_token"], vision_end_token_id=token_ids["vision_eos_token"],
        audio_end_token_id=token_ids["audio_eos_token"], user_token_id=token_ids["vision_bos_token"],
        tie_word_embeddings=False,
    )
    return Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=False)


def _write_processor(out: Path, architecture: str, chat_template: str) -> None:
    """Write the processor files of a real Qwen3-VL / Qwen3-Omni checkpoint (`preprocessor_config.json`,
    `video_preprocessor_config.json`, `chat_template.jinja`).

    Written from dicts, not by `save_pretrained`: transformers 5 cannot build a
    processor with a video processor unless torchvision is installed, and the
    files must not depend on that (multimodal.load_processor reads them either way).
    """
    import json

    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    omni = architecture == "qwen3_omni"
    processor_class = "Qwen3OmniMoeProcessor" if omni else "Qwen3VLProcessor"
    half = [0.5, 0.5, 0.5]
    patches = {"patch_size": VISION["patch_size"], "merge_size": VISION["spatial_merge_size"],
               "temporal_patch_size": VISION["temporal_patch_size"], "image_mean": half, "image_std": half}
    image = Qwen2VLImageProcessorPil(size=IMAGE_PIXELS, **patches).to_dict()
    image.update(image_processor_type="Qwen2VLImageProcessor", processor_class=processor_class)
    video = dict(patches, size=VIDEO_PIXELS, do_resize=True, do_rescale=True, rescale_factor=1 / 255,
                 do_normalize=True, do_convert_rgb=True, resample=3, fps=2, min_frames=2, max_frames=64,
                 processor_class=processor_class)
    if omni:  # Qwen3-Omni keeps its Whisper feature extractor in the same file, and Qwen2-VL's video processor
        image.update(WhisperFeatureExtractor(feature_size=128, sampling_rate=16000).to_dict())
        video.update(size=IMAGE_PIXELS, video_processor_type="Qwen2VLVideoProcessor")
    else:
        video["video_processor_type"] = "Qwen3VLVideoProcessor"
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2, default=list) + "\n")
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(chat_template)


def _build_media_model(out: Path, architecture: str, alphabet: str, seed: int, sizes: dict) -> None:
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration, Qwen3VLForConditionalGeneration

    omni = architecture == "qwen3_omni"
    media = {**VISION_TOKENS, **(AUDIO_TOKENS if omni else {})}
    tokenizer = build_char_tokenizer(alphabet, media)
    tokenizer.chat_template = _media_chat_template(audio=omni)
    config = CONFIG_BUILDERS[architecture](
        len(tokenizer), token_ids={k: tokenizer.convert_tokens_to_ids(v) for k, v in media.items()},
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **sizes,
    )
    model_class = Qwen3OmniMoeForConditionalGeneration if omni else Qwen3VLForConditionalGeneration
    _write_model(out, lambda: model_class._from_config(config, dtype=torch.float32), tokenizer, seed)
    _write_processor(out, architecture, tokenizer.chat_template)


def _write_model(out: Path, build, tokenizer, seed: int) -> None:
    """`build()` under `seed` (random weights, the same for every process), saved with `tokenizer` into `out`."""
    import torch
    from transformers import GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


# `model.architecture` of a tiny recipe -> the function that builds its config (the schema's Literal lists these).
CONFIG_BUILDERS = {"qwen3": tiny_qwen3_config, "qwen3_vl": tiny_qwen3_vl_config, "qwen3_omni": tiny_qwen3_omni_config}


def materialize_tiny_model(
    out_dir: str | Path,
    *,
    architecture: str = "qwen3",
    seed: int = 0,
    alphabet: str = DEFAULT_ALPHABET,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
) -> Path:
    """Write a random-weight model of `architecture` and its tokenizer (and processor) as an HF directory.

    The same seed and sizes always give the same weights, so every process of
    a run (trainer ranks, engines) that materialises the model agrees.

    Returns:
        The directory, loadable with `from_pretrained`.
    """
    if architecture not in CONFIG_BUILDERS:
        raise ValueError(f"no tiny model of architecture {architecture!r} (known: {', '.join(CONFIG_BUILDERS)})")
    out = Path(out_dir)
    if architecture != "qwen3":
        sizes = dict(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings)
        _build_media_model(out, architecture, alphabet, seed, sizes)
        return out
    tokenizer = build_char_tokenizer(alphabet)
    config = qwen3_config_dict(len(tokenizer), hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, intermediate_size=intermediate_size or 2 * hidden_size,
                               max_position_embeddings=max_position_embeddings,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    _write_qwen3(out, config, tokenizer, seed)
    return out


def qwen3_config_dict(vocab_size: int, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                      intermediate_size: int, max_position_embeddings: int, eos_token_id: int,
                      pad_token_id: int) -> dict:
    """The `config.json` that `tiny_qwen3_config(...).save_pretrained` writes, without importing transformers'
    configuration code (which imports torch: 3 s of the driver's start-up)."""
    from importlib.metadata import version

    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": None, "dtype": "float32", "eos_token_id": eos_token_id,
        "head_dim": hidden_size // num_heads, "hidden_act": "silu", "hidden_size": hidden_size,
        "initializer_range": 0.02, "intermediate_size": intermediate_size,
        "layer_types": ["full_attention"] * num_layers, "max_position_embeddings": max_position_embeddings,
        "max_window_layers": 28, "num_attention_heads": num_heads, "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads, "pad_token_id": pad_token_id, "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "sliding_window": None,
        "tie_word_embeddings": False, "transformers_version": version("transformers"), "use_cache": True,
        "use_sliding_window": False, "vocab_size": vocab_size,
    }


def qwen3_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a Qwen3ForCausalLM (untied embeddings, no biases) of `config`."""
    h, v, i = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    d, q, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                   p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, q * d),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    return shapes


def _write_qwen3(out: Path, config: dict, tokenizer, seed: int) -> None:
    """A Qwen3ForCausalLM directory written with numpy, not transformers' modeling code (whose import is about
    3.5 s of the start-up's critical path). The weights are drawn as Qwen3's own initialisation draws them:
    normal(0, initializer_range) for every matrix, the padding token's embedding row zero, norms one;
    from `seed`, in name order, so every process that writes it writes the same."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in sorted(qwen3_shapes(config).items()):
        if name.endswith("norm.weight"):
            tensors[name] = np.ones(shape, dtype=np.float32)
        else:
            tensors[name] = (rng.standard_normal(shape, dtype=np.float32) * config["initializer_range"])
    tensors["model.embed_tokens.weight"][config["pad_token_id"]] = 0.0
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {key: config[key] for key in ("eos_token_id", "pad_token_id", "transformers_version")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(out)
