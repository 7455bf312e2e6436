"""DAPO's rollout rounds (rollout/sampling_rounds.py) on hand-made rounds of samples."""

from __future__ import annotations

import pytest

from relax_core.config.algorithms import DAPOConfig, GRPOConfig
from relax_core.data.sample import Sample
from relax_core.rollout.sampling_rounds import collect_batch


def group(gid: int, rewards: list[float], length: int = 1) -> list[Sample]:
    return [Sample([1], [2] * length, [0.0] * length, reward=r, group_id=gid) for r in rewards]


def rounds_of(*rounds: list[Sample]):
    calls = []

    def generate(r: int) -> list[Sample]:
        calls.append(r)
        return rounds[r]

    return generate, calls


NO_OVERLONG = {"overlong": {"enabled": False}}


def test_dynamic_sampling_drops_flat_groups_and_refills_then_cuts_to_the_target():
    # Round 0: groups 1 (flat) and 2 (informative); round 1: 3 (flat), 4 and 5 (informative). Target: 2 groups.
    generate, calls = rounds_of(group(1, [1, 1]) + group(2, [0, 1]),
                                group(3, [0, 0]) + group(4, [1, 0]) + group(5, [0, 1]))
    samples, stats = collect_batch(generate, DAPOConfig(**NO_OVERLONG), max_new_tokens=8, target_groups=2)
    assert [s.group_id for s in samples] == [2, 2, 4, 4]
    assert calls == [0, 1]
    assert (stats.rounds, stats.groups_generated, stats.groups_kept) == (2, 5, 2)


def test_dynamic_sampling_stops_after_max_rounds_with_what_it_has():
    generate, calls = rounds_of(group(1, [1, 1]), group(2, [0, 1]), group(3, [0, 1]))
    algo = DAPOConfig(dynamic_sampling={"max_num_gen_batches": 2}, **NO_OVERLONG)
    samples, stats = collect_batch(generate, algo, max_new_tokens=8, target_groups=4)
    assert [s.group_id for s in samples] == [2, 2] and calls == [0, 1]


def test_all_flat_falls_back_to_the_last_round_not_an_empty_batch():
    generate, _ = rounds_of(group(1, [1, 1]), group(2, [0, 0]))
    algo = DAPOConfig(dynamic_sampling={"max_num_gen_batches": 2}, **NO_OVERLONG)
    samples, stats = collect_batch(generate, algo, max_new_tokens=8, target_groups=1)
    assert [s.group_id for s in samples] == [2, 2] and stats.groups_kept == 0


def test_overlong_shaping_then_filter_on_shaped_reward():
    # L_max 8, L_cache 4: lengths 4 -> 0, 6 -> (4 - 6) / 4 = -0.5, 9 -> -1.
    batch = group(1, [1.0], length=4) + group(1, [1.0], length=6) + group(2, [0.0], length=9) + group(2, [0.0], 9)
    generate, _ = rounds_of(batch)
    algo = DAPOConfig(overlong={"buffer_len": 4})
    samples, stats = collect_batch(generate, algo, max_new_tokens=8, target_groups=1)
    assert [s.reward for s in samples] == pytest.approx([1.0, 0.5])  # group 2 is flat (-1, -1): dropped
    assert stats.overlong_penalised == 3


def test_other_algorithms_take_one_round_untouched():
    batch = group(1, [1, 1], length=100)
    generate, calls = rounds_of(batch)
    samples, stats = collect_batch(generate, GRPOConfig(), max_new_tokens=8, target_groups=5)
    assert samples == batch and [s.reward for s in samples] == [1, 1] and calls == [0]
