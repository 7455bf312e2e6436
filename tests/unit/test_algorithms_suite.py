"""The algorithm suite's estimators, losses, DAPO pieces, specs and configs on hand-worked batches.

Every expected number is worked out by hand in the comments from
docs/algorithms.md and written as literals or elementary arithmetic
(plain Python floats), never produced by the code under test. Layout of the
`[B, T]` batches: a mask row of zeros is a zero-length response.
"""

from __future__ import annotations

import math
import subprocess
import sys
import typing

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from relax_core.algorithms import registry
from relax_core.algorithms.aggregation import seq_mean_token_mean, token_mean
from relax_core.algorithms.dapo import dynamic_sampling_keep, overlong_penalty
from relax_core.algorithms.estimators import AdvantageBatch, gae, grpo, opd, reinforce_pp, reinforce_pp_baseline, rloo
from relax_core.algorithms.policy_losses import cispo, gspo, m2_keep_mask, ppo_clip, sapo, value_loss
from relax_core.catalog import algorithm_entries
from relax_core.config.algorithm_specs import AlgorithmSpec, algorithm_names, get_spec, spec_problems
from relax_core.config.algorithms import AlgorithmConfig, KLConfig, LossAgg, algorithm_problems, config_class

NAN, INF = float("nan"), float("inf")


def close(actual: torch.Tensor, expected, tol: float = 1e-6) -> None:
    expected = torch.tensor(expected, dtype=torch.float64)
    assert torch.allclose(actual.double(), expected, atol=tol, rtol=0), actual


