"""DAPO's rollout-side pieces: dynamic-sampling group filter and overlong reward shaping.

Both run where rewards are known, before the batch reaches the trainer (the
controller's rollout loop), so they are plain Python over floats and ints and
import no torch. Formulas: docs/algorithms.md, the DAPO paragraph.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def dynamic_sampling_keep(rewards: Sequence[float], group_ids: Sequence[Hashable]) -> list[bool]:
    """Per sample: True if its group's rewards are not all equal (the group carries a learning signal).

    A group of size 1 counts as all-equal and is dropped, as in DAPO (its
    group std is 0). The caller generates more groups until the batch is full,
    at most `max_num_gen_batches` times.
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    seen: dict[Hashable, set[float]] = {}
    for reward, gid in zip(rewards, group_ids):
        seen.setdefault(gid, set()).add(float(reward))
    return [len(seen[gid]) > 1 for gid in group_ids]


def overlong_penalty(lengths: Sequence[int], max_len: int, cache_len: int) -> list[float]:
    """Soft overlong penalty for each response length (added to its reward); see `penalty_for_length`."""
    return [penalty_for_length(n, max_len, cache_len) for n in lengths]


def penalty_for_length(length: int, max_len: int, cache_len: int) -> float:
    """Soft overlong penalty for a response of `length` tokens.

    0 up to `max_len - cache_len`; `(max_len - cache_len - length) / cache_len`
    inside the window (reaching -1 at `max_len`); -1 past `max_len`.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"cache_len must be in (0, max_len]; got {cache_len} with max_len {max_len}")
    start = max_len - cache_len
    if length <= start:
        return 0.0
    if length > max_len:
        return -1.0
    return (start - length) / cache_len

