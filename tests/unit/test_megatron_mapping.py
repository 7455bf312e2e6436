"""The HF <-> Megatron weight layout rules, on hand-made tensors (no megatron-core, no processes).

What a conversion bug looks like to a user: a model that loads without error and talks nonsense. These
pin the layouts down: Megatron's fused QKV interleaves each key/value group's query heads with its key
and value head; `linear_fc1` is `[gate; up]` and a TP rank holds `[gate_r; up_r]`; a distributed
checkpoint stacks layers (and experts) under one key and names the norms as Transformer Engine does.
"""

from __future__ import annotations

import pytest
import torch

from relax_core.train.megatron import hf_weights as hw
from relax_core.train.megatron.model import Parallel, padded_vocab, unsupported

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 2, "hidden_size": 3, "vocab_size": 5, "num_hidden_layers": 2, "intermediate_size": 4,
          "tie_word_embeddings": False}


def test_fused_qkv_holds_each_groups_queries_then_its_key_then_its_value():
    dims = hw.Dims.of(CONFIG)
    q = torch.arange(8 * 3).reshape(8, 3).float()  # 4 heads x 2 dims
    k = 100 + torch.arange(4 * 3).reshape(4, 3).float()  # 2 groups x 2 dims
    v = 200 + torch.arange(4 * 3).reshape(4, 3).float()
    e = hw.entry("decoder.layers.0.self_attention.linear_qkv.weight")
    fused = hw.join_global(e, [q, k, v], dims, 0)
    # group 0: query heads 0-1 (q rows 0-3), key head 0 (k rows 0-1), value head 0; then group 1
    expected = torch.cat([q[0:4], k[0:2], v[0:2], q[4:8], k[2:4], v[2:4]])
    assert torch.equal(fused, expected)
    assert all(torch.equal(a, b) for a, b in zip(hw.split_global(e, fused, dims), (q, k, v)))
    # TP=2: rank r holds whole groups, i.e. rows of the fused tensor
    assert torch.equal(hw.local_slice(e, fused, 1, 2), torch.cat([q[4:8], k[2:4], v[2:4]]))


def test_a_tp_rank_holds_its_slice_of_gate_and_of_up():
    e = hw.entry("decoder.layers.1.mlp.linear_fc1.weight")
    gate, up = torch.zeros(4, 3), torch.ones(4, 3)
    gate[2:] = 2
    up[2:] = 3
    full = hw.join_global(e, [gate, up], hw.Dims.of(CONFIG), 0)
    parts = [hw.local_slice(e, full, r, 2) for r in range(2)]
    assert torch.equal(parts[1], torch.cat([gate[2:], up[2:]]))
    assert torch.equal(hw.join_slices(e, parts), full)


@pytest.mark.parametrize("name", ["decoder.layers.0.self_attention.linear_proj.weight",
                                  "embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight"])
def test_every_rank_slice_joins_back(name):
    e = hw.entry(name)
    full = torch.randn(8, 6)
    assert torch.equal(hw.join_slices(e, [hw.local_slice(e, full, r, 2) for r in range(2)]), full)


def test_the_vocabulary_is_padded_as_megatron_lm_pads_it_and_cut_back():
    assert padded_vocab(5, 1) == 128 and padded_vocab(129, 2) == 256 and padded_vocab(151_936, 4) == 152_064
    e = hw.entry("output_layer.weight")
    table = torch.randn(5, 3)
    padded = hw.join_global(e, [table], hw.Dims.of(CONFIG), 128)
    assert padded.shape == (128, 3) and not padded[5:].any()
    assert hw.global_to_hf("output_layer.weight", padded, CONFIG)[0][1].equal(table)
    assert hw.global_to_hf("output_layer.weight", padded, CONFIG | {"tie_word_embeddings": True}) == []


def test_a_checkpoints_stacked_keys_become_each_layers_and_experts_hf_tensors():
    norms = torch.randn(2, 3)
    out = dict(hw.checkpoint_to_hf("decoder.layers.self_attention.linear_qkv.layer_norm_weight", norms, CONFIG))
    assert out.keys() == {"model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"}
    assert out["model.layers.1.input_layernorm.weight"].equal(norms[1])
    pre_mlp = dict(hw.checkpoint_to_hf("decoder.layers.mlp.linear_fc1.layer_norm_weight", norms, CONFIG))
    assert "model.layers.0.post_attention_layernorm.weight" in pre_mlp
    experts = torch.randn(2, 3, 8, 3)  # layers x experts x [gate; up] x hidden
    moe = dict(hw.checkpoint_to_hf("decoder.layers.mlp.experts.experts.linear_fc1.weight", experts, CONFIG))
    assert len(moe) == 2 * 3 * 2
    assert moe["model.layers.1.mlp.experts.2.up_proj.weight"].equal(experts[1, 2, 4:])
    assert hw.checkpoint_to_hf("decoder.layers.self_attention.linear_proj._extra_state", torch.zeros(2, 1),
                               CONFIG) == []


def test_per_expert_tensors_fuse_into_transformers_5s_parameters():
    config = {"num_experts": 2}
    named = [(f"model.layers.0.mlp.experts.{e}.{kind}.weight", torch.full((2, 3), 10.0 * e + i))
             for e in range(2) for i, kind in enumerate(("gate_proj", "up_proj", "down_proj"))]
    fused = dict(hw.transformers_named(config)(iter([("model.norm.weight", torch.ones(3))] + named)))
    assert fused.keys() == {"model.norm.weight", "model.layers.0.mlp.experts.gate_up_proj",
                            "model.layers.0.mlp.experts.down_proj"}
    gate_up = fused["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (2, 4, 3) and gate_up[1, :2].eq(10).all() and gate_up[1, 2:].eq(11).all()
    assert hw.transformers_named({"num_experts": 0}) is None


@pytest.mark.parametrize(("change", "par", "words"), [
    ({}, Parallel(tp=4), "train.tensor_parallel: 4 must divide the model's 4 attention heads and 2 key/value"),
    ({}, Parallel(pp=3), "train.pipeline_parallel: 3 must divide the model's 2 layers"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, Parallel(), "LlamaForCausalLM"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "mlp_only_layers": [1]}, Parallel(),
     "mlp_only_layers"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4}, Parallel(ep=3), "expert_parallel: 3"),
    ({}, Parallel(ep=2), "needs a mixture-of-experts model"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, Parallel(), "rope scaling"),
])
def test_what_the_megatron_backend_cannot_build_is_named(change, par, words):
    problems = unsupported(CONFIG | change, par)
    assert any(words in p for p in problems), problems
    assert not unsupported(CONFIG, Parallel(tp=2, pp=2))
