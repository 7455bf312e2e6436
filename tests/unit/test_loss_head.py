"""The chunked loss head gives the plain computation's log-probs, entropy and gradients (float32, 1e-6).

The plain computation is written out here as the textbook formula (full logits, float32
log-softmax, gather), not taken from the code under test.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from relax_core.data.sample import Sample
from relax_core.models.tiny import tiny_qwen3_config
from relax_core.train import loss_head
from relax_core.train.batching import forward_logprobs, pack
from relax_core.train.loss_head import FUSED, ChunkedLogprob

VOCAB = 97
ATOL = RTOL = 1e-6  # float32 rounds a log-prob of -10 to about 1e-6: a tolerance of both kinds


def plain(hidden, weight, bias, targets):
    logp_all = torch.log_softmax(F.linear(hidden, weight, bias).float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 7, 50])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunks_give_the_full_log_softmax_and_its_gradients(chunk, with_bias):
    torch.manual_seed(0)
    n, hidden_size = 7, 16
    hidden = torch.randn(n, hidden_size, requires_grad=True)
    weight = torch.randn(VOCAB, hidden_size, requires_grad=True)
    bias = torch.randn(VOCAB, requires_grad=True) if with_bias else None
    targets = torch.randint(0, VOCAB, (n,))
    upstream = torch.randn(n)

    logp, entropy = ChunkedLogprob.apply(hidden, weight, bias, targets, chunk, True)
    grads = torch.autograd.grad((logp * upstream).sum(), [t for t in (hidden, weight, bias) if t is not None])
    want_logp, want_entropy = plain(hidden, weight, bias, targets)
    want = torch.autograd.grad((want_logp * upstream).sum(), [t for t in (hidden, weight, bias) if t is not None])

    torch.testing.assert_close(logp, want_logp, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(entropy, want_entropy.detach(), atol=ATOL, rtol=RTOL)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    assert not entropy.requires_grad


def test_tokens_with_no_gradient_are_skipped_and_still_give_zero_gradients():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    logp, _ = ChunkedLogprob.apply(hidden, weight, None, torch.tensor([1, 2, 3, 4]), 2, False)
    (logp * 0.0).sum().backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_a_chunk_holds_a_bounded_number_of_tokens():
    assert loss_head.chunk_tokens(151_936) == 441  # 256 MiB of float32 logits at Qwen3's vocabulary
    assert loss_head.chunk_tokens(10**12) == 1


def tiny_model(seed=0):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_qwen3_config(VOCAB, hidden_size=32, num_heads=2, num_kv_heads=1)).eval()


def batch(packed):
    samples = [
        Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11, 12], rollout_logprobs=[0.0] * 5, loss_mask=[1] * 5),
        Sample(prompt_ids=[13], response_ids=[14, 15], rollout_logprobs=[0.0] * 2, loss_mask=[1, 0]),
        Sample(prompt_ids=[16, 17, 18, 19], response_ids=[20], rollout_logprobs=[0.0], loss_mask=[1]),
    ]
    return pack(samples, pad_id=0, packed=packed)


def plain_forward(model, mb):
    """Full logits of the model, the rows that predict each response token, log-softmax in float32."""
    inputs = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask, "position_ids": mb.position_ids}
    logits = model(**inputs, use_cache=False).logits.float()
    rows = logits[0][mb.logit_index] if mb.packed else logits[torch.arange(len(mb.valid)).unsqueeze(-1), mb.logit_index]
    logp_all = torch.log_softmax(rows, dim=-1)
    logp = logp_all.gather(-1, mb.response_ids.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("packed", [False, True])
def test_a_causal_lm_trains_on_the_chunked_head_as_on_its_logits(packed, monkeypatch):
    monkeypatch.setattr(loss_head, "CHUNK_BYTES", 2 * 4 * VOCAB)  # two tokens a chunk: 8 response tokens, 4 chunks
    model, reference = tiny_model(), tiny_model()
    mb = batch(packed)
    upstream = torch.randn(mb.valid.shape) * mb.valid

    logp, entropy = forward_logprobs(model, mb, with_entropy=True)
    (logp * upstream).sum().backward()
    want_logp, want_entropy = plain_forward(reference, mb)
    (want_logp * upstream).sum().backward()

    assert getattr(model, FUSED) is True
    torch.testing.assert_close(logp[mb.valid], want_logp[mb.valid], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(entropy[mb.valid], want_entropy[mb.valid].detach(), atol=ATOL, rtol=RTOL)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=RTOL, msg=name)
    assert not hasattr(model.lm_head, "forward") or "forward" not in vars(model.lm_head)  # the head is put back


def test_a_model_that_changes_its_logits_is_run_the_plain_way():
    """A soft-cap after the output layer (as Gemma 2 and 3 have) must reach the log-probs."""
    from transformers import Qwen3ForCausalLM

    class SoftCapped(Qwen3ForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = 3.0 * torch.tanh(out.logits / 3.0)
            return out

    torch.manual_seed(0)
    model = SoftCapped(tiny_qwen3_config(VOCAB, hidden_size=32, num_heads=2, num_kv_heads=1)).eval()
    mb = batch(packed=False)
    logp, _ = forward_logprobs(model, mb)
    assert getattr(model, FUSED) is False
    with torch.no_grad():
        inputs = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask, "position_ids": mb.position_ids}
        capped = model(**inputs, use_cache=False).logits
    want = torch.log_softmax(capped[torch.arange(3).unsqueeze(-1), mb.logit_index].float(), -1)
    want = want.gather(-1, mb.response_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp[mb.valid], want[mb.valid], atol=ATOL, rtol=RTOL)
    assert logp.max() <= 0 and want.min() > -2 * 3.0 - 5  # the cap bounds the logits: log-probs stay near


def test_bf16_autocast_gives_the_logits_the_model_computes():
    """Under autocast (the unsharded trainer's bf16), the head computes in bf16 as the model's own would."""
    model, reference = tiny_model(), tiny_model()
    mb = batch(packed=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = forward_logprobs(model, mb)
        want, _ = plain_forward(reference, mb)
    logp.sum().backward()
    torch.testing.assert_close(logp[mb.valid], want[mb.valid], atol=0, rtol=0)
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.dtype == torch.float32
