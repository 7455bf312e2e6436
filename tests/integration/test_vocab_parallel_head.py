"""Log-probs from a vocabulary split over tensor-parallel ranks (train/loss_head.VocabParallelLogprob), on two
gloo ranks, against the plain float32 log-softmax of the whole (unpadded) vocabulary."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_exit import leave_group

from relax_core.train.loss_head import vocab_parallel_logprobs

PADDED, TOKENS = 40, 23  # 2 ranks of 20 columns


def whole(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(TOKENS, PADDED, generator=g, dtype=torch.float64).float() * 4
    logits[:, vocab:] = 50.0  # padding columns with large logits: they must not count
    targets = torch.randint(0, vocab, (TOKENS,), generator=g)
    weights = torch.randn(TOKENS, generator=g)
    weights[5:11] = 0.0  # chunks whose gradient is zero
    return logits, targets, weights


def _rank(rank: int, world: int, port: int, out: str, chunk: int, vocab: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        logits, targets, weights = whole(vocab)
        width = PADDED // world
        mine = logits[:, rank * width:(rank + 1) * width].clone().requires_grad_(True)
        logp, entropy = vocab_parallel_logprobs(mine, targets, vocab_start=rank * width, vocab_end=vocab,
                                                group=dist.group.WORLD, with_entropy=True, chunk=chunk)
        (logp * weights).sum().backward()
        torch.save({"logp": logp.detach(), "entropy": entropy, "grad": mine.grad}, f"{out}/rank{rank}.pt")
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
    logits, targets, weights = whole(vocab)
    full = logits[:, :vocab].clone().requires_grad_(True)
    logp_all = torch.log_softmax(full, dim=-1)
    want = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (want * weights).sum().backward()
    want_entropy = -(logp_all.exp() * logp_all).sum(-1)
    for chunk in (4, 64):
        ranks = run(tmp_path, chunk, vocab)
        for r in ranks:  # every rank ends with every token's numbers
            torch.testing.assert_close(r["logp"], want.detach(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(r["entropy"], want_entropy.detach(), rtol=1e-6, atol=1e-6)
        grad = torch.cat([r["grad"] for r in ranks], dim=-1)
        torch.testing.assert_close(grad[:, :vocab], full.grad, rtol=1e-6, atol=1e-6)
        assert not grad[:, vocab:].any()  # the padding columns learn nothing
