"""Every recipe field acts, or is refused: one test per field that was once accepted and read by nothing.

- `model.tokenizer`: the model directory every process loads carries the named tokenizer;
- `model.trust_remote_code`: reaches each loader (trainer, critic, engine, convert-ckpt --verify),
  and a model that ships code without it is refused with exit 2;
- `model.architecture`: the tiny builder dispatches on it;
- what this version has no code for (Megatron's context and sequence parallelism, ...) is refused
  with exit 2 naming the field by `relax validate` and by `relax submit` on every executor, `--dry-run`
  included, with nothing written. The multimodal columns (`data.image_key`, ...) act: test_media.py.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import yaml
from model_dirs import ALPHABET, OTHER_TEMPLATE, custom_code_model, other_tokenizer
from relax_runs import relax

from relax_core.config import load_recipe
from relax_core.config.model import TinyModel
from relax_core.models import tiny

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())


def hf_recipe(tmp_path: Path, **model) -> Path:
    data = QUICKSTART | {"model": {"source": "hf", "dtype": "float32", **model}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# ------------------------------------------------------------------ model.tokenizer
def test_named_tokenizer_replaces_the_models_own_in_what_every_process_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax_core.checkpoint import save_checkpoint
    from relax_core.checkpoint.hf_export import export_hf
    from relax_core.data.prompts import encode_prompt
    from relax_core.models.model_dir import prepare_model_dir
    from relax_core.rundir import RunDir

    model_dir = tiny.materialize_tiny_model(tmp_path / "model", alphabet=ALPHABET)
    named = AutoTokenizer.from_pretrained(other_tokenizer(tmp_path / "tok"))
    own = AutoTokenizer.from_pretrained(model_dir)
    assert encode_prompt(named, "abcd") != encode_prompt(own, "abcd")  # the test can tell them apart
    recipe = load_recipe(hf_recipe(tmp_path, path=str(model_dir), tokenizer=str(tmp_path / "tok")))

    loaded_dir = prepare_model_dir(recipe, RunDir(tmp_path / "run"))  # what driver, engines, router, trainers load
    used = AutoTokenizer.from_pretrained(loaded_dir)
    assert encode_prompt(used, "abcd") == encode_prompt(named, "abcd")
    assert (loaded_dir / "model.safetensors").resolve() == (model_dir / "model.safetensors").resolve()
    assert (model_dir / "chat_template.jinja").read_text() != OTHER_TEMPLATE  # the model's folder is untouched

    weights = AutoModelForCausalLM.from_pretrained(loaded_dir).state_dict()
    save_checkpoint(tmp_path / "ckpt", 1, {"model": weights}, hf_dir=loaded_dir)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == OTHER_TEMPLATE


def test_without_a_named_tokenizer_the_model_directory_is_used_as_is(tmp_path):
    from relax_core.models.model_dir import prepare_model_dir
    from relax_core.rundir import RunDir

    model_dir = tiny.materialize_tiny_model(tmp_path / "model", alphabet=ALPHABET)
    recipe = load_recipe(hf_recipe(tmp_path, path=str(model_dir)))
    assert prepare_model_dir(recipe, RunDir(tmp_path / "run")) == model_dir.resolve()


def test_a_tokenizer_that_is_neither_a_folder_nor_a_hub_id_is_refused(tmp_path):
    model_dir = tiny.materialize_tiny_model(tmp_path / "model", alphabet=ALPHABET)
    recipe = hf_recipe(tmp_path, path=str(model_dir), tokenizer=str(tmp_path / "no" / "such" / "tokenizer"))
    proc = relax("submit", str(recipe), "--executor", "local", "--dry-run", "--run-dir", "r", cwd=tmp_path)
    assert proc.returncode == 2 and "model.tokenizer" in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists()


# -------------------------------------------------------------- model.trust_remote_code
def test_trust_remote_code_reaches_the_trainers_and_the_critics_loader(tmp_path):
    from relax_core.train.critic import ValueModel
    from relax_core.train.settings import trainer_config
    from relax_core.train.torch_backend import load_causal_lm

    model_dir = custom_code_model(tmp_path / "model")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_causal_lm(model_dir, "float32", "cpu", trust_remote_code=False)
    model = load_causal_lm(model_dir, "float32", "cpu", trust_remote_code=True)
    assert type(model).__name__ == "RelaxCustomForCausalLM"
    assert type(ValueModel(model_dir, "float32", trust_remote_code=True).body).__name__ == "RelaxCustomModel"
    for trust in (False, True):
        recipe = load_recipe(hf_recipe(tmp_path, path=str(model_dir), trust_remote_code=trust))
        assert trainer_config(recipe).trust_remote_code is trust


def test_the_engine_loads_a_model_with_its_own_code_only_when_trusted(tmp_path):
    from relax_core.rollout.cpu_engine.server import load_engine_state

    model_dir = str(custom_code_model(tmp_path / "model"))
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_engine_state(model_dir, dtype="float32", max_running=1, seed=0, weight_version="0")
    state = load_engine_state(model_dir, dtype="float32", max_running=1, seed=0, weight_version="0",
                              trust_remote_code=True)
    state.batcher.stop()
    assert type(state.batcher.model).__name__ == "RelaxCustomForCausalLM"


def test_the_engine_command_line_carries_the_flag():
    from relax_core.rollout.cpu_engine.__main__ import parse_args

    assert parse_args(["--model-path", "m", "--trust-remote-code"]).trust_remote_code
    assert not parse_args(["--model-path", "m"]).trust_remote_code


def test_a_model_that_ships_code_is_refused_without_trust_remote_code(tmp_path):
    recipe = hf_recipe(tmp_path, path=str(custom_code_model(tmp_path / "model")))
    proc = relax("submit", str(recipe), "--executor", "local", "--dry-run", "--run-dir", "r", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "model.path" in proc.stderr and "model.trust_remote_code=true" in proc.stderr
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------ model.architecture
def test_the_tiny_builder_dispatches_on_the_architecture(tmp_path):
    assert set(typing.get_args(TinyModel.model_fields["architecture"].annotation)) == set(tiny.CONFIG_BUILDERS)
    config = json.loads((tiny.materialize_tiny_model(tmp_path / "m", architecture="qwen3") / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    with pytest.raises(ValueError, match="llama"):
        tiny.materialize_tiny_model(tmp_path / "n", architecture="llama")


# ------------------------------------------------- fields whose backend does not exist yet
GPUS = {"cluster": {"train": {"gpus_per_node": 2}, "rollout": {"gpus_per_node": 1}}}
UNAVAILABLE = {
    "context_parallel": ({"train": {"backend": "megatron", "context_parallel": 2}}, "context_parallel", GPUS),
    "sequence_parallel": ({"train": {"backend": "megatron", "tensor_parallel": 2, "sequence_parallel": True}},
                          "sequence_parallel", GPUS),
    "megatron vlm": ({"train": {"backend": "megatron"}, "model": {"architecture": "qwen3_vl"}},
                     "model.architecture", GPUS),
}
COMMANDS = {
    "validate": ("validate",),
    "submit --dry-run": ("submit", "--dry-run"),
    "submit --executor local": ("submit", "--executor", "local"),
    "submit --executor slurm --dry-run": ("submit", "--executor", "slurm", "--dry-run"),
}


def merged(base: dict, change: dict) -> dict:
    out = dict(base)
    for key, value in change.items():
        out[key] = merged(base.get(key, {}), value) if isinstance(value, dict) and value else value
    return out


def unavailable_recipe(tmp_path: Path, case: str) -> Path:
    change, _, extra = UNAVAILABLE[case]
    data = merged(merged(QUICKSTART, extra), change)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("command", COMMANDS, ids=list(COMMANDS))
@pytest.mark.parametrize("case", UNAVAILABLE, ids=list(UNAVAILABLE))
def test_a_field_without_a_backend_is_refused_by_every_command(tmp_path, case, command):
    recipe = unavailable_recipe(tmp_path, case)
    load_recipe(recipe)  # the recipe itself is well formed: only this version lacks the feature
    before = sorted(tmp_path.rglob("*"))
    bare = tmp_path / "bin"  # no sbatch: the refusal comes first, whatever Slurm this machine has
    args = COMMANDS[command]
    proc = relax(args[0], str(recipe), *args[1:], cwd=tmp_path,
                 env={"PATH": str(bare)} if "slurm" in command else None)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    field = UNAVAILABLE[case][1]
    line = next(line for line in proc.stderr.splitlines() if field in line)
    assert "not available in this version of Relax" in line
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


def test_the_shipped_math_recipe_passes_every_check_but_the_missing_slurm(tmp_path):
    """It trains with the megatron backend: nothing in it is refused, only the absent sbatch is named."""
    proc = relax("submit", str(REPO / "recipes" / "math_dapo_qwen3_4b.yaml"), "--executor", "slurm", "--dry-run",
                 cwd=tmp_path, env={"PATH": str(tmp_path)})
    assert proc.returncode == 2
    assert "not available" not in proc.stderr and "sbatch" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- relax doctor
def test_doctor_checks_the_packages_of_every_backend_and_lists_only_what_has_no_code(tmp_path):
    proc = relax("doctor", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    advice = [c["detail"] for c in report["checks"] if not c["found"]]
    assert not any(a == "pip install megatron-core" for a in advice)  # installed with the dev extra
    assert {c["name"] for c in report["checks"]} >= {"megatron-core", "sglang"}
    needs = [need for verdict in report["executors"].values() for need in verdict["missing"]]
    assert not any("sglang" in need or "megatron" in need for need in needs)
    assert "megatron trainer" not in report["not_available"] and "sglang engine" not in report["not_available"]
    assert all("not available in this version" in d for d in report["not_available"].values())


@pytest.mark.parametrize("case", UNAVAILABLE, ids=list(UNAVAILABLE))
def test_every_refusal_of_a_missing_feature_comes_from_the_list_doctor_shows(tmp_path, case):
    from relax_core.launch.preflight import MISSING, unavailable_features

    recipe = load_recipe(unavailable_recipe(tmp_path, case))
    refused = [line.split(":")[0] for line in unavailable_features(recipe)]
    listed = [line.split(":")[0] for m in MISSING for line in m.check(recipe)]
    assert refused and refused == listed  # nothing refused as "not yet" outside the list
    shown = json.loads(relax("doctor", "--json", cwd=tmp_path).stdout)["not_available"]
    assert all(any(field.startswith(key) for key in shown) for field in refused), (refused, list(shown))


def test_trainer_groups_stay_on_gloo_on_a_node_with_gpus(monkeypatch):
    """The trainer's and the engines' tensors are on the CPU; an NCCL group (picked because CUDA exists) fails."""
    import torch

    from relax_core.controller.workers import collective_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert collective_backend() == "gloo"
