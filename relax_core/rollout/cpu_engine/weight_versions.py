"""Which weight version generated each output token: SGLang 0.5.23's bookkeeping, pinned.

When the weights change while requests run (a weight update between `/pause_generation` "retract"
and `/continue_generation`), every live request that has output records an event (the old version,
its output tokens so far); when it finishes, the events become spans over its output tokens
(end exclusive), and its response carries them:

    meta_info["weight_versions"] = [{"version": "3", "start": 0, "end": 17},
                                    {"version": "4", "start": 17, "end": 40}]
    meta_info["weight_version"] = "4"            (the last span's)

SGLang's own functions are in `sglang/srt/utils/weight_versions.py`, which cannot be imported on a
CPU machine (`sglang.srt.utils` imports triton), so the CPU engine mirrors them here, name for
name; tests/integration/test_cpu_engine.py compares the engine's responses with what SGLang's
functions make of the same events (run in a child process by tests/sglang_real.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WeightVersionEvent:
    """sglang/srt/utils/weight_versions.py `WeightVersionEvent`: the version that made a request's
    first `num_output_tokens` output tokens (those not claimed by an earlier event)."""

    old_version: str
    num_output_tokens: int


@dataclass
class WeightVersionSpan:
    """sglang/srt/utils/weight_versions.py `WeightVersionSpan`: output tokens [start, end) of `version`."""

    version: str
    start: int
    end: int


def record_weight_version_events(seqs: Iterable, old_version: str) -> int:
    """sglang/srt/utils/weight_versions.py `record_weight_version_events`, on the scheduler's live
    sequences (running and waiting, retracted ones included: scheduler.py `record_weight_version_change`)."""
    recorded = 0
    for seq in seqs:
        if seq.output_ids:
            seq.weight_version_events.append(WeightVersionEvent(old_version, len(seq.output_ids)))
            recorded += 1
    return recorded


def compute_weight_version_spans(events: list[WeightVersionEvent], current_version: str,
                                 num_output_tokens: int) -> list[WeightVersionSpan]:
    """sglang/srt/utils/weight_versions.py `compute_weight_version_spans`: events and the version at the
    end -> spans, neighbours of one version merged, empty ones dropped."""
    changes = [(event.old_version, event.num_output_tokens) for event in events]
    changes.append((current_version, num_output_tokens))
    spans: list[WeightVersionSpan] = []
    for version, end in changes:
        end = min(end, num_output_tokens)
        if spans and end <= spans[-1].end:
            continue
        if spans and version == spans[-1].version:
            spans[-1].end = end
            continue
        spans.append(WeightVersionSpan(version, spans[-1].end if spans else 0, end))
    return spans


def add_weight_versions_to_meta_info(meta_info: dict[str, Any], spans: list[WeightVersionSpan],
                                     num_output_tokens: int) -> None:
    """sglang/srt/utils/weight_versions.py `add_weight_versions_to_meta_info`: the spans as dicts, and
    `weight_version` the last one's."""
    visible = [span for span in spans if span.start < num_output_tokens or span.start == 0]
    meta_info["weight_versions"] = [
        {"version": span.version, "start": span.start, "end": min(span.end, num_output_tokens)} for span in visible
    ]
    meta_info["weight_version"] = visible[-1].version
