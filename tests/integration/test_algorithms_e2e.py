"""Every algorithm Relax runs trains on the quick start without NaN, through the recipe's own wiring.

The recipe is recipes/quickstart.yaml with `algorithm.name` switched; the
trainer's settings come from `trainer_config` (the same mapping a
`relax submit` uses), and a few steps of the quick-start loop run in one
process (the sampler of test_learning.py stands in for the engine). A user
switching `algorithm.name` relies on this: the run starts, the loss and
gradient stay finite, and the weights move.
"""

from __future__ import annotations

import math

import pytest
import torch
from gloo_exit import leave_group
from test_learning import ALPHABET, LENGTH, PROMPTS, rollout

from relax_core.config.algorithm_specs import algorithm_names
from relax_core.config.loader import load_recipe
from relax_core.data.synthetic import SyntheticTask
from relax_core.rewards.registry import get_reward
from relax_core.rollout.sampling_rounds import collect_batch
from relax_core.train.settings import trainer_config
from relax_core.train.torch_backend import TorchTrainer

STEPS = 3
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from relax_core.models.tiny import materialize_tiny_model

    return materialize_tiny_model(tmp_path_factory.mktemp("algos") / "model", seed=1, alphabet=ALPHABET)


def run_steps(model_dir, name: str, steps: int, overrides: tuple[str, ...] = ()) -> tuple[TorchTrainer, list[dict]]:
    """`steps` quick-start steps of algorithm `name`, configured from the recipe."""
    from transformers import AutoTokenizer

    recipe = load_recipe("recipes/quickstart.yaml", [f"algorithm.name={name}", *overrides])
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = TorchTrainer(model_dir, trainer_config(recipe))
    task = SyntheticTask("copy", seed=0, alphabet=ALPHABET, min_len=LENGTH, max_len=LENGTH)
    reward, gen = get_reward("copy"), torch.Generator().manual_seed(0)
    history = []
    for step in range(steps):
        raw: list[float] = []  # the task reward of round 0, before DAPO's shaping and filtering

        def generate(r: int, step=step, raw=raw):  # bound now: collect_batch calls it within this step
            samples = rollout(trainer, tokenizer, task, reward, step * 100 + r, gen)  # keys keep group ids unique
            if r == 0:
                raw.extend(s.reward for s in samples)
            return samples

        samples, stats = collect_batch(generate, recipe.algorithm, max_new_tokens=recipe.rollout.max_new_tokens,
                                       target_groups=PROMPTS)
        metrics = trainer.train_step(samples) | stats.as_metrics()
        history.append(metrics | {"task_reward_mean": sum(raw) / len(raw)})
    return trainer, history


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A different random tiny model (same tokenizer) as the distillation teacher."""
    from relax_core.models.tiny import materialize_tiny_model

    return materialize_tiny_model(tmp_path_factory.mktemp("teacher") / "model", seed=2, alphabet=ALPHABET)


def extra_overrides(name: str, teacher_dir) -> tuple[str, ...]:
    """What a recipe must add for `name` beyond the name (opd: a teacher)."""
    if name == "opd":
        return (f"algorithm.teacher.path={teacher_dir}", "algorithm.teacher.dtype=float32")
    if name == "ppo":
        return ("algorithm.critic.lr=1e-3",)
    return ()


@pytest.mark.parametrize("name", algorithm_names())
def test_every_algorithm_trains_without_nan(model_dir, teacher_dir, name):
    before = {k: v.clone() for k, v in TorchTrainer(model_dir).model.state_dict().items()}
    trainer, history = run_steps(model_dir, name, STEPS, extra_overrides(name, teacher_dir))
    for metrics in history:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, (name, bad)
    moved = max(float((v - before[k]).abs().max()) for k, v in trainer.model.state_dict().items())
    assert moved > 0, f"{name}: no parameter changed in {STEPS} steps"


def first_step(model_dir, name: str, overrides: tuple[str, ...] = (), edit=None):
    """One step of `name` on the quick-start batch (optionally edited first): (samples, metrics)."""
    from transformers import AutoTokenizer

    recipe = load_recipe("recipes/quickstart.yaml", [f"algorithm.name={name}", *overrides])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = TorchTrainer(model_dir, trainer_config(recipe))
    task = SyntheticTask("copy", seed=0, alphabet=ALPHABET, min_len=LENGTH, max_len=LENGTH)
    samples = rollout(trainer, tokenizer, task, get_reward("copy"), 0, torch.Generator().manual_seed(0))
    if edit:
        edit(samples)
    return samples, trainer.train_step(samples)


def by_group(samples) -> dict:
    groups: dict = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s.reward)
    return groups


def test_rloo_step_uses_leave_one_out_advantages(model_dir):
    # On-policy first step: ratio 1, nothing clipped, so the token-mean loss is -sum_i A_i len_i / sum_i len_i.
    samples, metrics = first_step(model_dir, "rloo")
    groups = by_group(samples)
    expected_num = 0.0
    for s in samples:
        others = list(groups[s.group_id])
        others.remove(s.reward)
        expected_num += (s.reward - sum(others) / len(others)) * s.response_len
    expected = -expected_num / sum(s.response_len for s in samples)
    assert metrics["pg_loss"] == pytest.approx(expected, abs=1e-5)
    assert any(len(set(g)) > 1 for g in groups.values())  # the batch is not trivially zero-advantage


def test_dr_grpo_step_uses_centred_advantages_and_constant_norm(model_dir):
    # seq-mean-token-sum-norm with norm_len = rollout.max_new_tokens (2): sum_i (R_i - mean_g) len_i / (N * 2).
    samples, metrics = first_step(model_dir, "dr_grpo")
    groups = by_group(samples)
    total = sum((s.reward - sum(groups[s.group_id]) / len(groups[s.group_id])) * s.response_len for s in samples)
    assert metrics["pg_loss"] == pytest.approx(-total / (len(samples) * 2), abs=1e-5)


def test_m2po_drops_the_token_whose_rollout_logprob_disagrees(model_dir):
    # One rollout log-prob off by 4 nats: M2 over all n tokens is 16/n > 0.04 until that token is dropped.
    def corrupt(samples):
        samples[0].rollout_logprobs[0] += 4.0

    samples, metrics = first_step(model_dir, "m2po", edit=corrupt)
    total = sum(s.response_len for s in samples)
    assert 16 / total > 0.04
    assert metrics["num_tokens"] == total - 1
    _, clean = first_step(model_dir, "m2po")
    assert clean["num_tokens"] == total


@torch.no_grad()
def response_logprobs_by_hand(model_path, samples) -> list[list[float]]:
    """Each sample's response-token log-probs from one plain HF forward per sample."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        p = len(s.prompt_ids)
        out.append([float(logp[p - 1 + j, tok]) for j, tok in enumerate(s.response_ids)])
    return out


