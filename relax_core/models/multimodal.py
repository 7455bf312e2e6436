"""Loading and feeding the policy model of any family: text, Qwen3-VL, Qwen3-Omni (thinker).

One module every side uses, so the rollout manager, the CPU engine and the
trainer agree token for token on what a multimodal sample is:

- `chat_prompt` renders the chat template with one unexpanded placeholder per
  image/video/audio (what an SGLang request carries: SGLang runs the HF
  processor on the media itself and expands the placeholders);
- `process` expands those placeholders (one pad token per encoder output) and
  returns the sample's media tensors, on the CPU;
- `model_inputs` turns a padded batch of processed samples into `model(**kwargs)`
  with explicit M-RoPE position ids from the model's own `get_rope_index`, so
  padding can never shift positions, and `rope_positions` gives an engine the
  per-row `rope_deltas` that continue positions while decoding.

The processor is Relax's `MediaProcessor`, built from the checkpoint's own
files (tokenizer, `preprocessor_config.json`, `video_preprocessor_config.json`,
chat template) rather than `AutoProcessor`: in transformers 5 every processor
with a video processor needs torchvision, which a CPU install does not have.
Images go through the checkpoint's PIL image processor; video frames are
resized, normalised and patchified here exactly as the Qwen video processors
do (PIL bicubic resize instead of torchvision's, so pixels differ from
SGLang's by resampling noise only); audio goes through the Whisper feature
extractor.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Family = Literal["text", "qwen3_vl", "qwen3_omni"]
_FAMILIES: dict[str, Family] = {
    "qwen3_vl": "qwen3_vl",
    "qwen3_omni_moe": "qwen3_omni",  # full Qwen3-Omni checkpoint: the thinker's weights under `thinker.`
    "qwen3_omni_moe_thinker": "qwen3_omni",
}
IMAGE, VIDEO, AUDIO = "<|image_pad|>", "<|video_pad|>", "<|audio_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
AUDIO_START, AUDIO_END = "<|audio_start|>", "<|audio_end|>"
MEDIA_MARKERS = (IMAGE, VIDEO, AUDIO, VISION_START, VISION_END, AUDIO_START, AUDIO_END)
# `mm_token_type_ids` values of Qwen3-VL's get_rope_index.
_TOKEN_TYPES = {IMAGE: 1, VIDEO: 2, AUDIO: 3}
# Media tensors concatenated along dim 0 across a batch; audio features are first padded to a common length.
_CONCAT = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "video_second_per_grid")
_AUDIO = ("input_features", "feature_attention_mask")


def family(model_dir: str | Path) -> Family:
    """The model family of a checkpoint, from `config.json`'s `model_type` (imports no torch)."""
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", "")
    return _FAMILIES.get(model_type, "text")