def whitened(values: list[float]) -> list[float]:
    """Whitening by hand: mean, unbiased variance, divide (the reference for the estimators' whiten)."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


# ----------------------------------------------------------------- estimators
def test_sequence_estimators_broadcast_to_tokens_and_skip_empty_rows():
    # groups: rows 0, 1 = {1, 3} (mean 2, unbiased std sqrt(2)); row 2 = {5}, size 1, zero-length.
    batch = AdvantageBatch(torch.tensor([1.0, 3.0, 5.0]), [0, 0, 1], torch.tensor([[1, 1], [1, 0], [0, 0]]))
    a = 1 / (math.sqrt(2) + 1e-6)
    close(grpo(batch).advantages, [[-a, -a], [a, 0], [0, 0]])
    # rloo: 1 - 3 = -2, 3 - 1 = 2
    close(rloo(batch).advantages, [[-2, -2], [2, 0], [0, 0]])
    assert grpo(batch).returns is None


def test_reinforce_pp_baseline_hand_worked():
    # rows 0, 1: group {1, 3} -> centred -1, +1; row 2: size 1 and zero-length; row 3: size 1 -> mean 0 -> 2.
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    batch = AdvantageBatch(torch.tensor([1.0, 3.0, 5.0, 2.0]), [0, 0, 1, 2], mask)
    w = whitened([-1, -1, 1, 2, 2, 2])  # the six response tokens, whitened over the batch
    close(reinforce_pp_baseline(batch).advantages, [[w[0], w[1], 0], [w[2], 0, 0], [0, 0, 0], w[3:]])


def test_reinforce_pp_kl_in_reward_discount_and_whitening():
    mask = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 0, 0]])
    kl = torch.tensor([[1.0, 2.0, -1.0], [2.0, 100.0, 0.0], [NAN, NAN, NAN]])
    batch = AdvantageBatch(torch.tensor([1.0, 2.0, 7.0]), [0, 1, 2], mask, kl=kl)
    # gamma 0.5, beta 0.1. row 0 rewards: -0.1, -0.2, +0.1 + 1 = 1.1
    #   G2 = 1.1, G1 = -0.2 + 0.5*1.1 = 0.35, G0 = -0.1 + 0.5*0.35 = 0.075
    # row 1 (middle token masked: no reward, no discount): r0 = -0.2, r2 = 2 -> G2 = 2, G0 = -0.2 + 0.5*2 = 0.8
    # row 2 is empty: its reward has no token to land on.
    w = whitened([0.075, 0.35, 1.1, 0.8, 2.0])
    adv = reinforce_pp(batch, gamma=0.5, kl_coef=0.1).advantages
    close(adv, [[w[0], w[1], w[2]], [w[3], 0, w[4]], [0, 0, 0]])


def test_gae_hand_worked_with_skipped_observation_token():
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    values = torch.tensor([[0.5, 1.0, 9.0], [0.2, 5.0, 0.4], [3.0, 3.0, 3.0]])
    batch = AdvantageBatch(torch.tensor([2.0, 1.0, 4.0]), [0, 1, 2], mask, values=values)
    # gamma 0.9, lambda 0.5 (gamma*lambda = 0.45), V after the last token = 0.
    # row 0: delta1 = 2 - 1.0 = 1 -> A1 = 1; delta0 = 0.9*1.0 - 0.5 = 0.4 -> A0 = 0.4 + 0.45*1 = 0.85
    # row 1: delta2 = 1 - 0.4 = 0.6 -> A2 = 0.6; t=1 skipped;
    #   delta0 = 0.9*0.4 - 0.2 = 0.16 -> A0 = 0.16 + 0.45*0.6 = 0.43
    out = gae(batch, gamma=0.9, lam=0.5)
    close(out.returns, [[0.85 + 0.5, 1 + 1.0, 0], [0.43 + 0.2, 0, 0.6 + 0.4], [0, 0, 0]])
    w = whitened([0.85, 1.0, 0.43, 0.6])
    close(out.advantages, [[w[0], w[1], 0], [w[2], 0, w[3]], [0, 0, 0]])


def test_gae_kl_in_reward():
    # one token, V = 0, gamma 1: A = R - beta*kl = 1 - 0.5*0.4 = 0.8 (returns, before whitening)
    batch = AdvantageBatch(torch.tensor([1.0]), [0], torch.tensor([[1]]), kl=torch.tensor([[0.4]]),
                           values=torch.zeros(1, 1))
    close(gae(batch, gamma=1.0, lam=1.0, kl_coef=0.5).returns, [[0.8]])


def test_opd_advantage_is_negative_log_ratio_to_teacher():
    batch = AdvantageBatch(torch.zeros(1), [0], torch.tensor([[1, 1, 0]]),
                           logp=torch.tensor([[-1.0, -2.0, 5.0]]), logp_teacher=torch.tensor([[-0.5, -3.0, NAN]]))
    # -(logp - logp_teacher): -(-1 + 0.5) = 0.5, -(-2 + 3) = -1, masked 0
    close(opd(batch).advantages, [[0.5, -1.0, 0.0]])


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"])
def test_all_equal_rewards_give_exactly_zero_advantage(name):
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 1]])
    # gae: a critic that already predicts the reward (V = 0.7, gamma 1) gives every delta = 0
    batch = AdvantageBatch(torch.full((4,), 0.7), [0, 0, 1, 1], mask, values=torch.full((4, 2), 0.7))
    adv = registry.get_estimator(name)(batch).advantages
    assert torch.equal(adv, torch.zeros(4, 2))


def test_whitening_of_an_empty_batch_is_zero():
    batch = AdvantageBatch(torch.tensor([1.0, 2.0]), [0, 0], torch.zeros(2, 3))
    assert torch.equal(reinforce_pp_baseline(batch).advantages, torch.zeros(2, 3))


# ------------------------------------------------------------- policy losses
def _logp(values, requires_grad=True):
    return torch.tensor(values, dtype=torch.float64, requires_grad=requires_grad)


def test_masked_ppo_clip_keeps_dual_clip():
    # A = -1, r = 4: max(4, 1.2) = 4, dual clip min(4, 3) = 3; A = 1, r = 1: -1
    logp = _logp([[math.log(4.0), 0.0]])
    out = ppo_clip(logp, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([[-1.0, 1.0]], dtype=torch.float64),
                   mask=torch.ones(1, 2))
    close(out.loss, [[3.0, -1.0]])


def test_gspo_values_sequence_clip_and_dual_clip():
    mask = torch.tensor([[1, 1], [1, 0], [0, 0], [1, 1]])
    logp = _logp([[0.1, 0.3], [0.0, 9.0], [5.0, 5.0], [math.log(4.0) - 0.5, math.log(4.0) + 0.5]])
    adv = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]], dtype=torch.float64)
    out = gspo(logp, torch.zeros(4, 2, dtype=torch.float64), adv, mask=mask, dual_clip_c=3.0)
    # row 0: s = exp(0.2) = 1.2214 > 1.0004, A > 0 -> -1.0004 (clipped); row 1: s = exp(0) = 1 -> -A*1 = 1
    # row 2: empty -> 0; row 3: s = exp(log 4) = 4, A = -1: max(4, 1.0004) = 4, dual clip -> 3
    close(out.loss * mask, [[-1.0004, -1.0004], [1.0, 0.0], [0.0, 0.0], [3.0, 3.0]])
    close(out.clipped * mask, [[1, 1], [0, 0], [0, 0], [1, 1]])


def test_gspo_gradient_equals_sequence_level_objective():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    logp_old = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    start = [[-0.9, -0.6, -1.8], [-0.4, -1.0, 7.0], [1.0, 2.0, 3.0]]
    adv = torch.tensor([[0.7], [-1.3], [2.0]], dtype=torch.float64)
    logp = _logp(start)
    out = gspo(logp, logp_old, adv, mask=mask, eps_low=10.0 - 9.5, eps_high=10.0)  # wide clip: unclipped
    seq_mean_token_mean(out.loss, mask).backward()
    # sequence level, written directly: mean over the 3 rows of -A_i exp(mean_t(logp - logp_old)) (empty row: constant)
    ref = _logp(start)
    s0 = torch.exp(((ref[0, :3] - logp_old[0, :3]).sum()) / 3)
    s1 = torch.exp(((ref[1, :2] - logp_old[1, :2]).sum()) / 2)
    ((-0.7 * s0 + 1.3 * s1) / 3).backward()
    close(logp.grad, ref.grad.tolist(), tol=1e-12)
    assert torch.all(logp.grad[mask == 0] == 0)


def test_cispo_clips_the_weight_but_keeps_every_gradient():
    # ratios 0.5, 1.0, 2.0 with A = 1, -1, 2; eps 0.2 / 0.28 -> weights 0.8, 1.0, 1.28
    lp = [-1.0, -2.0, -0.5]
    logp = _logp([lp])
    logp_old = torch.tensor([[lp[0] - math.log(0.5), lp[1], lp[2] - math.log(2.0)]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    out = cispo(logp, logp_old, adv, mask=torch.ones(1, 3), eps_low=0.2, eps_high=0.28)
    # -w A logp: -0.8*1*(-1) = 0.8, -1*(-1)*(-2) = -2, -1.28*2*(-0.5) = 1.28
    close(out.loss, [[0.8, -2.0, 1.28]])
    close(out.clipped, [[1, 0, 1]])
    out.loss.sum().backward()
    close(logp.grad, [[-0.8, 1.0, -2.56]])  # -w A, non-zero on the clipped tokens too
    # default eps_low = 1: no lower bound, the weight of r = 0.5 stays 0.5
    close(cispo(logp, logp_old, adv, mask=torch.ones(1, 3)).loss[0, :1], [0.5])


def test_sapo_soft_gate_values_and_gradients():
    # (r, A): (1, 2), (1, -1), (2, 1), (1, 0); tau_pos 1, tau_neg 1.05
    logp = _logp([[0.0, 0.0, math.log(2.0), 0.0]])
    adv = torch.tensor([[2.0, -1.0, 1.0, 0.0]], dtype=torch.float64)
    out = sapo(logp, torch.zeros(1, 4, dtype=torch.float64), adv, mask=torch.ones(1, 4))
    sig1 = 1 / (1 + math.exp(-1))  # sigmoid(1 * (2 - 1))
    # gate f(1) = 0.5 * 4/tau: tau 1 -> 2, tau 1.05 -> 2/1.05; f(2) = sig1 * 4
    close(out.loss, [[-2 * 2.0, 2 / 1.05, -sig1 * 4, 0.0]])
    out.loss.sum().backward()
    # d/dlogp (-A f(r)) = -A * 4 sigma (1 - sigma) * r; at r = 1: sigma(1-sigma) = 1/4 -> -A
    close(logp.grad, [[-2.0, 1.0, -(4 * sig1 * (1 - sig1)) * 2, 0.0]])


def test_m2_keep_mask_drops_largest_squared_log_ratio_first():
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    logp_rollout = torch.zeros(2, 3, dtype=torch.float64)
    logp_old = torch.tensor([[0.1, 0.5, 10.0], [0.2, -0.3, 0.0]], dtype=torch.float64)
    # squares of the 4 valid tokens: 0.01, 0.25, 0.04, 0.09 (padding's 100 ignored), threshold 0.04
    # drop 0.25: (0.01 + 0.04 + 0.09)/3 = 0.0467 > 0.04; drop 0.09: (0.01 + 0.04)/2 = 0.025 <= 0.04: stop
    keep = m2_keep_mask(logp_old, logp_rollout, mask, 0.04)
    assert keep.tolist() == [[True, False, False], [True, False, False]]
    assert m2_keep_mask(logp_old, logp_rollout, mask, 1.0).tolist() == [[True, True, False], [True, True, False]]
    assert not m2_keep_mask(logp_old, logp_rollout, mask, 0.001).any()  # even the smallest, 0.01, is too big


def test_m2po_is_grpo_loss_on_the_tokens_its_selection_keeps():
    # M2PO as its spec composes it: the token selection over the step, then its loss token-mean over kept tokens.
    spec = get_spec("m2po")
    select, loss = registry.get_token_selection(spec.token_selection), registry.get_loss(spec.policy_loss)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    logp_old = torch.tensor([[0.1, 0.5, 10.0], [0.2, -0.3, 0.0]], dtype=torch.float64)
    logp = _logp([[0.1, 0.5, 10.0], [0.2 + math.log(4.0), -0.3, 0.0]])
    adv = torch.tensor([[1.0], [-2.0]], dtype=torch.float64)
    keep = select(logp_old, torch.zeros(2, 3, dtype=torch.float64), mask, m2_threshold=0.04)
    # squares 0.01, 0.25, 0.04, 0.09: kept (0,0) and (1,0), as in the test above
    assert keep.tolist() == [[True, False, False], [True, False, False]]
    out = loss(logp, logp_old, adv, mask=mask)
    total = token_mean(out.loss, mask * keep)
    # kept: (0,0) r = 1, A = 1 -> -1; (1,0) r = 4, A = -2 -> max(8, 2.4) = 8, dual clip 2*3 = 6; mean (-1 + 6) / 2
    close(total, 2.5)
    total.backward()
    close(logp.grad, [[-0.5, 0, 0], [0, 0, 0]])  # only the unclipped kept token: -A r / 2 tokens


def test_value_loss_clipped_token_mean():
    v_old = torch.ones(1, 4, dtype=torch.float64)
    values = _logp([[1.5, 1.1, 0.5, 2.0]])
    returns = torch.tensor([[2.0, 2.0, 0.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    out = value_loss(values, v_old, returns, mask=mask, value_clip=0.2)
    # t0: max((1.5-2)^2 = 0.25, (1.2-2)^2 = 0.64) / 2 = 0.32 (clipped); t1: 0.9^2/2 = 0.405
    # t2: max(0.5^2, 0.8^2)/2 = 0.32 (clipped); t3 is masked: its inputs are replaced by 0 -> 0
    close(out.loss, [[0.32, 0.405, 0.32, 0.0]])
    close(out.clipped, [[1, 0, 1, 0]])
    total = token_mean(out.loss, mask)
    close(total, (0.32 + 0.405 + 0.32) / 3)
    total.backward()
    close(values.grad, [[0.0, (1.1 - 2.0) / 3, 0.0, 0.0]])  # clipped branches and the masked token: 0


LOSSES = {
    "ppo_clip": (ppo_clip, {}),
    "gspo": (gspo, {"eps_low": 0.5, "eps_high": 0.5}),  # the paper's 4e-4 would clip these rows
    "cispo": (cispo, {}),
    "sapo": (sapo, {}),
}


def _garbage_batch():
    """Finite values on the mask, inf/NaN on masked positions of every input."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    fill = torch.tensor([[0, 0, NAN, INF], [0, -INF, 0, NAN], [NAN, INF, -INF, NAN]], dtype=torch.float64)
    base = torch.tensor([[-0.5, -1.0, 0, 0], [-2.0, 0, -0.1, 0], [0, 0, 0, 0]], dtype=torch.float64)
    logp = (base + fill).clone().requires_grad_(True)
    logp_old = base - 0.05 + fill
    adv = torch.tensor([[1.0, -1.0, 0, 0], [0.5, 0, 2.0, 0], [0, 0, 0, 0]], dtype=torch.float64) + fill
    return logp, logp_old, adv, mask


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_masked_tokens_get_exactly_zero_gradient_even_with_nan_inputs(name):
    fn, kw = LOSSES[name]
    logp, logp_old, adv, mask = _garbage_batch()
    out = fn(logp, logp_old, adv, mask=mask, logp_rollout=logp_old + 0.01, **kw)
    value = token_mean(out.loss, mask)
    value.backward()
    assert torch.isfinite(value)
    assert torch.all(logp.grad[mask == 0] == 0.0)
    assert torch.all(logp.grad[(mask == 1) & (adv != 0)] != 0.0)


