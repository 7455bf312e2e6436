"""Log-probs from an output layer split by vocabulary over tensor-parallel ranks (train/loss_head.VocabParallelHead),
on two gloo ranks, against the plain float32 log-softmax of the whole (unpadded) vocabulary's logits."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_exit import leave_group

from relax_core.train.loss_head import vocab_parallel_logprobs

PADDED, TOKENS, HIDDEN = 40, 23, 8  # 2 ranks of 20 vocabulary rows


def whole(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64).float()
    weight = torch.randn(PADDED, HIDDEN, generator=g, dtype=torch.float64).float() * 1.5
    weight[vocab:] = hidden.mean(0) * 40  # padding rows with large logits: they must not count
    targets = torch.randint(0, vocab, (TOKENS,), generator=g)
    weights = torch.randn(TOKENS, generator=g)
    weights[5:11] = 0.0  # chunks whose gradient is zero
    return hidden, weight, targets, weights


def _rank(rank: int, world: int, port: int, out: str, chunk: int, vocab: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        hidden, weight, targets, weights = whole(vocab)
        width = PADDED // world
        hidden = hidden.requires_grad_(True)
        mine = weight[rank * width:(rank + 1) * width].clone().requires_grad_(True)
        logp, entropy = vocab_parallel_logprobs(hidden, mine, targets, vocab_start=rank * width, vocab_end=vocab,
                                                group=dist.group.WORLD, with_entropy=True, chunk=chunk)
        (logp * weights).sum().backward()
        torch.save({"logp": logp.detach(), "entropy": entropy, "grad": mine.grad, "hidden_grad": hidden.grad},
                   f"{out}/rank{rank}.pt")
    finally:
        leave_group()


def run(tmp_path, chunk: int, vocab: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, str(tmp_path), chunk, vocab), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("vocab", [37, 15], ids=["padding-on-the-last-rank", "a-rank-of-padding-only"])
def test_split_logprobs_entropy_and_gradients_equal_the_whole_vocabularys(tmp_path, vocab):
    hidden, weight, targets, weights = whole(vocab)
    hidden, full = hidden.requires_grad_(True), weight[:vocab].clone().requires_grad_(True)
    logp_all = torch.log_softmax(hidden @ full.T, dim=-1)
    want = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (want * weights).sum().backward()
    want_entropy = -(logp_all.exp() * logp_all).sum(-1)
    for chunk in (4, 64):
        ranks = run(tmp_path, chunk, vocab)
        for r in ranks:  # every rank ends with every token's numbers
            torch.testing.assert_close(r["logp"], want.detach(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(r["entropy"], want_entropy.detach(), rtol=1e-6, atol=1e-6)
        grad = torch.cat([r["grad"] for r in ranks])
        torch.testing.assert_close(grad[:vocab], full.grad, rtol=1e-6, atol=1e-6)
        assert not grad[vocab:].any()  # the padding rows learn nothing
        # each rank's part of the hidden states' gradient; megatron sums them over the group (two partial
        # products added: float32 rounding of another summation order)
        torch.testing.assert_close(ranks[0]["hidden_grad"] + ranks[1]["hidden_grad"], hidden.grad, rtol=1e-5,
                                   atol=1e-5)
