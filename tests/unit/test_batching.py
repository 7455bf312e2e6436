"""Sharding, micro-batching, right padding and response log-prob extraction."""

from __future__ import annotations

import math

import pytest
import torch

from relax_core.algorithms.aggregation import token_mean
from relax_core.algorithms.losses import ppo_clip
from relax_core.data.sample import Sample
from relax_core.train.batching import chunks, pack, response_logprobs, shard

PAD = 0


def sample(prompt, response, loss_mask=None, logprobs=None):
    return Sample(
        prompt_ids=prompt,
        response_ids=response,
        rollout_logprobs=logprobs if logprobs is not None else [-0.5] * len(response),
        loss_mask=loss_mask or [],
    )


def test_shard_is_contiguous_and_balanced():
    items = list(range(7))
    assert [shard(items, r, 3) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [shard(items[:1], r, 2) for r in range(2)] == [[0], []]


def test_chunks():
    assert chunks(list(range(5)), 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError):
        chunks([1], 0)


def test_pack_right_pads_and_indexes_response_tokens():
    samples = [
        sample([5, 6, 7], [8, 9], loss_mask=[1, 0], logprobs=[-1.0, -2.0]),
        sample([5], [4, 3, 2]),
        sample([5, 6], []),  # zero-length response
    ]
    mb = pack(samples, PAD)
    # longest sequence: 3+2 = 5 = 1+3; longest response 3.
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 4, 3, 2, 0], [5, 6, 0, 0, 0]]
    assert mb.attention_mask.tolist() == [
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 0],
    ]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 3
    # response token j is predicted by the logits at prompt_len + j - 1
    assert mb.logit_index[0, :2].tolist() == [2, 3]
    assert mb.logit_index[1].tolist() == [0, 1, 2]
    assert mb.response_ids.tolist() == [[8, 9, 0], [4, 3, 2], [0, 0, 0]]
    assert mb.valid.tolist() == [
        [True, True, False],
        [True, True, True],
        [False, False, False],
    ]
    assert mb.loss_mask.tolist() == [[1, 0, 0], [1, 1, 1], [0, 0, 0]]
    assert mb.rollout_logprobs[0].tolist() == [-1.0, -2.0, 0.0]
    assert mb.num_tokens == 4
    assert mb.response_lists(mb.rollout_logprobs) == [
        [-1.0, -2.0],
        [-0.5, -0.5, -0.5],
        [],
    ]


def test_pack_rejects_inconsistent_samples():
    with pytest.raises(ValueError, match="loss_mask"):
        pack([sample([1], [2, 3], loss_mask=[1])])
    with pytest.raises(ValueError, match="rollout log-probs"):
        pack([sample([1], [2, 3], logprobs=[-1.0])])
    with pytest.raises(ValueError, match="empty prompt"):
        pack([sample([], [2])])


def test_response_logprobs_reads_the_right_logit_rows():
    mb = pack([sample([1, 2], [1, 0])], PAD)
    logits = torch.zeros(1, 4, 3)
    logits[0, 1] = torch.tensor(
        [0.0, math.log(2.0), 0.0]
    )  # predicts response token 0 (id 1): p = 2/4
    logits[0, 2] = torch.tensor(
        [math.log(3.0), 0.0, 0.0]
    )  # predicts response token 1 (id 0): p = 3/5
    logp, entropy = response_logprobs(logits, mb, with_entropy=True)
    assert torch.allclose(logp, torch.tensor([[math.log(0.5), math.log(0.6)]]))
    # entropy of (1/4, 2/4, 1/4) = 1.5 ln 2
    assert entropy[0, 0].item() == pytest.approx(1.5 * math.log(2.0), abs=1e-6)


def test_masked_positions_get_exactly_zero_gradient():
    """Prompt, padding and loss-masked (tool) tokens contribute no gradient to any logit."""
    samples = [
        sample(
            [3, 4, 5], [6, 7, 8], loss_mask=[1, 0, 1]
        ),  # middle token is tool output
        sample([3], [4]),
        sample([3, 4], []),
    ]
    mb = pack(samples, PAD)
    torch.manual_seed(0)
    logits = torch.randn(*mb.input_ids.shape, 10, requires_grad=True)
    logp, _ = response_logprobs(logits, mb)
    logp_old = logp.detach()  # ratio 1: no learned token is clipped
    out = ppo_clip(logp, logp_old, torch.tensor([[1.0], [-1.0], [2.0]]))
    token_mean(out.loss, mb.loss_mask).backward()
    # positions (row, logit position) that predict a learned token: sample 0 tokens 0 and 2, sample 1 token 0.
    learned = {(0, 2), (0, 4), (1, 0)}
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            row = logits.grad[b, t]
            if (b, t) in learned:
                assert row.abs().sum() > 0, (b, t)
            else:
                assert torch.all(row == 0.0), (b, t)
