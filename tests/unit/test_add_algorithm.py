"""Adding an algorithm takes its function and its spec: a toy algorithm defined in this test alone.

`toy_baseline` is an outcome estimator (each reward minus the mean reward of
the whole batch, groups ignored), registered with the decorator where it is
defined, and one spec names it with the ppo_clip loss. No other module is
edited, yet the real recipe loader accepts `algorithm.name: toy_baseline`,
`relax list algorithms` shows it, `fully_async` computes its advantages on the
rollout side, and TorchTrainer, configured by `trainer_config` as
`relax submit` does, trains a step with its advantages. The fixture removes
both registrations afterwards.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from relax_core.algorithms import registry
from relax_core.algorithms.estimators import AdvantageBatch, AdvantageResult
from relax_core.algorithms.registry import register_estimator
from relax_core.config import algorithm_specs as specs
from relax_core.config.algorithm_specs import AlgorithmSpec, register_algorithm
from relax_core.config.loader import load_recipe
from relax_core.data.sample import Sample
from relax_core.errors import RecipeError

QUICKSTART = "recipes/quickstart.yaml"
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0]
GROUPS = [0, 0, 0, 1, 1, 1]
LENGTHS = [2, 1, 3, 2, 2, 1]


@pytest.fixture
def toy_algorithm():
    """The whole of the toy algorithm: one decorated estimator and one spec."""
    # the built-in implementations first: a module imported during the test registers its names then,
    # and the clean-up below would take them for the test's own
    tables = {kind: set(registry.names(kind)) for kind in registry._TABLES}
    names = set(specs._SPECS)
    try:
        @register_estimator("toy_baseline")
        def toy_baseline(batch: AdvantageBatch) -> AdvantageResult:
            """`A_i = R_i - mean_j R_j` over the whole batch, on every response token."""
            centred = (batch.rewards - batch.rewards.mean()).unsqueeze(-1)
            return AdvantageResult(torch.where(batch.mask.bool(), centred, torch.zeros(())))

        register_algorithm(AlgorithmSpec("toy_baseline", "toy_baseline", "ppo_clip", "token-mean",
                                         "Toy: each reward minus the batch's mean reward",
                                         outcome_only=True, min_group_size=1))
        yield "toy_baseline"
    finally:
        for kind, table in registry._TABLES.items():
            for name in set(table) - tables[kind]:
                del table[name]
        for name in set(specs._SPECS) - names:
            del specs._SPECS[name]


def test_the_recipe_loader_accepts_it_with_the_common_parameters(toy_algorithm):
    recipe = load_recipe(QUICKSTART, [f"algorithm.name={toy_algorithm}", "algorithm.loss_agg=seq-mean-token-mean"])
    assert recipe.algorithm.name == toy_algorithm and recipe.algorithm.spec.advantage_estimator == toy_algorithm
    assert recipe.algorithm.loss_agg == "seq-mean-token-mean"
    with pytest.raises(RecipeError, match="algorithm.eps_low .*unknown key.*Valid keys here: kl, loss_agg"):
        load_recipe(QUICKSTART, [f"algorithm.name={toy_algorithm}", "algorithm.eps_low=0.1"])


def test_it_is_gone_after_the_test():
    with pytest.raises(RecipeError, match="unknown algorithm 'toy_baseline'"):
        load_recipe(QUICKSTART, ["algorithm.name=toy_baseline"])
    with pytest.raises(KeyError):
        registry.get_estimator("toy_baseline")


def test_relax_list_algorithms_shows_it(toy_algorithm):
    from relax_cli.main import app

    result = CliRunner().invoke(app, ["list", "algorithms", "--json"])
    assert result.exit_code == 0, result.output
    entry = next(e for e in json.loads(result.output) if e["name"] == toy_algorithm)
    assert entry["description"] == "Toy: each reward minus the batch's mean reward"
    assert entry["estimator"] == toy_algorithm and entry["parameters"]["loss_agg"] == "token-mean"


def samples(vocab: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for reward, group, length in zip(REWARDS, GROUPS, LENGTHS):
        ids = torch.randint(3, vocab, (4 + length,), generator=gen).tolist()
        out.append(Sample(ids[:4], ids[4:], [-1.0] * length, reward=reward, group_id=group, loss_mask=[1] * length))
    return out


def test_fully_async_computes_its_advantages_on_the_rollout_side(toy_algorithm):
    from relax_core.services.launch import advantage_stage

    stage = advantage_stage(load_recipe(QUICKSTART, ["mode=fully_async", f"algorithm.name={toy_algorithm}"]))
    mean = sum(REWARDS) / len(REWARDS)  # 2.5 / 6
    assert stage(samples(10)) == pytest.approx([r - mean for r in REWARDS], abs=1e-6)


def test_the_trainer_takes_a_step_with_its_advantages(toy_algorithm, tmp_path, one_torch_thread):
    from relax_core.models.tiny import materialize_tiny_model
    from relax_core.train.settings import trainer_config
    from relax_core.train.torch_backend import TorchTrainer

    recipe = load_recipe(QUICKSTART, [f"algorithm.name={toy_algorithm}"])
    model_dir = materialize_tiny_model(tmp_path / "model", seed=0, alphabet="abcd")
    trainer = TorchTrainer(model_dir, trainer_config(recipe))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    batch = samples(trainer.model.config.vocab_size)
    metrics = trainer.train_step(batch)
    # One on-policy update: ratio 1, nothing clipped, so the token-mean loss is -sum_i A_i len_i / sum_i len_i
    # with A_i = R_i - 2.5/6 (GRPO's group-normalised advantages would give another value).
    mean = sum(REWARDS) / len(REWARDS)
    expected = -sum((r - mean) * n for r, n in zip(REWARDS, LENGTHS)) / sum(LENGTHS)
    assert metrics["pg_loss"] == pytest.approx(expected, abs=1e-6)
    assert any(not torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before))
