"""`/generate` translation: SGLang request -> scheduler `Sequence`s -> SGLang response.

Sits between the HTTP handler (`server.py`) and the scheduler
(`batcher.py`). The response of one item has SGLang's shape:

    {"text": ..., "output_ids": [...],
     "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort", ...},
                   "prompt_tokens", "completion_tokens", "cached_tokens",
                   "e2e_latency", "weight_version",
                   "weight_versions": [{"version", "start", "end"}, ...],
                   "output_token_logprobs": [[logprob, token_id, None], ...]}}

`weight_versions` says which weight version made which output tokens (spans,
end exclusive; weight_versions.py), `weight_version` is the last span's: as
SGLang 0.5.23, every finished item has both.

`output_token_logprobs` is present only with `return_logprob`. For a
multimodal item `prompt_tokens` counts the expanded prompt, as in SGLang. As in SGLang,
`output_ids` keep the matched stop/EOS token while `text` is cut before a
matched stop string (or drops a matched stop token) unless `no_stop_trim`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from relax_core.rollout.cpu_engine.batcher import Batcher, Sequence
from relax_core.rollout.cpu_engine.media_inputs import MediaPrompt
from relax_core.rollout.cpu_engine.protocol import GenerateReqInput, SamplingParams
from relax_core.rollout.cpu_engine.sampling import RowSampling
from relax_core.rollout.cpu_engine.weight_versions import add_weight_versions_to_meta_info


@dataclass
class ModelLimits:
    """What a request is checked against."""

    context_length: int
    vocab_size: int
    eos_ids: frozenset[int]


def build_sequences(
    req: GenerateReqInput,
    tokenizer,
    batcher: Batcher,
    limits: ModelLimits,
    media: list[tuple[list[int], MediaPrompt] | None] | None = None,
) -> tuple[list[Sequence], list[SamplingParams], list[bool]]:
    """One `Sequence` per item of the request (the caller sets `on_done`);
    raises ValueError on bad input.

    `media` holds, for each item with media, its expanded ids and prefill inputs
    (`MediaPreprocessor.prepare`); those ids replace the item's prompt.
    """
    prompts = _prompts(req, tokenizer)
    n = len(prompts)
    media = media or [None] * n
    prompts = [p if m is None else m[0] for p, m in zip(prompts, media)]
    params = [SamplingParams.model_validate(p) for p in req.per_item(n, "sampling_params", {})]
    logprob_flags = [bool(x) for x in req.per_item(n, "return_logprob", False)]
    rids = _rids(req, n, batcher)
    seqs = [_sequence(rid, ids, p, batcher, limits) for rid, ids, p in zip(rids, prompts, params)]
    for seq, m in zip(seqs, media):
        seq.media = None if m is None else m[1]
    return seqs, params, logprob_flags


def unexpanded_prompts(req: GenerateReqInput) -> list[str | list[int]]:
    """Each item's prompt as sent: text or ids."""
    if req.input_ids is not None:
        return list(req.input_ids) if req.is_batch else [req.input_ids]
    return list(req.text) if req.is_batch else [req.text]


def _prompts(req: GenerateReqInput, tokenizer) -> list[list[int]]:
    prompts = unexpanded_prompts(req)
    if req.input_ids is None:
        prompts = [tokenizer.encode(t, add_special_tokens=True) for t in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("Every prompt must have at least one token.")
    return [list(p) for p in prompts]


def _rids(req: GenerateReqInput, n: int, batcher: Batcher) -> list[str]:
    if req.rid is None:
        return [batcher.new_rid() for _ in range(n)]
    if isinstance(req.rid, list):
        if len(req.rid) != n:
            raise ValueError(f"rid has {len(req.rid)} entries for a batch of {n}.")
        return list(req.rid)
    return [req.rid] if not req.is_batch else [f"{req.rid}-{i}" for i in range(n)]


def _sequence(rid, prompt, params: SamplingParams, batcher: Batcher, limits: ModelLimits) -> Sequence:
    if len(prompt) >= limits.context_length:
        raise ValueError(
            f"The input ({len(prompt)} tokens) is longer than the model's context length "
            f"({limits.context_length} tokens)."
        )
    if any(not 0 <= t < limits.vocab_size for t in prompt):
        raise ValueError(f"input_ids must be in [0, {limits.vocab_size}).")
    stop_ids = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        stop_ids |= limits.eos_ids
    return Sequence(
        rid=rid,
        prompt_ids=prompt,
        max_new_tokens=min(params.max_new_tokens, limits.context_length - len(prompt)),
        sampling=_row_sampling(params, batcher),
        stop_ids=frozenset(stop_ids),
        stop_strings=params.stop_strings,
        skip_special_tokens=params.skip_special_tokens,
    )


def _row_sampling(params: SamplingParams, batcher: Batcher) -> RowSampling:
    greedy = params.greedy
    return RowSampling(
        temperature=1.0 if greedy else params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        greedy=greedy,
        generator=None if greedy else batcher.new_generator(params.sampling_seed),
    )


def build_response(seq: Sequence, params: SamplingParams, return_logprob: bool, tokenizer) -> dict[str, Any]:
    """SGLang's response dict for one finished sequence."""
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": seq.cached_tokens,
        "e2e_latency": time.perf_counter() - seq.created,
    }
    # the spans the scheduler computed when it finished (SGLang's output streamer), not the version now
    add_weight_versions_to_meta_info(meta, seq.weight_versions, len(seq.output_ids))
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.logprobs, seq.output_ids)]
    return {"text": _text(seq, params, tokenizer), "output_ids": list(seq.output_ids), "meta_info": meta}


def _text(seq: Sequence, params: SamplingParams, tokenizer) -> str:
    ids = seq.output_ids
    matched = (seq.finish_reason or {}).get("matched")
    trim = not params.no_stop_trim
    if trim and isinstance(matched, int) and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
    if trim and isinstance(matched, str) and matched in text:
        text = text[: text.find(matched)]
    return text
