"""Prompts as the engines and the trainer need them: text in-process, media in a pool of processes.

A data row becomes a `Prompt`: the token ids a request carries, the token ids
the trainer sees, and for a row with images, video or audio the processor's
tensors and the media themselves as SGLang request fields.

    row --(text)------> chat template + tokenizer -----------------------> Prompt(request_ids == prompt_ids)
    row --(media)-----> [worker process: decode media (data/media.py),
                         chat template with placeholders, processor]   --> Prompt(request_ids: placeholders once,
                                                                              prompt_ids: expanded, multimodal,
                                                                              media: image_data/video_data/...)

Why two id lists: SGLang (and the CPU engine, which answers as SGLang does)
takes the prompt with ONE placeholder per image/video/audio and runs the
model's processor itself, which expands each placeholder into as many pad
tokens as the item has patches or frames; the trainer's forward needs the
expanded ids, which the same processor here yields, with the same tensors.

Media decoding and the processor are CPU work of tens of milliseconds per
image and more per video; they run in `rollout.media_workers` worker
processes (spawned, each loads the processor once), so the rollout event loop
keeps sending and receiving requests meanwhile. A row whose media cannot be
decoded, or whose expanded prompt is longer than `rollout.max_prompt_len`,
is skipped with a warning naming the row and counted (`Skipped`), never an
error of the run.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    """One row's prompt, ready for a request and for training."""

    row_index: int
    request_ids: list[int]
    prompt_ids: list[int]
    multimodal: dict[str, Any] | None = None
    media: dict[str, list[str]] = field(default_factory=dict)  # SGLang's image_data / video_data / audio_data


@dataclass
class Skipped:
    """A row that gives no prompt, and why (logged and counted, the run goes on)."""

    row_index: int
    reason: str


# ---------------------------------------------------------------- worker side
_worker: dict[str, Any] = {}


def _init_worker(model_dir: str, bounds: Any, system_prompt: str | None, trust_remote_code: bool) -> None:
    import torch

    from relax_core.models.multimodal import load_processor

    torch.set_num_threads(1)
    _worker.update(processor=load_processor(model_dir, trust_remote_code=trust_remote_code), bounds=bounds,
                   system_prompt=system_prompt)


def _prepare(row_index: int, row: dict[str, Any], max_prompt_len: int) -> Prompt | Skipped:
    """In a worker: decode the row's media, build its prompt and run the processor."""
    from relax_core.data.media import encode_request_media, row_media
    from relax_core.errors import UserError
    from relax_core.models.multimodal import chat_prompt, process

    processor, bounds = _worker["processor"], _worker["bounds"]
    try:
        media = row_media(row["media"], bounds, row_index=row.get("index", row_index))
    except UserError as exc:
        return Skipped(row_index, str(exc))
    text, request_ids = chat_prompt(processor, row["prompt"], _worker["system_prompt"], n_images=len(media.images),
                                    n_videos=len(media.videos), n_audios=len(media.audios))
    processed = process(processor, text, media.images, media.videos, media.audios, media.audio_sample_rate)
    if len(processed.input_ids) > max_prompt_len:
        return Skipped(row_index, f"its prompt is {len(processed.input_ids)} tokens with its media expanded "
                                  f"(rollout.max_prompt_len={max_prompt_len})")
    return Prompt(row_index, list(request_ids), list(processed.input_ids), dict(processed.tensors),
                  encode_request_media(media))


# ---------------------------------------------------------------- caller side
class MediaPrompts:
    """Rows with media -> `Prompt`s, in `workers` spawned processes (started on first use).

    Args:
        model_dir: the policy's directory (its processor is loaded from it).
        bounds: the data set's media bounds (`data/media.py: MediaBounds`).
        system_prompt: put before every prompt.
        max_prompt_len: longest expanded prompt; longer rows are skipped.
        workers: processes that decode media and run the processor.
    """

    def __init__(self, model_dir: str, bounds: Any, system_prompt: str | None, max_prompt_len: int,
                 workers: int = 1, trust_remote_code: bool = False) -> None:
        self._init_args = (str(model_dir), bounds, system_prompt, trust_remote_code)
        self.max_prompt_len, self.workers = max_prompt_len, workers
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker, initargs=self._init_args)
        return self._pool

    async def prepare(self, rows: list[tuple[int, dict[str, Any]]]) -> list[Prompt | Skipped]:
        """`(row index, row)` pairs -> a `Prompt` or a `Skipped` for each, in order."""
        loop, pool = asyncio.get_running_loop(), self._executor()
        return list(await asyncio.gather(*(loop.run_in_executor(pool, _prepare, i, row, self.max_prompt_len)
                                           for i, row in rows)))

    def worker_pids(self) -> list[int]:
        return sorted(self._pool._processes) if self._pool is not None else []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
