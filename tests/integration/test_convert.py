"""Checkpoint -> Hugging Face conversion (what `relax convert-ckpt --verify` does).

A tiny Qwen3 model (random weights, local char-level tokenizer) is changed
in memory, so its weights differ from the HF directory it came from, and
saved as a checkpoint together with an optimizer. The export must load with
plain `transformers` and reproduce the in-memory model exactly; damaged
checkpoints must fail with a CheckpointError that names the broken file.
Tiny Qwen3-VL and Qwen3-Omni policies, converted through the CLI with
`--verify`, must load with their own classes and hold the trained weights
under the model directory's names, next to Omni's untrained talker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax_core.checkpoint.dcp import load_checkpoint, save_checkpoint
from relax_core.checkpoint.hf_export import export_hf
from relax_core.checkpoint.hf_verify import VerificationError, verify_export
from relax_core.checkpoint.layout import CheckpointError
from relax_core.models.multimodal import load_policy
from relax_core.models.tiny import materialize_tiny_model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint dir, source HF dir, the model as trained in memory)."""
    root = tmp_path_factory.mktemp("convert")
    hf_dir = materialize_tiny_model(root / "tiny", seed=3)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # now the weights differ from hf_dir's model.safetensors
    ckpt = root / "ckpt"
    save_checkpoint(ckpt, 4, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 4}, hf_dir=hf_dir)
    return ckpt, hf_dir, model.eval()


def _logits(model, text_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=text_ids).logits


