"""TorchTrainer on a real tiny Qwen3 model, in one process and over 2 gloo ranks.

What a user relies on: the update does not depend on how a step's batch is
split into micro-batches or data-parallel ranks; the gradient is the GRPO
policy gradient (checked against an independent computation with the plain
HF model); log-probs are right despite padding; the state round-trips; the
names handed to weight sync are the checkpoint's names.
"""

from __future__ import annotations

import copy
import math
import socket
import statistics
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_exit import leave_group

from relax_core.data.sample import Sample
from relax_core.train.batching import shard
from relax_core.train.config import TorchTrainerConfig
from relax_core.train.optim import lr_lambda
from relax_core.train.torch_backend import TorchTrainer

TOL = 1e-6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from relax_core.models.tiny import materialize_tiny_model

    return materialize_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model", seed=3, alphabet="abcdefgh"
    )


def make_samples(vocab: int = 19) -> list[Sample]:
    """8 samples in groups of sizes 3, 3, 2 (group 1 spans the 2-rank split), one empty response."""
    g = torch.Generator().manual_seed(0)
    prompt_lens = [5, 3, 7, 4, 6, 2, 5, 3]
    response_lens = [3, 1, 4, 2, 0, 5, 2, 3]
    rewards = [1.0, 0.0, 0.5, 0.2, 0.9, 0.4, 1.0, 0.0]
    groups = [0, 0, 0, 1, 1, 1, 2, 2]
    samples = []
    for p, r, reward, group in zip(prompt_lens, response_lens, rewards, groups):
        ids = torch.randint(3, vocab, (p + r,), generator=g).tolist()
        mask = [
            0 if (group == 2 and j == 1) else 1 for j in range(r)
        ]  # one "tool" token
        samples.append(
            Sample(
                ids[:p],
                ids[p:],
                [-1.0] * r,
                reward=reward,
                group_id=group,
                loss_mask=mask,
            )
        )
    return samples


def hand_advantages(samples: list[Sample]) -> list[float]:
    """GRPO advantages via the statistics module (unbiased stdev)."""
    by_group: dict[int, list[float]] = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s.reward)
    out = []
    for s in samples:
        rs = by_group[s.group_id]
        out.append((s.reward - statistics.mean(rs)) / (statistics.stdev(rs) + 1e-6))
    return out


def reference_gradient(
    model_dir: Path, samples: list[Sample]
) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradient of the first PPO step, computed without the trainer.

    At the first update the ratio is exactly 1 (nothing is clipped), so the
    token-mean PPO loss is `-sum_i A_i sum_t m_it / N` and its gradient is that
    of `-sum_i A_i sum_t m_it logp_it / N`, N = all learned tokens. Each
    sequence runs alone, unpadded.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    adv = hand_advantages(samples)
    total = sum(sum(s.loss_mask) for s in samples)
    objective, value = torch.zeros(()), 0.0
    for s, a in zip(samples, adv):
        if not s.response_ids:
            continue
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logp_all = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        logp = logp_all.gather(-1, ids[0, 1:, None]).squeeze(-1)[
            len(s.prompt_ids) - 1 :
        ]
        mask = torch.tensor(s.loss_mask, dtype=torch.float32)
        objective = objective - a * (logp * mask).sum() / total
        value -= a * sum(s.loss_mask) / total
    objective.backward()
    return value, {n: p.grad.clone() for n, p in model.named_parameters()}


def trainer_grads(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def assert_same_grads(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = TOL
) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=tol, rtol=0), (
            name,
            (a[name] - b[name]).abs().max(),
        )


def config(**kw) -> TorchTrainerConfig:
    return TorchTrainerConfig(**{"lr": 1e-3, "grad_clip": 0.0, **kw})


@pytest.mark.parametrize("micro_batch_size", [8, 4, 2])  # 1, 2 and 4 micro-batches
def test_token_mean_loss_and_gradient_do_not_depend_on_micro_batching(
    model_dir, micro_batch_size
):
    samples = make_samples()
    value, expected = reference_gradient(model_dir, samples)
    trainer = TorchTrainer(model_dir, config(micro_batch_size=micro_batch_size))
    metrics = trainer.train_step(samples)
    assert metrics["loss"] == pytest.approx(value, abs=TOL)
    assert metrics["clipfrac"] == 0.0
    assert metrics["num_tokens"] == sum(sum(s.loss_mask) for s in samples)
    assert_same_grads(trainer_grads(trainer), expected)


