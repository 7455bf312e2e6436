"""Samples spread over trainer ranks by their tokens: the driver's split of a step (TransferQueue's claimed
rows in the asynchronous modes, the step's samples in the others)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def balanced_shards(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """The indexes each of `parts` ranks trains: as many as `batching.shard` gives each (counts differ by
    at most 1), the tokens (`lengths`) spread evenly: longest first, each to the rank with the fewest
    tokens that still has room (`_greedy`), then samples swapped between the heaviest and the lightest
    rank while that lowers the heaviest (`_swap`). Each rank's indexes in their original order.

    Contiguous slices give one rank every long response of a sorted or skewed batch, and every rank
    waits for it (verl balances sequence lengths, slime fills by token budget, for the same reason)."""
    base, extra = divmod(len(lengths), parts)
    sizes = [base + (r < extra) for r in range(parts)]  # as `batching.shard` cuts them
    shards = _greedy(lengths, sizes)
    _swap(lengths, shards)
    return [sorted(s) for s in shards]


def _greedy(lengths: Sequence[int], sizes: list[int]) -> list[list[int]]:
    shards: list[list[int]] = [[] for _ in sizes]
    tokens = [0] * len(sizes)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        # among equally loaded ranks the one with fewer places: the longest samples then share a rank
        # with fewer others
        r = min((r for r in range(len(sizes)) if len(shards[r]) < sizes[r]), key=lambda r: (tokens[r], sizes[r], r))
        shards[r].append(i)
        tokens[r] += lengths[i]
    return shards


def _swap(lengths: Sequence[int], shards: list[list[int]], rounds: int = 64) -> None:
    """Swap one sample of the heaviest rank for a shorter one of the lightest, the difference closest to
    half their gap, while any swap narrows it."""
    for _ in range(rounds):
        tokens = [sum(lengths[i] for i in s) for s in shards]
        heavy, light = tokens.index(max(tokens)), tokens.index(min(tokens))
        gap = tokens[heavy] - tokens[light]
        if gap == 0:
            return
        lighter = sorted(shards[light], key=lambda j: lengths[j])
        keys = [lengths[j] for j in lighter]
        best = None  # (distance from half the gap, i, j)
        for i in shards[heavy]:
            want = lengths[i] - gap / 2  # the length of j that evens the two ranks
            k = bisect.bisect_left(keys, want)
            for j in lighter[max(0, k - 1):k + 1]:
                moved = lengths[i] - lengths[j]
                if 0 < moved < gap and (best is None or abs(moved - gap / 2) < best[0]):
                    best = (abs(moved - gap / 2), i, j)
        if best is None:
            return
        _, i, j = best
        shards[heavy][shards[heavy].index(i)] = j
        shards[light][shards[light].index(j)] = i
