"""The CPU engine's scheduler: continuous batching on one background thread.

The HTTP handlers (`server.py`, on the asyncio loop) never touch the model.
They hand `Sequence`s to `Batcher.submit` and control actions (pause, abort,
weight update, ...) to `Batcher.call`; the scheduler thread runs them between
forward passes. Each iteration of its loop:

1. takes new sequences and control actions from the inbox;
2. admits waiting sequences (up to `max_running`): text prompts with one
   batched prefill, each distinct multimodal prompt with a prefill of its own
   (the full model: vision / audio towers, M-RoPE), and merges them all into
   the running `KVBatch` at once;
3. runs one decode step for every running sequence: a single forward pass,
   one sampled token per row, text and multimodal rows alike;
4. hands finished sequences back through their `on_done` callback.

So requests that arrive while others are decoding join the next step instead
of waiting for the whole batch to finish.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from relax_core.models.multimodal import media_marker_ids
from relax_core.rollout.cpu_engine.kv_batch import KVBatch, ModelRunner
from relax_core.rollout.cpu_engine.sampling import RowSampling, sample_next
from relax_core.rollout.cpu_engine.weight_versions import (
    WeightVersionEvent,
    WeightVersionSpan,
    compute_weight_version_spans,
    record_weight_version_events,
)


@dataclass
class Sequence:
    """One generation request as the scheduler sees it."""

    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: RowSampling
    stop_ids: frozenset[int]
    stop_strings: list[str]
    skip_special_tokens: bool
    on_done: Callable[[Sequence], None] | None = None  # called on the scheduler thread
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    created: float = field(default_factory=time.perf_counter)
    cached_tokens: int = 0  # prompt tokens whose keys and values came from another row's prefill
    # A multimodal prompt (`prompt_ids` expanded by the processor): what its prefill
    # needs (`media_inputs.MediaPrompt`), kept until it finishes (a retracted sequence prefills again).
    media: Any = None
    rope_delta: int = 0  # M-RoPE position of the next token minus its index (0 for text)
    # weight changes while it ran (kept across a retract, as SGLang's `req.weight_version_events`), and
    # at its finish the spans of output tokens each version made (weight_versions.py)
    weight_version_events: list[WeightVersionEvent] = field(default_factory=list)
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)

    @property
    def prefill_ids(self) -> list[int]:
        """What its prefill reads: the prompt, and the tokens it has generated when it was retracted."""
        return self.prompt_ids + self.output_ids

    @property
    def next_position(self) -> int:
        """Position id of the last token, which the next decode step feeds in."""
        return len(self.prompt_ids) + len(self.output_ids) - 1


@dataclass
class BatcherStats:
    """Counters exposed by `/get_model_info` (`engine_stats`)."""

    prefill_passes: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    finished_requests: int = 0
    max_running: int = 0


class Batcher:
    """Owns the model; runs prefill/decode steps on its own thread."""

    def __init__(self, model, tokenizer, *, max_running: int, seed: int, original_logprob: bool,
                 media_inputs: Callable | None = None, weight_version: str = "default") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.original_logprob = original_logprob
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.runner = ModelRunner(model, media_inputs)
        # a model that reads media never samples a media marker (sampling.py)
        self.banned = media_marker_ids(tokenizer) if media_inputs is not None else []
        self.stats = BatcherStats()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.batch = KVBatch()
        self.hold = False  # paused in place: keep sequences, run no steps
        self.weight_version = weight_version  # the scheduler's, as SGLang's; changed by `set_weight_version`
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._seeds = torch.Generator().manual_seed(seed)
        self._seed_lock = threading.Lock()
        self._rids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="cpu-engine-batcher", daemon=True)
        self._stopping = False

    # ---- API for the HTTP layer (any thread) ----

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout=30)

    def submit(self, sequences: list[Sequence]) -> None:
        self._inbox.put(sequences)

    def call(self, fn: Callable[[Batcher], Any]) -> concurrent.futures.Future:
        """Run `fn(self)` on the scheduler thread between two forward passes."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((fn, future))
        return future

    def new_generator(self, seed: int | None) -> torch.Generator:
        """A generator for one request: its own seed, else the next server seed."""
        if seed is None:
            with self._seed_lock:
                seed = int(torch.randint(0, 2**62, (), generator=self._seeds))
        return torch.Generator().manual_seed(seed)

    def new_rid(self) -> str:
        return f"cpu-{next(self._rids)}"

    def stats_dict(self) -> dict[str, int]:
        """Batching counters; forward_passes < requests x tokens means batching happened."""
        return {"forward_passes": self.runner.forward_passes, **asdict(self.stats)}

    # ---- control actions (run on the scheduler thread via `call`) ----

    def abort(self, rid: str | None = None) -> int:
        """Finish waiting and running sequences (all, or those of `rid`) as aborted."""
        match = (lambda s: True) if rid is None else (lambda s: s.rid == rid or s.rid.startswith(f"{rid}-"))
        aborted = [s for s in self.waiting if match(s)]
        self.waiting = deque(s for s in self.waiting if not match(s))
        keep = [i for i, s in enumerate(self.running) if not match(s)]
        aborted += [s for s in self.running if match(s)]
        self._keep_running(keep)
        for seq in aborted:
            self._finish(seq, {"type": "abort", "message": "Abort request."})
        return len(aborted)

    def retract(self) -> int:
        """Pause, taking the running sequences back to the head of the queue with their tokens so far and
        freeing their keys and values (SGLang's `pause_generation` mode "retract", scheduler.py): once
        generation continues they are prefilled again, prompt and tokens, with the weights then loaded."""
        retracted = [s for s in self.running if s.finish_reason is None]
        self.waiting.extendleft(reversed(retracted))
        self.running, self.batch, self.hold = [], KVBatch(), True
        return len(retracted)

    def set_weight_version(self, new_version: str | None) -> int:
        """The weights now loaded are `new_version`: each live sequence with output records that its tokens so
        far are the old version's (SGLang's scheduler.py `record_weight_version_change`; None or the same
        version changes nothing). Returns how many sequences recorded an event."""
        if new_version is None or new_version == self.weight_version:
            return 0
        old, self.weight_version = self.weight_version, new_version
        return record_weight_version_events([*self.running, *self.waiting], old_version=old)

    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    def flushable(self) -> bool:
        """The cache may be flushed: nothing runs, and nothing waits unless generation is paused (SGLang's
        scheduler `flush_cache`: `is_fully_idle(ignore_waiting=self._engine_paused)`)."""
        return not self.running and (self.hold or not self.waiting)

    # ---- the scheduler thread ----

    def _run(self) -> None:
        # Thread-local; every tensor the engine makes is made on this thread.
        with torch.inference_mode():
            self._loop()

    def _loop(self) -> None:
        while not self._stopping:
            self._drain(block=not self._has_work())
            if self._stopping or self.hold:
                continue
            try:
                self._admit()
                if self.running:
                    self._decode()
            except Exception as exc:  # noqa: BLE001 - fail the requests, keep serving
                traceback.print_exc()
                self._fail_all(f"engine error: {exc!r}")

    def _has_work(self) -> bool:
        return not self.hold and bool(self.waiting or self.running)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block)
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item) -> None:
        if item is _STOP:
            self._stopping = True
        elif isinstance(item, list):
            for seq in item:
                self._enqueue(seq)
        else:
            fn, future = item
            try:
                future.set_result(fn(self))
            except BaseException as exc:  # reported to the caller, never kills the thread
                future.set_exception(exc)

    def _enqueue(self, seq: Sequence) -> None:
        if seq.max_new_tokens == 0:
            self._finish(seq, {"type": "length", "length": 0})
        else:
            self.waiting.append(seq)

    def _admit(self) -> None:
        room = self.max_running - len(self.running)
        if room <= 0 or not self.waiting:
            return
        new = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        new = [s for s in new if s.media is None] + [s for s in new if s.media is not None]
        parts, logits = self._prefill_text([s for s in new if s.media is None])
        media_parts, media_logits = self._prefill_media([s for s in new if s.media is not None])
        batch = KVBatch.concat(parts + media_parts)
        alive = self._sample(new, torch.cat(logits + media_logits))
        if len(alive) < len(new):
            batch.keep(alive)
        self.batch.merge(batch)
        self.running += [new[i] for i in alive]
        self.stats.max_running = max(self.stats.max_running, len(self.running))

    def _prefill_text(self, seqs: list[Sequence]) -> tuple[list[KVBatch], list[torch.Tensor]]:
        if not seqs:
            return [], []
        batch, logits = KVBatch.prefill(self.runner, [s.prefill_ids for s in seqs], self.pad_id)
        self.stats.prefill_passes += 1
        seen: set[tuple[int, ...]] = set()
        for seq in seqs:  # KVBatch.prefill runs each distinct prompt once
            key = tuple(seq.prefill_ids)
            seq.cached_tokens = len(key) if key in seen else 0
            seen.add(key)
        return [batch], [logits]

    def _prefill_media(self, seqs: list[Sequence]) -> tuple[list[KVBatch], list[torch.Tensor]]:
        """One prefill per distinct multimodal prompt (same ids and media: a group's n
        samples share it, as in SGLang's prefix cache); one part per sequence."""
        done: dict[tuple, tuple[KVBatch, torch.Tensor, int]] = {}
        parts, logits = [], []
        for seq in seqs:
            key = (seq.media.key, tuple(seq.output_ids))
            if key in done:
                seq.cached_tokens = len(seq.prompt_ids)
            else:
                done[key] = KVBatch.prefill_media(self.runner, seq.prefill_ids, seq.media.tensors)
                self.stats.prefill_passes += 1
            batch, row_logits, seq.rope_delta = done[key]
            parts.append(batch)
            logits.append(row_logits)
        return parts, logits

    def _decode(self) -> None:
        tokens = [s.output_ids[-1] for s in self.running]
        positions = [s.next_position for s in self.running]
        deltas = [s.rope_delta for s in self.running]
        logits = self.batch.decode(self.runner, tokens, positions, deltas)
        self.stats.decode_steps += 1
        alive = self._sample(self.running, logits)
        if len(alive) < len(self.running):
            self._keep_running(alive)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Append one sampled token to each sequence; return the rows still running."""
        tokens, logprobs = sample_next(logits, [s.sampling for s in seqs], self.original_logprob, self.banned)
        # Counted before any sequence finishes: a finished request's answer may reach its client (and a
        # read of the counter after it) before this loop ends.
        self.stats.generated_tokens += len(seqs)
        alive = []
        for i, (seq, token, logprob) in enumerate(zip(seqs, tokens, logprobs)):
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            reason = self._finish_reason(seq)
            if reason is None:
                alive.append(i)
            else:
                self._finish(seq, reason)
        return alive

    def _finish_reason(self, seq: Sequence) -> dict[str, Any] | None:
        # Same precedence as SGLang's Req.check_finished: length, token, string.
        if len(seq.output_ids) >= seq.max_new_tokens:
            return {"type": "length", "length": seq.max_new_tokens}
        token = seq.output_ids[-1]
        if token in seq.stop_ids:
            return {"type": "stop", "matched": token}
        if seq.stop_strings:
            return self._match_stop_string(seq)
        return None

    def _match_stop_string(self, seq: Sequence) -> dict[str, Any] | None:
        # A new match must end in the last token; every token is >= 1 byte, so
        # the last len(bytes)+1 tokens hold any match that ends there.
        window = max(len(s.encode()) for s in seq.stop_strings) + 1
        tail = self.tokenizer.decode(seq.output_ids[-window:], skip_special_tokens=seq.skip_special_tokens)
        for stop in seq.stop_strings:
            if stop in tail:
                return {"type": "stop", "matched": stop}
        return None

    def _fail_all(self, message: str) -> None:
        failed = list(self.waiting) + self.running
        self.waiting, self.running, self.batch = deque(), [], KVBatch()
        for seq in failed:
            if seq.finish_reason is None:
                self._finish(seq, {"type": "abort", "message": message})

    def _keep_running(self, rows: list[int]) -> None:
        if len(rows) == len(self.running):
            return
        self.batch.keep(rows)
        self.running = [self.running[i] for i in rows]

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        seq.finish_reason = reason
        seq.weight_versions = compute_weight_version_spans(seq.weight_version_events, self.weight_version,
                                                           len(seq.output_ids))
        self.stats.finished_requests += 1
        seq.on_done(seq)


_STOP = object()
