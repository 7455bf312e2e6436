"""Multimodal requests of the CPU engine: SGLang's media fields -> processed prompts.

SGLang 0.5.23 handles a `/generate` with `image_data` / `video_data` /
`audio_data` like this (`srt/managers/tokenizer_manager.py`,
`srt/multimodal/processors/base_processor.py::load_mm_data`, `qwen_vl.py`):
the prompt comes unexpanded, one placeholder per item (Qwen3-VL / Omni:
`<|vision_start|><|image_pad|><|vision_end|>` per image, `<|video_pad|>` per
video, `<|audio_pad|>` per audio); `input_ids` are decoded back to text; the
number of placeholders of each modality must equal the number of items
("Prompt has N image placeholders but M image inputs were provided"); each
item string is loaded (`load_image` / `load_video` / `load_audio`: data URI,
base64, path, file:// URL); and the model's Hugging Face processor expands
every placeholder into as many tokens as the item has features. The expanded
ids are the prompt from then on (`meta_info.prompt_tokens` counts them).

`MediaPreprocessor.prepare` does the same with Relax's decoders
(`relax_core.data.media`) and processor (`relax_core.models.multimodal`). The
HTTP layer runs it on the preprocessor's own worker thread, so decoding and
processing never stall the event loop, and hands the result to the scheduler
as a `MediaPrompt` on the `Sequence`.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

from relax_core.rollout.cpu_engine.protocol import MEDIA_FIELDS


@dataclass(frozen=True)
class MediaPrompt:
    """What the prefill of a multimodal prompt needs besides its (expanded) ids."""

    tensors: dict[str, Any]  # the processor's outputs (pixel_values, image_grid_thw, input_features, ...)
    key: tuple  # ids and media strings: equal keys are one prefill (`Batcher._prefill_media`)


class MediaPreprocessor:
    """The model's processor and the media each modality of it accepts."""

    def __init__(self, model_dir: str, video: dict | None = None) -> None:
        from relax_core.data import media
        from relax_core.models import multimodal

        self._process = multimodal.process
        self.processor = multimodal.load_processor(model_dir)
        self.tokenizer = self.processor.tokenizer
        # The placeholder of each modality the model takes.
        self.placeholders = {"image": multimodal.IMAGE, "video": multimodal.VIDEO}
        if self.processor.feature_extractor is not None:
            self.placeholders["audio"] = multimodal.AUDIO
        self.sample_rate = getattr(self.processor.feature_extractor, "sampling_rate", None) or media.DEFAULT_SAMPLE_RATE
        # SGLang's loaders' defaults: images as sent, video sampled at 2 fps (Qwen-VL's) unless `video` says
        # otherwise (the run's data.video_* settings, so the frames are the trainer's), audio at the feature
        # extractor's rate.
        self.bounds = media.MediaBounds(audio_sample_rate=self.sample_rate, **(video or {}))
        # One worker: the processor's tokenizer is not safe to share between threads.
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cpu-engine-media")

    def prepare(self, prompt: str | list[int], media: dict[str, list[str]],
                where: str = "") -> tuple[list[int], MediaPrompt]:
        """The expanded ids and prefill inputs of one item; raises ValueError on a bad request.

        Args:
            prompt: the unexpanded prompt, as text or ids.
            media: the item's media strings by modality (`GenerateReqInput.media_per_item`).
            where: names the item of a batch in error messages.
        """
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        self._check_placeholders(text, media, where)
        loaded = {m: [self._load(m, value, f"{MEDIA_FIELDS[m]}[{i}]{where}") for i, value in enumerate(items)]
                  for m, items in media.items()}
        try:
            out = self._process(self.processor, text, loaded["image"], loaded["video"], loaded["audio"],
                                self.sample_rate)
        except Exception as exc:  # noqa: BLE001 - the processor's refusal is the request's fault
            raise ValueError(f"The model's processor refused the request{where}: {exc}") from exc
        key = (tuple(out.input_ids), *(tuple(media[m]) for m in MEDIA_FIELDS))
        return list(out.input_ids), MediaPrompt(out.tensors, key)

    def _check_placeholders(self, text: str, media: dict[str, list[str]], where: str) -> None:
        for modality, items in media.items():
            token = self.placeholders.get(modality)
            if token is None:
                if items:
                    raise ValueError(f"This model takes no {MEDIA_FIELDS[modality]}{where}.")
                continue
            found = text.count(token)
            if found != len(items):
                raise ValueError(
                    f"Prompt has {found} {modality} placeholders but {len(items)} {modality} inputs were "
                    f"provided{where}; send the prompt unexpanded, with one {token} per item."
                )

    def _load(self, modality: str, value: str, name: str) -> Any:
        from relax_core.data import media

        decode = {"image": media.decode_image, "video": media.decode_video, "audio": media.decode_audio}[modality]
        try:
            return decode(value, self.bounds, name)
        except media.MediaError as exc:
            raise ValueError(str(exc)) from exc