def test_export_loads_with_transformers_and_matches_trained_model(trained, tmp_path):
    ckpt, hf_dir, model = trained
    out = export_hf(ckpt, tmp_path / "hf")
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    trained_sd, exported_sd = model.state_dict(), exported.state_dict()
    assert trained_sd.keys() == exported_sd.keys()
    for name in trained_sd:
        assert torch.equal(trained_sd[name], exported_sd[name]), name
    source = load_file(str(hf_dir / "model.safetensors"))
    changed = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(source[changed], exported_sd[changed])  # the export took the trained weights

    tokenizer, original = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(hf_dir)
    chat = [{"role": "user", "content": "what is 2+3?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ids == original.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    batch = torch.tensor([tokenizer(ids)["input_ids"]])
    assert torch.equal(_logits(exported, batch), _logits(model, batch))

    report = verify_export(ckpt, out)
    assert report["iteration"] == 4 and report["max_abs_diff"] <= 1e-5
    assert report["num_parameters"] == sum(p.numel() for p in model.parameters())


def test_sharded_export_writes_an_index_transformers_follows(trained, tmp_path):
    ckpt, _, model = trained
    out = export_hf(ckpt, tmp_path / "hf", shard_bytes=60_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == set(model.state_dict())
    for shard in shards:  # no shard above the limit unless it holds a single tensor
        tensors = load_file(str(out / shard))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 60_000 or len(tensors) == 1
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    batch = torch.arange(20).unsqueeze(0)
    assert torch.equal(_logits(exported, batch), _logits(model, batch))
    assert verify_export(ckpt, out)["max_abs_diff"] <= 1e-5


def test_verify_rejects_an_export_that_differs(trained, tmp_path):
    ckpt, _, _ = trained
    out = export_hf(ckpt, tmp_path / "hf")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.weight"] += 1e-3
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(VerificationError, match="logits differ"):
        verify_export(ckpt, out)


def test_export_refuses_to_overwrite_a_non_empty_dir(trained, tmp_path):
    ckpt, _, _ = trained
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        export_hf(ckpt, tmp_path / "hf")
    assert export_hf(ckpt, tmp_path / "hf", overwrite=True).joinpath("model.safetensors").is_file()


@pytest.fixture
def damaged(trained, tmp_path) -> Path:
    """A private copy of the checkpoint that a test may break."""
    ckpt, _, _ = trained
    return Path(shutil.copytree(ckpt, tmp_path / "ckpt"))


def test_truncated_distcp_names_the_file(damaged, tmp_path):
    data = damaged / "iter_0000004" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=str(data)):
        export_hf(damaged, tmp_path / "hf")
    with pytest.raises(CheckpointError, match=str(data)):
        load_checkpoint(damaged, {"step": 0})
    assert not (tmp_path / "hf").exists()


def test_missing_metadata_names_the_file(damaged, tmp_path):
    metadata = damaged / "iter_0000004" / ".metadata"
    metadata.unlink()
    with pytest.raises(CheckpointError, match=str(metadata)):
        export_hf(damaged, tmp_path / "hf")


def test_missing_checkpoint_dir_and_iteration(damaged, tmp_path):
    with pytest.raises(CheckpointError, match=str(tmp_path / "absent")):
        export_hf(tmp_path / "absent", tmp_path / "hf")
    with pytest.raises(CheckpointError, match="iter_0000009"):
        export_hf(damaged, tmp_path / "hf", iteration=9)
    shutil.rmtree(damaged / "hf_config")
    with pytest.raises(CheckpointError, match=str(damaged / "hf_config" / "config.json")):
        export_hf(damaged, tmp_path / "hf")


def _perturbed_policy_checkpoint(root: Path, architecture: str):
    """(checkpoint dir, source HF dir, policy) for a tiny multimodal model whose weights moved, saved as the
    trainer saves them: the policy's `state_dict()` (for Omni the thinker's own names) and an optimizer."""
    hf_dir = materialize_tiny_model(root / architecture, architecture=architecture, seed=5)
    policy = load_policy(hf_dir)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    ckpt = root / "ckpt"
    save_checkpoint(ckpt, 2, {"model": policy.state_dict(), "optimizer": opt.state_dict()}, hf_dir=hf_dir)
    return ckpt, hf_dir, policy.eval()


def _convert_cli(ckpt: Path, out: Path, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "relax_cli.main", "convert-ckpt", str(ckpt), "--out", str(out),
                           "--verify"], cwd=cwd, env=os.environ | {"NO_COLOR": "1", "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "verified" in proc.stdout
    return proc.stdout


def _assert_same_weights(expected: torch.nn.Module, loaded: torch.nn.Module) -> None:
    want, got = expected.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def _assert_directory_files(out: Path, hf_dir: Path) -> None:
    for name in ("config.json", "preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja",
                 "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (hf_dir / name).read_bytes(), name
    # The weights carry the names the model directory itself uses (per-expert MoE weights, `thinker.`).
    assert load_file(str(out / "model.safetensors")).keys() == load_file(str(hf_dir / "model.safetensors")).keys()


def test_qwen3_vl_export_loads_with_its_class_and_holds_the_trained_weights(tmp_path):
    from transformers import Qwen3VLForConditionalGeneration

    ckpt, hf_dir, policy = _perturbed_policy_checkpoint(tmp_path, "qwen3_vl")
    out = tmp_path / "hf"
    _convert_cli(ckpt, out, tmp_path)
    _assert_directory_files(out, hf_dir)
    _assert_same_weights(policy, Qwen3VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32))
    _assert_same_weights(policy, load_policy(out))
    changed = "model.language_model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(load_file(str(hf_dir / "model.safetensors"))[changed], policy.state_dict()[changed])


def test_qwen3_omni_export_puts_the_trained_thinker_next_to_the_untrained_talker(tmp_path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    ckpt, hf_dir, thinker = _perturbed_policy_checkpoint(tmp_path, "qwen3_omni")
    # A real Qwen3-Omni directory also holds the talker and code2wav, which the run never loads or trains.
    weights = load_file(str(hf_dir / "model.safetensors"))
    untrained = {"talker.codec_head.weight": torch.randn(8, 4), "code2wav.pre_transformer.norm.weight": torch.ones(4)}
    save_file(weights | untrained, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "hf"
    _convert_cli(ckpt, out, tmp_path)
    _assert_directory_files(out, hf_dir)
    full = Qwen3OmniMoeForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    _assert_same_weights(thinker, full.thinker)
    _assert_same_weights(thinker, load_policy(out))
    exported = load_file(str(out / "model.safetensors"))
    for name, tensor in untrained.items():
        assert torch.equal(exported[name], tensor), name
    expert = "thinker.model.layers.0.mlp.experts.1.down_proj.weight"
    assert not torch.equal(weights[expert], exported[expert])  # the trained value, under the directory's name


@pytest.mark.parametrize("architecture", ["qwen3_vl", "qwen3_omni"])
def test_weights_for_sglang_carry_the_model_directorys_own_names(tmp_path, architecture):
    """SGLang's Qwen3-VL / Qwen3-Omni load synced weights by the checkpoint's names (the `thinker.` prefix, one
    tensor per expert), which are not the trainer's parameter names."""
    from safetensors import safe_open

    from relax_core.checkpoint.hf_media import checkpoint_named
    from relax_core.models.tiny import materialize_tiny_model
    from relax_core.train.config import TorchTrainerConfig
    from relax_core.train.torch_backend import TorchTrainer

    model_dir = materialize_tiny_model(tmp_path / "m", architecture=architecture, alphabet="abc")
    trainer = TorchTrainer(model_dir, TorchTrainerConfig())
    sent = dict(checkpoint_named(model_dir)(trainer.named_parameters_for_sync()))
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        saved = {name: f.get_tensor(name) for name in f.keys()}
    assert sent.keys() == saved.keys()
    assert all(torch.equal(sent[name], saved[name]) for name in saved)
    assert checkpoint_named(materialize_tiny_model(tmp_path / "text", alphabet="abc")) is None