def test_opd_advantage_is_the_reverse_kl_to_the_teacher(model_dir, teacher_dir):
    # First step, ratio 1: loss_t = -A_t = logp_t - logp_teacher_t; token-mean over the batch.
    samples, metrics = first_step(model_dir, "opd", extra_overrides("opd", teacher_dir))
    student = response_logprobs_by_hand(model_dir, samples)
    teacher = response_logprobs_by_hand(teacher_dir, samples)
    diffs = [s - t for rs, rt in zip(student, teacher) for s, t in zip(rs, rt)]
    assert metrics["pg_loss"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-4)
    assert abs(metrics["pg_loss"]) > 1e-3  # the teacher really differs from the student


def test_ppo_first_step_regresses_the_critic_on_gae_returns(model_dir):
    # The value head starts at 0, so V = 0 and GAE (gamma 1, lambda 0.95) gives returns
    # ret_t = 0.95^(L-1-t) R on a response of L tokens; value loss = 0.5 token-mean(ret^2).
    samples, metrics = first_step(model_dir, "ppo", ("algorithm.critic.lr=1e-3",))
    squares = [(0.95 ** (s.response_len - 1 - t) * s.reward) ** 2 for s in samples for t in range(s.response_len)]
    assert metrics["value_loss"] == pytest.approx(0.5 * sum(squares) / len(squares), rel=1e-5)
    assert metrics["value_loss"] > 0


def test_ppo_critic_survives_a_checkpoint_round_trip(model_dir, tmp_path):
    # Resume must be exact: a trainer restored from the step-1 checkpoint takes the same step 2,
    # critic included, as the one that never stopped.
    from relax_core.checkpoint import load_checkpoint, save_checkpoint

    recipe = load_recipe("recipes/quickstart.yaml", ["algorithm.name=ppo", "algorithm.critic.lr=1e-2"])
    samples, _ = first_step(model_dir, "grpo")
    torch.manual_seed(0)
    kept = TorchTrainer(model_dir, trainer_config(recipe))
    kept.train_step(samples)
    save_checkpoint(tmp_path / "ckpt", 1, kept.state_dict(), hf_dir=model_dir)
    restored = TorchTrainer(model_dir, trainer_config(recipe))
    state = restored.state_dict()
    load_checkpoint(tmp_path / "ckpt", state)
    restored.load_state_dict(state)
    a, b = kept.train_step(samples), restored.train_step(samples)
    assert a["value_loss"] == b["value_loss"] and a["loss"] == b["loss"]
    for (name, p), q in zip(kept.critic.model.named_parameters(), restored.critic.model.parameters()):
        assert torch.equal(p, q), name
    fresh = TorchTrainer(model_dir, trainer_config(recipe)).train_step(samples)
    assert fresh["value_loss"] != b["value_loss"]  # the critic state really was restored


def _ppo_rank(rank: int, world: int, port: int, model_dir: str, samples, out_dir: str) -> None:
    """One gloo rank of a PPO step on its half of the batch."""
    import os

    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        recipe = load_recipe("recipes/quickstart.yaml", ["algorithm.name=ppo", "algorithm.critic.lr=1e-2"])
        trainer = TorchTrainer(model_dir, trainer_config(recipe))
        half = len(samples) // world
        metrics = trainer.train_step(samples[rank * half:(rank + 1) * half])
        torch.save({"metrics": metrics, "critic": trainer.critic.model.state_dict()}, f"{out_dir}/rank{rank}.pt")
    finally:
        leave_group()


def test_ppo_over_two_gloo_ranks_matches_one_process(model_dir, tmp_path):
    # GAE whitening spans both ranks' tokens and the critic's gradients are summed over ranks,
    # so the split step equals the whole-batch step.
    import socket

    import torch.multiprocessing as mp

    samples, _ = first_step(model_dir, "grpo")
    samples = samples[:32]
    recipe = load_recipe("recipes/quickstart.yaml", ["algorithm.name=ppo", "algorithm.critic.lr=1e-2"])
    single = TorchTrainer(model_dir, trainer_config(recipe))
    expected = single.train_step(samples)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ppo_rank, args=(2, port, str(model_dir), samples, str(tmp_path)), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for key in ("loss", "value_loss", "grad_norm"):
            assert got["metrics"][key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
        for name, value in single.critic.model.state_dict().items():
            assert torch.allclose(got["critic"][name], value, atol=1e-6), name
