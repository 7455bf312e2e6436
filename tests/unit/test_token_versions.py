"""Each response token's policy version: from SGLang's spans to the driver's per-token staleness check.

The engine reports `meta_info["weight_versions"]` (spans over output tokens, end exclusive, as
sglang/srt/utils/weight_versions.py writes them); the client turns them into one version per token, the
sample keeps them where they differ, and the driver checks and reports staleness per token. Expected values
are written out by hand here.
"""

from __future__ import annotations

import pytest

from relax_core.controller.streaming import check_trained, staleness_metrics
from relax_core.data.sample import Sample, mixed_versions
from relax_core.rollout.client import parse_generate_output
from relax_core.services.rollout import StepRecord


def item(n: int, meta: dict) -> dict:
    """One `/generate` item of n tokens with log-probs, and `meta` in its meta_info."""
    logprobs = [[-0.5, 10 + k, None] for k in range(n)]
    return {"text": "", "output_ids": [10 + k for k in range(n)],
            "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": logprobs, **meta}}


def test_spans_give_each_token_its_version_and_the_oldest_is_the_samples():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3},
             {"version": "5", "start": 3, "end": 6}]
    out = parse_generate_output(item(6, {"weight_version": "5", "weight_versions": spans}))
    assert out.token_versions == [3, 3, 4, 5, 5, 5]
    assert out.policy_version == 3 and out.weight_version == "5"


def test_without_spans_every_token_has_the_engines_version():
    out = parse_generate_output(item(4, {"weight_version": "7"}))
    assert out.token_versions == [7, 7, 7, 7] and out.policy_version == 7
    first = parse_generate_output(item(2, {"weight_version": "default",
                                           "weight_versions": [{"version": "default", "start": 0, "end": 2}]}))
    assert first.token_versions == [0, 0] and first.policy_version == 0  # SGLang's initial weights


def test_spans_that_do_not_cover_the_tokens_are_refused():
    short = [{"version": "1", "start": 0, "end": 3}]
    with pytest.raises(ValueError, match="cover 3 tokens of 4"):
        parse_generate_output(item(4, {"weight_version": "1", "weight_versions": short}))
    gap = [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 2, "end": 4}]
    with pytest.raises(ValueError, match="not contiguous"):
        parse_generate_output(item(4, {"weight_version": "2", "weight_versions": gap}))


def test_a_sample_keeps_token_versions_only_where_they_differ():
    assert mixed_versions([4, 4, 4]) is None and mixed_versions([]) is None
    assert mixed_versions([4, 4, 5]) == [4, 4, 5]
    one = Sample([1], [2, 3, 4], [0.0] * 3, policy_version=6)
    two = Sample([1], [2, 3, 4], [0.0] * 3, policy_version=5, token_versions=[5, 6, 6])
    empty = Sample([1], [], [], policy_version=2)
    assert one.version_counts() == {6: 3} and two.version_counts() == {5: 1, 6: 2} and empty.version_counts() == {2: 0}


def record(ids: list[int]) -> StepRecord:
    return StepRecord(step=5, count=len(ids), sample_ids=ids, versions=[], generate_s=0.0, idle_s=0.0, sync_s=0.0,
                      data_state={})


def test_the_driver_checks_every_tokens_staleness_not_just_the_samples_last_version():
    # step 5 trains from version 4; max_staleness 2 allows versions 2..4
    check_trained(5, record([1, 2]), [1, 2], [{2: 3, 3: 4}, {4: 5}], max_staleness=2)
    with pytest.raises(RuntimeError, match="token staleness 0..3"):
        check_trained(5, record([1, 2]), [1, 2], [{1: 1, 3: 4}, {4: 5}], max_staleness=2)  # one token of v1
    with pytest.raises(RuntimeError, match="token staleness -1..0"):
        check_trained(5, record([1]), [1], [{4: 2, 5: 1}], max_staleness=2)  # a token newer than the trainer


def test_staleness_metrics_count_tokens_and_samples_that_mix_versions():
    # step 5 (trainer at version 4): a sample of 3 tokens of v2 and 1 of v3, one of 4 tokens of v4, one of v3
    metrics = staleness_metrics([{2: 3, 3: 1}, {4: 4}, {3: 2}], step=5)
    assert metrics == {
        "staleness_min": 0.0, "staleness_mean": (2 + 0 + 1) / 3, "staleness_max": 2.0,
        "token_staleness_mean": (3 * 2 + 1 * 1 + 4 * 0 + 2 * 1) / 10, "token_staleness_max": 2.0,
        "multi_version_frac": 1 / 3,
    }


def test_a_sample_refuses_token_versions_of_another_length():
    with pytest.raises(ValueError, match="2 token versions for 3 response tokens"):
        Sample([1], [2, 3, 4], [0.0] * 3, policy_version=1, token_versions=[1, 2])


def test_a_trajectorys_tokens_keep_their_turns_versions_and_environment_tokens_their_turns():
    from relax_core.rollout.client import GenerateOutput
    from relax_core.rollout.multiturn import Trajectory

    traj = Trajectory(prompt_ids=[1, 2])
    traj.add_model(GenerateOutput([5, 6, 7], [-0.1] * 3, "stop", "4", token_versions=[3, 3, 4]), "a", closed=True)
    traj.add_env([8, 9])  # the answer to a turn that ended under version 4
    traj.add_model(GenerateOutput([10], [-0.2], "stop", "4", token_versions=[4]), "b", closed=True)
    sample = traj.sample(group_id=0, sample_id=0, row={})
    assert sample.token_versions == [3, 3, 4, 4, 4, 4] and sample.policy_version == 3
    assert sample.loss_mask == [1, 1, 1, 0, 0, 1]
    steady = Trajectory(prompt_ids=[1])
    steady.add_model(GenerateOutput([5], [-0.1], "stop", "2", token_versions=[2]), "a", closed=True)
    steady.add_env([8])
    assert steady.sample(group_id=0, sample_id=1, row={}).token_versions is None
    assert steady.sample(group_id=0, sample_id=1, row={}).policy_version == 2