@pytest.mark.parametrize("name, selected", [(name, False) for name in sorted(LOSSES)] + [("ppo_clip", True)])
@pytest.mark.parametrize("agg", [token_mean, seq_mean_token_mean])
def test_micro_batch_split_gives_same_loss_and_gradient(name, selected, agg):
    fn, kw = LOSSES[name]
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(8, 5, generator=gen) > 0.3).long()
    mask[3] = 0  # a zero-length response
    start = -torch.rand(8, 5, generator=gen, dtype=torch.float64)
    logp_old = start + 0.1 * torch.randn(8, 5, generator=gen, dtype=torch.float64)
    logp_rollout = logp_old + 0.1 * torch.randn(8, 5, generator=gen, dtype=torch.float64)
    adv = torch.randn(8, 1, generator=gen, dtype=torch.float64).expand(8, 5)
    # the m2 token selection runs once over the step; the loss is then aggregated over the kept tokens
    kept = mask * m2_keep_mask(logp_old, logp_rollout, mask, 0.005) if selected else mask
    norms = {"global_tokens": float(kept.sum()), "global_seqs": 8.0}
    results = []
    for parts in (1, 2, 4):
        logp = start.clone().requires_grad_(True)
        total = torch.zeros((), dtype=torch.float64)
        for rows in torch.arange(8).chunk(parts):
            out = fn(logp[rows], logp_old[rows], adv[rows], mask=mask[rows], logp_rollout=logp_rollout[rows], **kw)
            part = agg(out.loss, kept[rows], **norms)
            part.backward()
            total = total + part.detach()
        results.append((total, logp.grad))
    for total, grad in results[1:]:
        assert abs(float(total - results[0][0])) < 1e-6
        assert torch.allclose(grad, results[0][1], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------- DAPO
def test_dynamic_sampling_keeps_groups_with_different_rewards():
    rewards = [1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 3.0]
    groups = ["a", "a", "b", "b", "c", "c", "d"]
    # a is mixed; b and c are all-equal; d has one sample (all-equal by definition)
    assert dynamic_sampling_keep(rewards, groups) == [True, True, False, False, False, False, False]
    with pytest.raises(ValueError):
        dynamic_sampling_keep([1.0], ["a", "b"])


def test_overlong_penalty_hand_worked():
    # L_max 10, L_cache 4: free up to 6; 7 -> (6-7)/4 = -0.25; 9 -> -0.75; 10 -> -1; past 10 -> -1
    assert overlong_penalty([0, 6, 7, 9, 10, 11], max_len=10, cache_len=4) == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    with pytest.raises(ValueError):
        overlong_penalty([1], max_len=10, cache_len=0)


# ------------------------------------------------------------ specs / config
ALGO = TypeAdapter(AlgorithmConfig)
NEEDS = {"ppo": {"critic": {}}, "opd": {"teacher": {"path": "teacher-model"}}}
BUILT_IN = {"ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
            "gspo", "sapo", "cispo", "m2po", "opd"}


def test_every_algorithm_has_a_spec_a_documented_config_and_resolvable_parts():
    assert set(algorithm_names()) == BUILT_IN
    for name in algorithm_names():
        spec = get_spec(name)
        registry.get_estimator(spec.advantage_estimator)
        registry.get_loss(spec.policy_loss)
        registry.get_loss_aggregator(spec.loss_agg)
        if spec.token_selection:
            registry.get_token_selection(spec.token_selection)
        model = config_class(spec)
        assert model.model_fields["name"].default == name
        assert all(info.description for info in model.model_fields.values()), name
        assert ALGO.validate_python({"name": name, **NEEDS.get(name, {})}).loss_agg == spec.loss_agg
    entries = algorithm_entries()
    assert {e["name"] for e in entries} == BUILT_IN
    assert all(e["description"] == get_spec(e["name"]).description for e in entries)


def test_the_recipe_vocabulary_is_what_the_registry_holds():
    # the recipe's choices of aggregation and KL estimator are the registered names, no more, no fewer
    assert sorted(typing.get_args(LossAgg)) == registry.names("loss_agg")
    assert sorted(typing.get_args(KLConfig.model_fields["estimator"].annotation)) == registry.names("kl")


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_each_algorithm_runs_estimator_loss_and_aggregation_without_nan(name):
    cfg = ALGO.validate_python({"name": name, **NEEDS.get(name, {})})
    spec, gen = cfg.spec, torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
    logp_old = -torch.rand(4, 3, generator=gen, dtype=torch.float64)
    logp_rollout = logp_old - 0.01
    batch = AdvantageBatch(torch.tensor([1.0, 0.0, 1.0, 0.0]), [0, 0, 1, 1], mask,
                           kl=torch.rand(4, 3, generator=gen, dtype=torch.float64),
                           values=torch.rand(4, 3, generator=gen, dtype=torch.float64), logp=logp_old,
                           logp_teacher=logp_old - 0.2)
    adv = registry.get_estimator(spec.advantage_estimator)(batch, **cfg.estimator_kwargs()).advantages
    kept = mask
    if spec.token_selection:
        select = registry.get_token_selection(spec.token_selection)
        kept = mask * select(logp_old, logp_rollout, mask, **cfg.selection_kwargs())
    logp = (logp_old + 0.01).requires_grad_(True)
    out = registry.get_loss(spec.policy_loss)(logp, logp_old, adv, mask=mask, logp_rollout=logp_rollout,
                                              **cfg.loss_kwargs())
    loss = registry.get_loss_aggregator(cfg.loss_agg)(out.loss, kept)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


@pytest.mark.parametrize(
    "recipe, message",
    [
        ({"name": "ppo"}, "needs a critic"),
        ({"name": "opd"}, "needs a teacher"),
        ({"name": "grpo", "kl": {"coef": 0.1, "placement": "reward"}}, "KL as a loss term only"),
        ({"name": "reinforce_pp", "kl": {"coef": 0.1, "placement": "loss"}}, "placement: reward"),
        ({"name": "sapo", "eps_low": 0.2}, "Extra inputs"),
        ({"name": "gspo", "eps_low": -1.0}, "greater than 0"),
        ({"name": "m2po", "m2_threshold": 0.0}, "greater than 0"),
        ({"name": "grpoo"}, "unknown algorithm 'grpoo'; valid names: cispo, dapo"),
    ],
)
def test_invalid_algorithm_configs_are_rejected(recipe, message):
    with pytest.raises(ValidationError, match=message):
        ALGO.validate_python(recipe)


def test_defaults_follow_the_papers():
    assert ALGO.validate_python({}).name == "grpo"
    dapo = ALGO.validate_python({"name": "dapo"})
    assert (dapo.eps_low, dapo.eps_high, dapo.loss_agg) == (0.2, 0.28, "token-mean")
    assert ALGO.validate_python({"name": "gspo"}).loss_kwargs() == {"eps_low": 3e-4, "eps_high": 4e-4,
                                                                    "dual_clip_c": None}
    assert ALGO.validate_python({"name": "sapo"}).loss_kwargs() == {"tau_pos": 1.0, "tau_neg": 1.05}
    m2po = ALGO.validate_python({"name": "m2po"})
    assert m2po.selection_kwargs() == {"m2_threshold": 0.04} and "m2_threshold" not in m2po.loss_kwargs()
    aggs = {name: ALGO.validate_python({"name": name}).loss_agg for name in ("dr_grpo", "gspo", "sapo", "rloo")}
    assert aggs == {"dr_grpo": "seq-mean-token-sum-norm", "gspo": "seq-mean-token-mean",
                    "sapo": "seq-mean-token-mean", "rloo": "token-mean"}
    assert ALGO.validate_python({"name": "dr_grpo", "loss_agg": "token-mean"}).loss_agg == "token-mean"
    rpp = ALGO.validate_python({"name": "reinforce_pp"})
    assert rpp.uses_reference and rpp.kl_loss_coef == 0.0 and rpp.estimator_kwargs()["kl_coef"] == 0.001
    assert not ALGO.validate_python({"name": "grpo"}).uses_reference


def test_recipe_level_checks_mode_group_size_and_overlong_window(monkeypatch):
    import dataclasses

    from relax_core.config import algorithm_specs as specs

    ppo = ALGO.validate_python({"name": "ppo", "critic": {}})
    for mode in ("colocate", "hybrid", "fully_async"):  # in every mode the critic trains in the trainer ranks
        assert algorithm_problems(ppo, mode=mode, group_size=1, max_new_tokens=64) == []
    monkeypatch.setitem(specs._SPECS, "ppo", dataclasses.replace(get_spec("ppo"), modes=("colocate", "hybrid")))
    assert "supports modes colocate, hybrid" in algorithm_problems(ppo, mode="fully_async", group_size=1,
                                                                   max_new_tokens=64)[0]
    assert "at least 2" in spec_problems("grpo", mode="colocate", group_size=1)[0]
    assert ALGO.validate_python({"name": "dapo"}).overlong.cache_len(64) == 16  # default: a quarter of L_max
    assert algorithm_problems(ALGO.validate_python({"name": "dapo"}), mode="colocate", group_size=4,
                              max_new_tokens=2) == []
    dapo = ALGO.validate_python({"name": "dapo", "overlong": {"buffer_len": 128}})
    assert "exceeds rollout.max_new_tokens" in algorithm_problems(dapo, mode="colocate", group_size=4,
                                                                  max_new_tokens=64)[0]


def test_a_spec_that_contradicts_itself_is_refused():
    with pytest.raises(ValueError, match="outcome_only excludes a token selection"):
        AlgorithmSpec("bad", "grpo", "ppo_clip", "token-mean", "bad", outcome_only=True, token_selection="m2")
    with pytest.raises(ValueError, match="unknown modes"):
        AlgorithmSpec("bad", "grpo", "ppo_clip", "token-mean", "bad", modes=("async",))


@pytest.mark.parametrize("name", sorted(BUILT_IN - {"ppo"}))
def test_fully_async_computes_outcome_only_advantages_on_the_rollout_side(name):
    from relax_core.config.loader import load_recipe
    from relax_core.data.sample import Sample
    from relax_core.services.launch import advantage_stage

    extra = [f"algorithm.teacher.path={'teacher-model'}"] if name == "opd" else []
    recipe = load_recipe("recipes/quickstart.yaml", ["mode=fully_async", f"algorithm.name={name}", *extra])
    stage = advantage_stage(recipe)
    if not get_spec(name).outcome_only:
        assert stage is None  # the trainer computes them (log-probs, KL, whitening or a token selection)
        return
    rewards, groups = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0], ["a", "a", "a", "a", "b", "b"]
    samples = [Sample([1], [2], [-1.0], reward=r, group_id=g) for r, g in zip(rewards, groups)]
    # group a = {1, 0, 0, 1}: mean 0.5, unbiased std sqrt(1/3); group b is all equal -> 0
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = {"dr_grpo": [0.5, -0.5, -0.5, 0.5, 0, 0], "rloo": [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0]}
    close(torch.tensor(stage(samples)), expected.get(name, [a, -a, -a, a, 0, 0]), tol=1e-5)


def test_specs_configs_and_listing_import_without_torch():
    code = (
        "import sys, relax_core.config, relax_core.config.algorithm_specs, relax_core.algorithms.dapo, "
        "relax_core.catalog as c; c.algorithm_entries(); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
