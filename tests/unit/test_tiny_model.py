"""The tiny Qwen3 directory the quick start and the tests load: written without transformers' modeling
code (numpy and safetensors), it must be what transformers itself would write.

- transformers loads it with no missing, unexpected or mismatched weight, and its config is the one
  `Qwen3Config` builds from the same sizes;
- its weights follow Qwen3's own initialisation (matrices normal(0, 0.02), the padding token's
  embedding row zero, norms one), the same seed writes the same bytes and another seed other weights;
- the driver writes it without importing torch (the point of writing it this way).
"""

from __future__ import annotations

import subprocess
import sys

import torch
from safetensors.torch import load_file

from relax_core.models import tiny


def test_transformers_loads_every_weight_and_the_config_is_qwen3configs(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tiny.materialize_tiny_model(tmp_path / "m", alphabet="abcd", hidden_size=32, num_layers=3,
                                      num_heads=4, num_kv_heads=2)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    tokenizer = tiny.build_char_tokenizer("abcd")
    expected = tiny.tiny_qwen3_config(len(tokenizer), hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                                      eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id).to_dict()
    loaded = AutoConfig.from_pretrained(out).to_dict()
    differ = {k for k in set(expected) | set(loaded) if expected.get(k) != loaded.get(k)}
    assert differ == {"architectures", "_name_or_path"}  # both set when a config is saved, not when built
    assert loaded["architectures"] == ["Qwen3ForCausalLM"]
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    logits = model(torch.tensor([[3, 4, 5]])).logits
    assert logits.shape == (1, 3, len(tokenizer)) and torch.isfinite(logits).all()


def test_weights_follow_qwen3s_initialisation_and_the_seed(tmp_path):
    a = load_file(tiny.materialize_tiny_model(tmp_path / "a", seed=3) / "model.safetensors")
    again = load_file(tiny.materialize_tiny_model(tmp_path / "again", seed=3) / "model.safetensors")
    other = load_file(tiny.materialize_tiny_model(tmp_path / "other", seed=4) / "model.safetensors")
    assert all(torch.equal(a[name], again[name]) for name in a)
    matrices = [name for name in a if a[name].dim() == 2]
    assert all(not torch.equal(a[name], other[name]) for name in matrices)
    pad = tiny.build_char_tokenizer().pad_token_id
    assert torch.equal(a["model.embed_tokens.weight"][pad], torch.zeros(64))
    drawn = torch.cat([a[name].flatten() for name in matrices if name != "model.embed_tokens.weight"])
    assert abs(drawn.mean().item()) < 1e-3 and abs(drawn.std().item() - 0.02) < 5e-4
    assert all(torch.equal(a[name], torch.ones_like(a[name])) for name in a if name.endswith("norm.weight"))


def test_writing_it_imports_no_torch(tmp_path):
    code = ("import sys; from relax_core.models.tiny import materialize_tiny_model; "
            f"materialize_tiny_model({str(tmp_path / 'm')!r}); print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_the_tokenizer_loads_as_autotokenizer_would_and_other_classes_go_through_it(tmp_path, monkeypatch):
    import json

    import transformers

    from relax_core.models.tokenizer import load_tokenizer

    out = tiny.materialize_tiny_model(tmp_path / "m", alphabet="abcd")
    auto = transformers.AutoTokenizer.from_pretrained(out)
    direct = load_tokenizer(out)
    chat = [{"role": "user", "content": "abba"}]
    assert type(direct) is type(auto)
    assert direct.apply_chat_template(chat, add_generation_prompt=True) == auto.apply_chat_template(
        chat, add_generation_prompt=True)
    assert (direct.eos_token_id, direct.pad_token_id, direct.encode("dcba")) == (
        auto.eos_token_id, auto.pad_token_id, auto.encode("dcba"))

    calls = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, **kw: calls.append((path, kw)) or auto)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(config | {"auto_map": {"AutoTokenizer": ["x.T", None]}}))
    load_tokenizer(out, trust_remote_code=True)
    (out / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "Qwen2Tokenizer"}))
    load_tokenizer(out)
    assert calls == [(out, {"trust_remote_code": True}), (out, {"trust_remote_code": False})]
