"""Model and tokenizer directories that tests of `model.tokenizer` / `model.trust_remote_code` build locally.

- `custom_code_model`: a tiny Qwen3 whose config names its own code (`auto_map`), as some hub
  models do, so transformers loads it only with `trust_remote_code=True`;
- `other_tokenizer`: the tiny model's vocabulary with another chat template (`OTHER_TEMPLATE`),
  so a test can tell which tokenizer encoded a prompt;
- `echo_judge_model`: a tiny Qwen3 that repeats the last character of its prompt, so a judge
  prompt ending in a digit gets that digit back, once per new token (a judge whose replies a test knows).
"""

from __future__ import annotations

import json
from pathlib import Path

from relax_core.models import tiny

ALPHABET = "abcd"
# A chat template unlike the tiny model's own: no roles, no newlines.
OTHER_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['content'] + '<|im_end|>' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>' }}{% endif %}")
MODEL_CODE = '''"""A model that loads only with trust_remote_code: Qwen3 under a name transformers does not know."""
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model


class RelaxCustomConfig(Qwen3Config):
    model_type = "relax_custom_qwen3"


class RelaxCustomModel(Qwen3Model):
    config_class = RelaxCustomConfig


class RelaxCustomForCausalLM(Qwen3ForCausalLM):
    config_class = RelaxCustomConfig
'''


def custom_code_model(folder: Path) -> Path:
    tiny.materialize_tiny_model(folder, alphabet=ALPHABET)
    (folder / "custom_tiny.py").write_text(MODEL_CODE)
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "relax_custom_qwen3", "architectures": ["RelaxCustomForCausalLM"],
               "auto_map": {"AutoConfig": "custom_tiny.RelaxCustomConfig", "AutoModel": "custom_tiny.RelaxCustomModel",
                            "AutoModelForCausalLM": "custom_tiny.RelaxCustomForCausalLM"}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def other_tokenizer(folder: Path) -> Path:
    tokenizer = tiny.build_char_tokenizer(ALPHABET)
    tokenizer.chat_template = OTHER_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def echo_judge_model(folder: Path) -> Path:
    """One-hot token embeddings, attention and MLP outputs zeroed, the output layer the identity: the last
    hidden state is (a multiple of) the current token's one-hot vector, so greedy decoding repeats it."""
    import torch
    from transformers import AutoModelForCausalLM

    tiny.materialize_tiny_model(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    vocab, hidden = model.lm_head.weight.shape
    assert vocab <= hidden, "one-hot embeddings need hidden_size >= vocabulary size"
    with torch.no_grad():
        one_hot = torch.eye(vocab, hidden)
        model.model.embed_tokens.weight.copy_(one_hot)
        model.lm_head.weight.copy_(one_hot)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(folder)
    return folder


def tiny_qwen3_moe(folder: Path, *, seed: int = 0, experts: int = 4, top_k: int = 2, tied: bool = False) -> Path:
    """A random-weight Qwen3-MoE (every layer sparse, `experts` experts, top-`top_k` routing) and the tiny
    char tokenizer, for the Megatron backend's expert-parallel tests."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = tiny.build_char_tokenizer(ALPHABET)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                            num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512,
                            tie_word_embeddings=tied, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, bos_token_id=None, output_router_logits=False)
    tiny._write_model(folder, lambda: Qwen3MoeForCausalLM(config), tokenizer, seed)
    return folder