@pytest.mark.parametrize(
    "loss_agg", ["seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_other_aggregations_are_split_invariant_too(model_dir, loss_agg):
    samples = make_samples()
    results = []
    for mbs in (8, 2):
        trainer = TorchTrainer(
            model_dir, config(micro_batch_size=mbs, loss_agg=loss_agg)
        )
        results.append((trainer.train_step(samples)["loss"], trainer_grads(trainer)))
    assert results[0][0] == pytest.approx(results[1][0], abs=TOL)
    assert_same_grads(results[0][1], results[1][1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dp_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """One data-parallel rank: step 1 on its shard of 8 samples, step 2 with rank 1 empty-handed."""
    import os

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        samples = make_samples()
        trainer = TorchTrainer(model_dir, config(micro_batch_size=2))
        m1 = trainer.train_step(shard(samples, rank, world))
        g1 = trainer_grads(trainer)
        m2 = trainer.train_step(samples[:2] if rank == 0 else [])
        g2 = trainer_grads(trainer)
        params = dict(trainer.named_parameters_for_sync())
        torch.save(
            {"m1": m1, "g1": g1, "m2": m2, "g2": g2, "params": params},
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        leave_group()


def test_two_gloo_ranks_match_one_process(model_dir, tmp_path):
    samples = make_samples()
    value, expected = reference_gradient(model_dir, samples)
    single = TorchTrainer(model_dir, config(micro_batch_size=8))
    single.train_step(samples)
    single.train_step(samples[:2])
    mp.spawn(
        _dp_worker,
        args=(2, _free_port(), str(model_dir), str(tmp_path)),
        nprocs=2,
        join=True,
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for result in ranks:
        assert result["m1"]["loss"] == pytest.approx(value, abs=TOL)
        assert_same_grads(result["g1"], expected)
        assert_same_grads(result["g2"], trainer_grads(single))
    # both ranks hold the same weights after the steps, equal to the single process's
    assert_same_grads(ranks[0]["params"], ranks[1]["params"], tol=0.0)
    # Adam divides by |g| per coordinate, so last-bit gradient differences (summation order)
    # can move a weight slightly more than the gradients differ.
    assert_same_grads(
        ranks[0]["params"], dict(single.named_parameters_for_sync()), tol=1e-4
    )


def test_compute_logprobs_matches_unpadded_forward(model_dir):
    from transformers import AutoModelForCausalLM

    samples = make_samples()
    got = TorchTrainer(model_dir, config(micro_batch_size=3)).compute_logprobs(samples)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for s, lp in zip(samples, got):
        assert len(lp) == s.response_len
        if not s.response_ids:
            continue
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        for j, token in enumerate(s.response_ids):
            expected = torch.log_softmax(logits[len(s.prompt_ids) + j - 1], -1)[
                token
            ].item()
            assert lp[j] == pytest.approx(expected, abs=1e-5)


def test_update_increases_the_advantage_weighted_logprob(model_dir):
    """A small step raises sum_i A_i sum_t m_it logp_it, the objective the loss descends."""
    samples = make_samples()
    adv = hand_advantages(samples)
    trainer = TorchTrainer(model_dir, config(lr=1e-4))

    def objective() -> float:
        lps = trainer.compute_logprobs(samples)
        return sum(
            a * sum(x * m for x, m in zip(lp, s.loss_mask))
            for a, lp, s in zip(adv, lps, samples)
        )

    before = objective()
    trainer.train_step(samples)
    assert objective() > before


def test_state_dict_round_trip_resumes_exactly(model_dir):
    samples = make_samples()
    a = TorchTrainer(
        model_dir, config(lr_schedule="cosine", warmup_steps=1, total_steps=4)
    )
    a.train_step(samples)
    state = copy.deepcopy(a.state_dict())  # as if saved and loaded back
    b = TorchTrainer(
        model_dir, config(lr_schedule="cosine", warmup_steps=1, total_steps=4)
    )
    b.load_state_dict(state)
    ma, mb = a.train_step(samples), b.train_step(samples)
    assert ma["lr"] == mb["lr"] and b.step == 2
    assert_same_grads(
        dict(a.named_parameters_for_sync()),
        dict(b.named_parameters_for_sync()),
        tol=0.0,
    )


def test_sync_names_are_the_checkpoint_names(model_dir):
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        on_disk = {k: f.get_tensor(k) for k in f.keys()}
    synced = dict(TorchTrainer(model_dir, config()).named_parameters_for_sync())
    assert synced.keys() == on_disk.keys()
    for name, tensor in synced.items():
        assert torch.equal(tensor, on_disk[name])


def test_lr_schedule_warmup_then_cosine_and_linear():
    cos = lr_lambda("cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    # warmup 1/2, 2/2; then progress (s-2)/4 -> 0.1 + 0.9 * 0.5 * (1 + cos(pi * progress))
    expected = [
        0.5,
        1.0,
        1.0,
        0.1 + 0.45 * (1 + math.cos(math.pi / 4)),
        0.55,
        0.1 + 0.45 * (1 - math.cos(math.pi / 4)),
    ]
    assert [cos(s) for s in range(6)] == pytest.approx(expected)
    assert cos(6) == pytest.approx(0.1) and cos(100) == pytest.approx(0.1)
    lin = lr_lambda("linear", warmup_steps=0, total_steps=4, min_lr_ratio=0.0)
    assert [lin(s) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert (
        lr_lambda("constant", warmup_steps=0, total_steps=0, min_lr_ratio=0.0)(50)
        == 1.0
    )
    with pytest.raises(ValueError, match="total_steps"):
        lr_lambda("cosine", warmup_steps=5, total_steps=5, min_lr_ratio=0.0)


def test_trainer_reports_the_scheduled_lr(model_dir):
    samples = make_samples()[:3]
    trainer = TorchTrainer(
        model_dir, config(lr=2e-3, lr_schedule="linear", warmup_steps=2, total_steps=4)
    )
    lrs = [trainer.train_step(samples)["lr"] for _ in range(4)]
    # warmup 1/2, 2/2, then linear decay over steps 2..4: 1, 0.5
    assert lrs == pytest.approx([1e-3, 2e-3, 2e-3, 1e-3])


def test_kl_loss_against_frozen_reference(model_dir):
    samples = make_samples()
    trainer = TorchTrainer(
        model_dir, config(lr=1e-2, use_kl_loss=True, kl_coef=0.5, kl_estimator="k3")
    )
    first = trainer.train_step(samples)
    assert first["kl"] == pytest.approx(
        0.0, abs=1e-7
    )  # policy == reference before the first update
    second = trainer.train_step(samples)
    assert second["kl"] > 1e-6
    assert second["loss"] == pytest.approx(
        second["pg_loss"] + 0.5 * second["kl_loss"], abs=1e-7
    )
    assert all(not p.requires_grad for p in trainer.ref_model.parameters())
    reference = dict(TorchTrainer(model_dir, config()).named_parameters_for_sync())
    for name, p in trainer.ref_model.named_parameters():
        assert torch.equal(p, reference[name])


def test_truncated_importance_sampling_weights_the_loss(model_dir):
    samples = make_samples()
    true = TorchTrainer(model_dir, config()).compute_logprobs(samples)
    # even samples: engine log-probs 1.5x less likely (w = 1.5); odd: 3x (w = min(3, 2) = 2)
    factors = [1.5 if i % 2 == 0 else 3.0 for i in range(len(samples))]
    for s, lp, f in zip(samples, true, factors):
        s.rollout_logprobs = [x - math.log(f) for x in lp]
    metrics = TorchTrainer(model_dir, config(tis_cap=2.0)).train_step(samples)
    adv = hand_advantages(samples)
    tokens = [sum(s.loss_mask) for s in samples]
    weights = [min(f, 2.0) for f in factors]
    total = sum(tokens)
    assert metrics["tis_weight"] == pytest.approx(
        sum(w * n for w, n in zip(weights, tokens)) / total, abs=1e-5
    )
    # ratio 1 at the first update: per-token loss -A w
    assert metrics["pg_loss"] == pytest.approx(
        -sum(a * w * n for a, w, n in zip(adv, weights, tokens)) / total, abs=1e-5
    )


def test_second_epoch_is_clipped_against_the_pre_update_policy(model_dir):
    """With several updates per step, logp_old is the policy before the first one."""
    samples = make_samples()
    trainer = TorchTrainer(model_dir, config(lr=5e-2, micro_batch_size=4, num_epochs=2))
    metrics = trainer.train_step(samples)
    assert (
        metrics["clipfrac"] > 0.0
    )  # the big first update pushed ratios out of [0.8, 1.2]
    one = TorchTrainer(
        model_dir, config(lr=5e-2, micro_batch_size=4, num_mini_batches=2)
    ).train_step(samples)
    assert one["num_tokens"] == sum(sum(s.loss_mask) for s in samples)
    assert metrics["num_tokens"] == one["num_tokens"]


def test_weight_decay_shrinks_weight_matrices_but_never_norms_or_biases(model_dir):
    """A step that learns nothing (every reward equal: advantages 0, no gradient) with weight decay: each
    matrix shrinks by exactly lr x wd, each norm weight stays as it was (AdamW decays only the matrices)."""
    lr, wd = 1e-2, 0.5
    trainer = TorchTrainer(model_dir, TorchTrainerConfig(lr=lr, weight_decay=wd, micro_batch_size=8))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    samples = make_samples()
    for s in samples:
        s.reward = 1.0
    trainer.train_step(samples)
    after = dict(trainer.model.named_parameters())
    norms = [n for n, p in before.items() if p.dim() == 1]
    matrices = [n for n, p in before.items() if p.dim() >= 2]
    assert norms and matrices
    for name in norms:
        assert torch.equal(after[name].detach(), before[name]), f"{name} was decayed"
    for name in matrices:
        torch.testing.assert_close(after[name].detach(), before[name] * (1 - lr * wd), rtol=0, atol=1e-7)
