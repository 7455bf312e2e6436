"""The driver's split of a step over trainer ranks by tokens (relax_core/data/balance.py)."""

from __future__ import annotations

import random

import pytest

from relax_core.data.balance import balanced_shards


def totals(lengths, shards):
    return [sum(lengths[i] for i in shard) for shard in shards]


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_every_sample_once_with_counts_as_even_as_contiguous_slices(parts):
    lengths = [random.Random(parts).randrange(10, 9000) for _ in range(37)]
    shards = balanced_shards(lengths, parts)
    assert sorted(i for shard in shards for i in shard) == list(range(37))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert all(shard == sorted(shard) for shard in shards)


def test_a_sorted_batch_of_long_and_short_responses_is_split_evenly():
    # 8 samples, the 4 long ones first (a rollout's order when the long groups finish last, reversed):
    # contiguous halves give one rank 32k tokens and the other 2k
    lengths = [8000] * 4 + [500] * 4
    shards = balanced_shards(lengths, 2)
    assert totals(lengths, shards) == [17000, 17000]
    assert [len(s) for s in shards] == [4, 4]


def test_skewed_lengths_differ_by_at_most_the_longest_sample():
    rng = random.Random(7)
    for _ in range(50):
        lengths = [int(rng.paretovariate(1.2) * 300) for _ in range(rng.randrange(8, 64))]
        parts = rng.choice([2, 4, 8])
        sums = totals(lengths, balanced_shards(lengths, parts))
        contiguous = [sum(lengths[a:b]) for a, b in
                      zip(*(lambda c: (c[:-1], c[1:]))([r * len(lengths) // parts for r in range(parts + 1)]))]
        assert max(sums) - min(sums) <= max(lengths)
        assert max(sums) <= max(contiguous)


def test_fewer_samples_than_ranks_leaves_ranks_empty():
    assert balanced_shards([5, 9], 4) == [[1], [0], [], []]