def load_policy(model_dir: str | Path, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False,
                *, weights: bool = True):
    """The policy as a module whose forward gives logits [B, L, V] (eval mode).

    For Qwen3-Omni only the thinker is loaded, also from a full checkpoint
    (Qwen3-Omni-30B-A3B): its weights are read from under `thinker.` through
    `key_mapping`, and the talker's are never materialised. `weights=False`:
    the same module without reading the checkpoint, its parameters on the meta
    device (no memory; `empty_parameters`), its buffers (rotary frequencies,
    which no checkpoint holds) built as usual: what a sharded trainer's ranks
    other than 0 build before rank 0's weights reach their shards.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, torch_dtype = family(model_dir), getattr(torch, dtype)
    if kind == "text":
        cls, kwargs = AutoModelForCausalLM, {"trust_remote_code": trust_remote_code}
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    elif kind == "qwen3_vl":
        from transformers import Qwen3VLForConditionalGeneration

        cls, kwargs, config = Qwen3VLForConditionalGeneration, {}, AutoConfig.from_pretrained(model_dir)
    else:
        from transformers import Qwen3OmniMoeThinkerForConditionalGeneration as Thinker

        cls, kwargs, config = Thinker, {}, AutoConfig.from_pretrained(model_dir)
        if config.model_type == "qwen3_omni_moe":
            config, kwargs = config.thinker_config, {"key_mapping": {r"^thinker\.": ""}}
    if not weights:
        with empty_parameters():
            built = (cls.from_config(config, dtype=torch_dtype, **kwargs) if cls is AutoModelForCausalLM
                     else cls._from_config(config, dtype=torch_dtype))
        return built.eval()
    return cls.from_pretrained(model_dir, config=config, dtype=torch_dtype, **kwargs).to(device).eval()


class empty_parameters:
    """Modules built inside get their parameters on the meta device and their buffers as usual (what
    accelerate's `init_empty_weights(include_buffers=False)` does)."""

    def __enter__(self):
        import torch

        self.register = register = torch.nn.Module.register_parameter

        def on_meta(module, name, param):
            register(module, name, param)
            if param is not None:
                kept = module._parameters[name]
                module._parameters[name] = type(kept)(kept.to("meta"), requires_grad=kept.requires_grad)

        torch.nn.Module.register_parameter = on_meta

    def __exit__(self, *exc):
        import torch

        torch.nn.Module.register_parameter = self.register


def pad_token_id(model) -> int:
    """The padding token of the policy's language model (0 without one); the Omni thinker's config has it
    only in its text config."""
    return getattr(model.config.get_text_config(), "pad_token_id", None) or 0


def media_marker_ids(tokenizer) -> list[int]:
    """Ids of the tokens that mark media in a prompt (placeholders, start/end), those the tokenizer has."""
    vocab = tokenizer.get_vocab()
    return sorted(vocab[t] for t in MEDIA_MARKERS if t in vocab)


@dataclass
class MediaProcessor:
    """A checkpoint's tokenizer, chat template and media processors (see the module docstring)."""

    family: Family
    tokenizer: Any
    chat_template: str
    image_processor: Any = None
    video: dict = field(default_factory=dict)  # video_preprocessor_config.json
    feature_extractor: Any = None

    @property
    def merge_size(self) -> int:
        return self.image_processor.merge_size


def load_processor(model_dir: str | Path, trust_remote_code: bool = False) -> MediaProcessor:
    """The `MediaProcessor` of a checkpoint (for a text model: its tokenizer and chat template only)."""
    from transformers import AutoTokenizer

    path, kind = Path(model_dir), family(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    processor = MediaProcessor(kind, tokenizer, _chat_template(path) or tokenizer.chat_template)
    if kind == "text":
        return processor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor.image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    processor.video = json.loads((path / "video_preprocessor_config.json").read_text())
    if kind == "qwen3_omni":
        from transformers import WhisperFeatureExtractor

        processor.feature_extractor = WhisperFeatureExtractor.from_pretrained(path)
    return processor


def _chat_template(path: Path) -> str | None:
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").exists():
        return json.loads((path / "chat_template.json").read_text())["chat_template"]
    return None


def chat_prompt(processor: MediaProcessor, prompt: str | list[dict], system_prompt: str | None = None,
                n_images: int = 0, n_videos: int = 0, n_audios: int = 0) -> tuple[str, list[int]]:
    """The chat-template text with unexpanded media placeholders and the assistant turn opened, and its ids.

    A string prompt becomes one user turn: its images, then videos, then audio,
    then the text. A message list is rendered as given (its content lists name
    the media themselves).
    """
    if isinstance(prompt, str):
        content = ([{"type": "image"}] * n_images + [{"type": "video"}] * n_videos
                   + [{"type": "audio"}] * n_audios + [{"type": "text", "text": prompt}])
        messages = [{"role": "user", "content": content if processor.family != "text" else prompt}]
    else:
        messages = list(prompt)
    if system_prompt is not None:
        messages = [{"role": "system", "content": system_prompt}, *messages]
    text = processor.tokenizer.apply_chat_template(messages, chat_template=processor.chat_template,
                                                   add_generation_prompt=True, tokenize=False)
    return text, processor.tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class Processed:
    """One sample, expanded: token ids with one pad per encoder output, and its media tensors (CPU)."""

    input_ids: list[int]
    tensors: dict[str, Any]


def process(processor: MediaProcessor, text: str, images=(), videos=(), audios=(),
            audio_sample_rate: int = 16000) -> Processed:
    """Expand `text`'s placeholders for its media (in order) and compute the media tensors.

    Args:
        images: PIL images (or HxWx3 uint8 arrays).
        videos: frames uint8 [T, H, W, 3], or objects with `frames`, `fps` and
            `timestamps` (seconds per frame), as relax_core.data decodes them.
        audios: mono float32 arrays at `audio_sample_rate`.
    """
    tensors, replacements = {}, {IMAGE: [], VIDEO: [], AUDIO: []}
    if images:
        out = processor.image_processor(list(images), return_tensors="pt")
        tensors.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
        replacements[IMAGE] = [IMAGE * int(g.prod() // processor.merge_size**2) for g in out["image_grid_thw"]]
    if videos:
        tensors.update(_videos(processor, videos, replacements[VIDEO]))
    if audios:
        tensors.update(_audios(processor, audios, audio_sample_rate, replacements[AUDIO]))
    expanded = _expand(text, replacements)
    return Processed(processor.tokenizer(expanded, add_special_tokens=False)["input_ids"], tensors)


def _expand(text: str, replacements: dict[str, list[str]]) -> str:
    pending = {token: iter(values) for token, values in replacements.items()}
    counts = {token: text.count(token) for token in replacements}
    for token, values in replacements.items():
        if counts[token] != len(values):
            raise ValueError(f"the prompt has {counts[token]} {token} placeholders for {len(values)} media items")
    pattern = "|".join(re.escape(token) for token in replacements)
    return re.sub(pattern, lambda m: next(pending[m.group()]), text)


def _videos(processor: MediaProcessor, videos, replacements: list[str]) -> dict:
    import torch

    merge, temporal = processor.video["merge_size"], processor.video["temporal_patch_size"]
    pixels, grids, seconds = [], [], []
    for video in videos:
        frames = getattr(video, "frames", video)
        fps = float(getattr(video, "fps", None) or processor.video.get("fps", 2))
        stamps = getattr(video, "timestamps", None)
        stamps = [i / fps for i in range(len(frames))] if stamps is None else [float(t) for t in stamps]
        patches, grid = _video_patches(processor, frames)
        pixels.append(patches)
        grids.append(grid)
        seconds.append(temporal / fps)
        per_frame = VIDEO * (grid[1] * grid[2] // merge**2)
        if processor.family == "qwen3_vl":  # Qwen3VLProcessor: "<t seconds>" before each temporal patch
            stamps += [stamps[-1]] * (-len(stamps) % temporal)
            times = [(stamps[i] + stamps[i + temporal - 1]) / 2 for i in range(0, len(stamps), temporal)]
            replacements.append("".join(f"<{t:.1f} seconds>{VISION_START}{per_frame}{VISION_END}" for t in times))
        else:
            replacements.append(per_frame * grid[0])
    out = {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids)}
    if processor.family == "qwen3_omni":
        out["video_second_per_grid"] = torch.tensor(seconds)
    return out


def _video_patches(processor: MediaProcessor, frames):
    """Resize, normalise and patchify frames uint8 [T, H, W, 3] as the family's video processor does."""
    import numpy as np
    import torch
    from PIL import Image

    cfg = processor.video
    patch, merge, temporal = cfg["patch_size"], cfg["merge_size"], cfg["temporal_patch_size"]
    frames = np.asarray(frames)
    t, h, w = frames.shape[:3]
    size = cfg["size"]
    if processor.family == "qwen3_vl":  # pixel budget over all frames
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        rh, rw = smart_resize(t, h, w, temporal_factor=temporal, factor=patch * merge,
                              min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    else:  # Qwen2-VL's video processor: pixel budget per frame
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        rh, rw = smart_resize(h, w, factor=patch * merge, min_pixels=size["shortest_edge"],
                              max_pixels=size["longest_edge"])
    resized = np.stack([np.asarray(Image.fromarray(f).resize((rw, rh), Image.BICUBIC)) for f in frames])
    x = torch.from_numpy(resized).permute(0, 3, 1, 2).float() * cfg.get("rescale_factor", 1 / 255)
    mean, std = torch.tensor(cfg["image_mean"]), torch.tensor(cfg["image_std"])
    x = (x - mean[:, None, None]) / std[:, None, None]
    if pad := -t % temporal:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    gt, gh, gw = x.shape[0] // temporal, rh // patch, rw // patch
    x = x.view(gt, temporal, 3, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gt * gh * gw, 3 * temporal * patch * patch)
    return x, [gt, gh, gw]


def _audios(processor: MediaProcessor, audios, sample_rate: int, replacements: list[str]) -> dict:
    import numpy as np
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    extractor = processor.feature_extractor
    if sample_rate != extractor.sampling_rate:
        raise ValueError(f"audio must be sampled at {extractor.sampling_rate} Hz, got {sample_rate} Hz")
    out = extractor([np.asarray(a, dtype=np.float32) for a in audios], sampling_rate=sample_rate,
                    padding="longest", truncation=False, return_attention_mask=True, return_tensors="pt")
    mask = out["attention_mask"]
    replacements.extend(AUDIO * int(n) for n in _get_feat_extract_output_lengths(mask.sum(-1)))
    return {"input_features": out["input_features"], "feature_attention_mask": mask}


def batch_media(per_sample: list[dict]) -> dict:
    import torch
    import torch.nn.functional as F

    out = {k: torch.cat([s[k] for s in per_sample if k in s]) for k in _CONCAT if any(k in s for s in per_sample)}
    with_audio = [s for s in per_sample if "input_features" in s]
    if with_audio:
        frames = max(s["input_features"].shape[-1] for s in with_audio)
        for key in _AUDIO:
            out[key] = torch.cat([F.pad(s[key], (0, frames - s[key].shape[-1])) for s in with_audio])
    return out


def _is_vl(model) -> bool:
    """Qwen3-VL (else the Omni thinker), by config: FSDP2 renames a sharded model's class."""
    return getattr(model.config, "model_type", "") == "qwen3_vl"


def _token_types(model, input_ids):
    import torch

    config = model.config
    types = torch.zeros_like(input_ids)
    for name, value in (("image_token_id", 1), ("video_token_id", 2), ("audio_token_id", 3)):
        if (token := getattr(config, name, None)) is not None:
            types[input_ids == token] = value
    return types


def rope_positions(model, input_ids, attention_mask, media: dict):
    """M-RoPE positions [4, B, L] (text row, then t/h/w) and `rope_deltas` [B, 1] from the model's get_rope_index.

    Decoding token k after a prefill of n tokens of a row: position n + k + delta in all four rows.
    """
    import torch

    if _is_vl(model):
        mrope, deltas = model.model.get_rope_index(
            input_ids, _token_types(model, input_ids), image_grid_thw=media.get("image_grid_thw"),
            video_grid_thw=media.get("video_grid_thw"), attention_mask=attention_mask)
    else:
        lengths = media["feature_attention_mask"].sum(-1) if "feature_attention_mask" in media else None
        mrope, deltas = model.get_rope_index(
            input_ids, media.get("image_grid_thw"), media.get("video_grid_thw"), attention_mask,
            use_audio_in_video=False, audio_seqlens=lengths, second_per_grids=media.get("video_second_per_grid"))
    text = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return torch.cat([text[None].to(mrope), mrope]), deltas


def model_inputs(model, input_ids, attention_mask, per_sample_tensors: list[dict]) -> dict:
    """`model(**kwargs)` for a padded batch (left or right padding) whose rows carry `per_sample_tensors`."""
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if not hasattr(model, "get_rope_index") and not hasattr(getattr(model, "model", None), "get_rope_index"):
        return kwargs  # a text model
    media = batch_media(per_sample_tensors)
    kwargs["position_ids"], _ = rope_positions(model, input_ids, attention_mask, media)
    if _is_vl(model):
        kwargs["mm_token_type_ids"] = _token_types(model, input_ids)
    return {**kwargs, **{k: v for k, v in media.items() if k != "video_second_per_grid"}}


@contextlib.contextmanager
def encoders_always_run(model, media: dict, first_layer):
    """Within the block, the model's forward also runs each encoder `media` leaves unused (`unused_encoders`),
    adding 0 x its output to what `first_layer` (the language model's first decoder layer) returns.

    Sharded over ranks, an encoder's parameters are reduced after every backward by all ranks together,
    so every rank must give them a gradient (zeros) even when its micro-batch has no image or audio; and it
    must run them inside the model's forward, where FSDP holds the root unit's parameters gathered (run
    after it, they would be gathered again, by this rank alone).
    """

    def add_zero(module, args, output):
        zero = unused_encoders(model, media)
        if zero is None:
            return output
        return (output[0] + zero, *output[1:]) if isinstance(output, tuple) else output + zero

    handle = first_layer.register_forward_hook(add_zero)
    try:
        yield
    finally:
        handle.remove()


def unused_encoders(model, media: dict):
    """0 x the outputs of each encoder that `media` (a batch's `batch_media`) leaves unused, run on a
    minimal input (one merged image patch; a second of silence), or None when every encoder is used."""
    import torch

    inner, terms = model.model, []
    if "vision" in towers(model) and "pixel_values" not in media and "pixel_values_videos" not in media:
        visual = inner.visual
        merge, cfg = visual.spatial_merge_size, visual.config
        width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        param = next(visual.parameters())
        out = inner.get_image_features(torch.zeros(merge * merge, width, dtype=param.dtype, device=param.device),
                                       torch.tensor([[1, merge, merge]], device=param.device))
        terms += [out.pooler_output[0].sum(), *(feature[0].sum() for feature in out.deepstack_features)]
    if "audio" in towers(model) and "input_features" not in media:
        param = next(inner.audio_tower.parameters())
        frames = 2 * inner.audio_tower.config.n_window
        silence = torch.zeros(1, inner.audio_tower.config.num_mel_bins, frames, dtype=param.dtype, device=param.device)
        out = inner.get_audio_features(silence, torch.ones(1, frames, dtype=torch.long, device=param.device))
        terms.append(out.last_hidden_state.sum())
    return sum(terms) * 0.0 if terms else None


def towers(model) -> dict[str, str]:
    """Qualified names of the vision and audio encoders inside the policy ({} for a text model)."""
    inner = getattr(model, "model", None)
    found = {}
    for kind, attr in (("vision", "visual"), ("audio", "audio_tower")):
        if inner is not None and hasattr(inner, attr):
            found[kind] = f"model.{attr}"
    return found


def freeze(model, vision: bool, audio: bool) -> list[str]:
    """Stop gradients into the vision and/or audio encoder; returns the frozen parameter names."""
    frozen = []
    for kind, prefix in towers(model).items():
        if (kind == "vision" and vision) or (kind == "audio" and audio):
            for name, param in model.get_submodule(prefix).named_parameters():
                param.requires_grad_(False)
                frozen.append(f"{prefix}.{name}")
    return frozen
