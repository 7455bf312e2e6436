"""Packed rows attended one sample at a time (relax_core/train/varlen.py), against transformers' own SDPA."""

from __future__ import annotations

import torch
from transformers import Qwen3ForCausalLM

from relax_core.data.sample import Sample
from relax_core.models.tiny import tiny_qwen3_config
from relax_core.train.batching import forward_logprobs, pack
from relax_core.train.varlen import NAME, use_varlen

LENGTHS = (7, 30, 2, 11)


def model(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_qwen3_config(300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                               max_position_embeddings=512)
    for key, value in overrides.items():
        setattr(config, key, value)
    return Qwen3ForCausalLM(config).eval()


def samples() -> list[Sample]:
    return [Sample(prompt_ids=[1, 2, 3], response_ids=[(7 * i + j) % 290 + 5 for j in range(n)],
                    rollout_logprobs=[0.0] * n, loss_mask=[1] * n) for i, n in enumerate(LENGTHS)]


class KeyLengths:
    """The key length of every SDPA call while inside."""

    def __init__(self, monkeypatch):
        self.seen: list[int] = []
        real = torch.nn.functional.scaled_dot_product_attention

        def spy(query, key, value, *args, **kwargs):
            self.seen.append(key.shape[-2])
            return real(query, key, value, *args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)


def test_a_packed_row_is_attended_one_sample_at_a_time(monkeypatch):
    m = model()
    assert use_varlen(m) and m.config._attn_implementation == NAME
    keys = KeyLengths(monkeypatch)
    mb = pack(samples(), packed=True)
    m(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False)
    each = [3 + n for n in LENGTHS]
    assert keys.seen == each * m.config.num_hidden_layers  # never the row's 62 tokens at once


def test_packed_logprobs_and_gradients_equal_the_padded_batch_under_sdpa():
    padded_model, packed_model = model(), model()
    assert use_varlen(packed_model)
    assert padded_model.config._attn_implementation == "sdpa"
    batch = samples()

    def run(m, mb):
        logp, _ = forward_logprobs(m, mb)
        (logp * mb.valid).sum().backward()
        return logp[mb.valid].detach(), {n: p.grad for n, p in m.named_parameters()}

    want, want_grads = run(padded_model, pack(batch, packed=False))
    got, got_grads = run(packed_model, pack(batch, packed=True))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_padded_batches_and_generation_run_as_under_sdpa():
    plain, varlen = model(), model()
    assert use_varlen(varlen)
    mb = pack(samples(), packed=False)
    inputs = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask}
    assert torch.equal(plain(**inputs).logits, varlen(**inputs).logits)
    prompt = torch.tensor([[4, 9, 17, 3, 8]])
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(plain.generate(prompt, **kwargs), varlen.generate(prompt, **kwargs))


def test_a_model_with_sliding_windows_keeps_sdpa():
    m = model(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "sliding_attention"])
    assert not use_varlen(m)
    assert m.config._attn_implementation == "sdpa"
