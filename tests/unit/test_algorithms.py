"""Advantage estimators, policy loss, KL, TIS and loss aggregation on hand-worked batches.

Every expected number below is worked out by hand (see the comments) from the
formulas in docs/algorithms.md, not produced by the code under test.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from relax_core.algorithms import registry
from relax_core.algorithms.advantages import dr_grpo, grpo, rloo
from relax_core.algorithms.aggregation import (
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_mean,
)
from relax_core.algorithms.kl import k1, k2, k3
from relax_core.algorithms.losses import ppo_clip, tis_weight

# Groups interleaved on purpose: "a" = {1, 2, 3} (mean 2, unbiased std 1),
# "b" = {5} (size 1), "c" = {2, 2} (all equal).
REWARDS = torch.tensor([1.0, 5.0, 2.0, 2.0, 3.0, 2.0])
GROUPS = [0, 1, 2, 0, 0, 2]


def close(actual: torch.Tensor, expected: list[float], tol: float = 1e-6) -> None:
    assert torch.allclose(
        actual.double(), torch.tensor(expected, dtype=torch.float64), atol=tol, rtol=0
    ), actual


def test_grpo_hand_worked_with_size_one_and_equal_groups():
    adv = grpo(REWARDS, GROUPS)
    eps = 1e-6
    # a: (1-2)/(1+eps), (2-2)/(1+eps), (3-2)/(1+eps); b: size 1 -> mean 0, std 1 -> 5/(1+eps); c: 0/(0+eps) = 0.
    close(adv, [-1 / (1 + eps), 5 / (1 + eps), 0.0, 0.0, 1 / (1 + eps), 0.0])
    assert not torch.isnan(adv).any()


def test_grpo_std_is_unbiased():
    # rewards {0, 0, 0, 1}: mean 0.25, unbiased var = (3*0.0625 + 0.5625)/3 = 0.25, std 0.5.
    adv = grpo(torch.tensor([0.0, 0.0, 0.0, 1.0]), [7, 7, 7, 7])
    close(adv, [-0.25 / 0.500001] * 3 + [0.75 / 0.500001])


def test_dr_grpo_has_no_std():
    close(dr_grpo(REWARDS, GROUPS), [-1.0, 5.0, 0.0, 0.0, 1.0, 0.0])


def test_rloo_is_leave_one_out():
    # a: 1 - mean(2,3) = -1.5, 2 - mean(1,3) = 0, 3 - mean(1,2) = 1.5; b: 5 (size 1); c: 2 - 2 = 0.
    close(rloo(REWARDS, GROUPS), [-1.5, 5.0, 0.0, 0.0, 1.5, 0.0])


@pytest.mark.parametrize("fn", [grpo, dr_grpo, rloo])
def test_all_equal_rewards_give_zero_advantage(fn):
    adv = fn(torch.tensor([0.7, 0.7, 0.7, 0.7]), [3, 3, 3, 3])
    assert torch.equal(adv, torch.zeros(4))


def _ppo(ratios, advs, **kw):
    logp_old = torch.zeros(len(ratios))
    logp = torch.log(torch.tensor(ratios)).requires_grad_(True)
    out = ppo_clip(logp, logp_old, torch.tensor(advs), **kw)
    return logp, out


def test_ppo_clip_hand_worked_with_clip_higher_and_dual_clip():
    # eps_low 0.2, eps_high 0.28: clip range [0.8, 1.28]; dual clip c = 3.
    ratios = [0.5, 1.25, 1.5, 0.5, 1.5, 4.0, 4.0]
    advs = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -2.0]
    logp, out = _ppo(ratios, advs, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    expected = [
        -0.5,  # A=1, r=0.5: max(-0.5, -0.8)
        -1.25,  # A=1, r=1.25 inside [0.8, 1.28]: -1.25
        -1.28,  # A=1, r=1.5: max(-1.5, -1.28)
        0.8,  # A=-1, r=0.5: max(0.5, 0.8)
        1.5,  # A=-1, r=1.5: max(1.5, 1.28)
        3.0,  # A=-1, r=4: max(4, 1.28) = 4, dual clip min(4, 3) = 3
        6.0,  # A=-2, r=4: max(8, 2.56) = 8, dual clip min(8, 6) = 6
    ]
    close(out.loss, expected)
    close(out.clipped, [0, 0, 1, 1, 0, 1, 1])
    out.loss.sum().backward()
    # d/dlogp of -A r is -A r where the unclipped branch is active, 0 where a clip is.
    close(logp.grad, [-0.5, -1.25, 0.0, 0.0, 1.5, 0.0, 0.0])


def test_ppo_clip_symmetric_eps_clips_where_clip_higher_does_not():
    _, out = _ppo([1.25], [1.0], eps_low=0.2, eps_high=0.2)
    close(out.loss, [-1.2])  # max(-1.25, -1.2)
    close(out.clipped, [1.0])


def test_ppo_clip_without_dual_clip():
    _, out = _ppo([4.0], [-1.0], eps_low=0.2, eps_high=0.2, dual_clip_c=None)
    close(out.loss, [4.0])


def test_ppo_clip_log_ratio_is_clamped():
    logp_old = torch.zeros(1)
    out = ppo_clip(
        torch.tensor([50.0]), logp_old, torch.tensor([1.0]), eps_low=0.2, eps_high=0.2
    )
    close(out.ratio, [math.exp(20.0)], tol=1e-2 * math.exp(20.0))
    close(out.loss, [-1.2])


def test_kl_estimators_hand_worked():
    logp = torch.tensor([-1.0, -2.0, -1.0, -1.0])
    logp_ref = torch.tensor([-1.5, -1.0, 4.0, -31.0])
    close(k1(logp, logp_ref), [0.5, -1.0, -5.0, 30.0])
    close(k2(logp, logp_ref), [0.125, 0.5, 12.5, 450.0])
    # d = logp_ref - logp = [-0.5, 1, 5, -30]; k3 = e^d - d - 1, clamped to [-10, 10]:
    # e^-0.5 + 0.5 - 1 = 0.10653066; e - 2 = 0.71828183; e^5 - 6 = 142.4 -> 10; e^-30 + 29 -> 10.
    close(k3(logp, logp_ref), [0.1065306597, 0.7182818285, 10.0, 10.0])


def test_k3_is_zero_and_flat_at_equal_policies():
    logp = torch.tensor([-0.3, -2.0], requires_grad=True)
    value = k3(logp, logp.detach().clone())
    value.sum().backward()
    close(value, [0.0, 0.0])
    close(logp.grad, [0.0, 0.0])


def test_tis_weight_is_truncated_and_carries_no_gradient():
    logp_rollout = torch.tensor([-1.0, -1.0, -1.0])
    logp_old = torch.tensor(
        [-1.0, -1.0 + math.log(1.5), -1.0 + math.log(3.0)], requires_grad=True
    )
    w = tis_weight(logp_old, logp_rollout, cap=2.0)
    close(w, [1.0, 1.5, 2.0])  # exp(0), exp(log 1.5), min(3, 2)
    assert not w.requires_grad


# loss rows: seq 0 has 2 valid tokens, seq 1 has 1, seq 2 has a zero-length response.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_token_mean_hand_worked():
    close(token_mean(LOSS, MASK), [(1 + 2 + 4) / 3])
    # with the step's global token count (e.g. 6 tokens over all micro-batches/ranks)
    close(token_mean(LOSS, MASK, global_tokens=6), [7 / 6])


def test_seq_mean_token_sum_hand_worked():
    close(seq_mean_token_sum(LOSS, MASK), [((1 + 2) + 4 + 0) / 3])
    close(seq_mean_token_sum(LOSS, MASK, global_seqs=7), [7 / 7])


def test_seq_mean_token_mean_hand_worked():
    # per sequence: (1+2)/2 = 1.5, 4/1 = 4, empty -> 0; mean over 3 sequences.
    close(seq_mean_token_mean(LOSS, MASK), [(1.5 + 4 + 0) / 3])


def test_seq_mean_token_sum_norm_hand_worked():
    close(seq_mean_token_sum_norm(LOSS, MASK, norm_len=4), [7 / (3 * 4)])
    close(
        seq_mean_token_sum_norm(LOSS, MASK), [7 / (3 * 3)]
    )  # default: the padded length 3


@pytest.mark.parametrize(
    "agg",
    [token_mean, seq_mean_token_sum, seq_mean_token_mean, seq_mean_token_sum_norm],
)
def test_masked_positions_get_exactly_zero_gradient_even_if_nan(agg):
    loss = torch.tensor(
        [[1.0, float("nan"), float("inf")], [2.0, 3.0, float("nan")]],
        requires_grad=True,
    )
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    value = agg(loss * 1.0, mask)
    value.backward()
    assert torch.isfinite(value)
    assert torch.all(loss.grad[mask == 0] == 0.0)
    assert torch.all(loss.grad[mask == 1] > 0.0)


@pytest.mark.parametrize(
    "agg",
    [token_mean, seq_mean_token_sum, seq_mean_token_mean, seq_mean_token_sum_norm],
)
def test_all_masked_batch_is_zero_not_nan(agg):
    value = agg(torch.ones(2, 3), torch.zeros(2, 3))
    assert value.item() == 0.0


def test_micro_batch_contributions_sum_to_token_mean():
    # split LOSS/MASK into two micro-batches; each divides by the global count 3.
    parts = [
        token_mean(LOSS[:1], MASK[:1], global_tokens=3),
        token_mean(LOSS[1:], MASK[1:], global_tokens=3),
    ]
    close(sum(parts), [7 / 3])


def test_every_piece_is_registered_where_it_is_defined():
    from relax_core.algorithms import estimators, policy_losses

    assert registry.names("estimator") == sorted(
        ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "opd"]
    )
    assert registry.names("loss") == ["cispo", "gspo", "ppo_clip", "sapo"]
    assert registry.names("token_selection") == ["m2"]
    assert registry.names("kl") == ["k1", "k2", "k3", "low_var_kl"]
    assert registry.names("loss_agg") == sorted(
        ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
    )
    assert registry.get_estimator("grpo") is estimators.grpo
    assert registry.get_loss("ppo_clip") is policy_losses.ppo_clip
    assert registry.get_token_selection("m2") is policy_losses.m2_keep_mask
    assert registry.get_kl_estimator("low_var_kl") is k3
    assert registry.get_loss_aggregator("token-mean") is token_mean


def test_registry_unknown_name_lists_valid_ones():
    with pytest.raises(KeyError, match="valid names: dr_grpo, gae, grpo, opd, reinforce_pp"):
        registry.get_estimator("grpoo")
    with pytest.raises(KeyError, match="valid kinds: estimator, loss"):
        registry.names("advantage")


def test_a_name_cannot_be_registered_twice():
    registry.get_loss("ppo_clip")  # the built-ins are registered
    with pytest.raises(ValueError, match="loss 'ppo_clip' is already registered"):
        registry.register_loss("ppo_clip")(lambda *args, **kwargs: None)
    assert registry.get_loss("ppo_clip").__module__ == "relax_core.algorithms.policy_losses"


def test_registry_imports_the_implementations_only_on_resolve():
    code = (
        "import sys, relax_core.algorithms.registry as r, relax_core.config.algorithm_specs as s; s.get_spec('grpo'); "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "r.get_estimator('grpo'); assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
