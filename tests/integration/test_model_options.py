"""`model.tokenizer` and `model.trust_remote_code` in a real run, and the GPU recipes refused by real Slurm.

A local run on a model that ships its own code (loadable only with
trust_remote_code) and a named tokenizer completes a step, so every loader of
the run (driver, engine, trainer ranks) was given the flag; the checkpoint
and the converted model carry the named tokenizer; `convert-ckpt --verify`
needs `--trust-remote-code` for such a model. With Slurm daemons answering,
`relax submit` of the shipped math recipe still exits 2 and submits nothing.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import yaml
from model_dirs import OTHER_TEMPLATE, custom_code_model, other_tokenizer
from relax_runs import relax as relax_cli

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())


relax = partial(relax_cli, timeout=600)  # whole runs: longer than a command's 120 s


@pytest.mark.full(covered_by="tests/integration/test_local_run.py::test_a_reward_plugin_next_to_the_recipe_trains_with_no_other_change")
def test_a_run_uses_the_named_tokenizer_and_trusts_the_models_code(tmp_path):
    from transformers import AutoTokenizer

    model = {"source": "hf", "path": str(custom_code_model(tmp_path / "model")), "dtype": "float32",
             "tokenizer": str(other_tokenizer(tmp_path / "tok")), "trust_remote_code": True}
    recipe = QUICKSTART | {"model": model, "train": QUICKSTART["train"] | {"steps": 1},
                           "rollout": QUICKSTART["rollout"] | {"prompts_per_step": 2, "n_samples_per_prompt": 2},
                           "checkpoint": {"interval": 1}, "logging": {"backends": []}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    proc = relax("submit", "r.yaml", "--executor", "local", "--run-dir", "run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "run"
    assert AutoTokenizer.from_pretrained(run / "model").chat_template == OTHER_TEMPLATE  # what every process loaded
    assert AutoTokenizer.from_pretrained(run / "checkpoints" / "hf_config").chat_template == OTHER_TEMPLATE

    refused = relax("convert-ckpt", "run", "--out", "hf", "--verify", cwd=tmp_path)
    assert refused.returncode == 2 and "--trust-remote-code" in refused.stderr
    converted = relax("convert-ckpt", "run", "--out", "hf", "--verify", "--trust-remote-code", "--overwrite",
                      cwd=tmp_path)
    assert converted.returncode == 0, converted.stderr
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == OTHER_TEMPLATE


def test_the_math_recipe_plans_on_a_slurm_that_answers_and_submits_nothing(slurm_cluster, tmp_path):
    before = slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()
    proc = relax("submit", str(REPO / "recipes" / "math_dapo_qwen3_4b.yaml"), "--executor", "slurm", "--dry-run",
                 f"cluster.slurm.partition={slurm_cluster.gpu_partition}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trainer rank 7 (megatron, with the critic)" in proc.stdout
    assert "not available" not in proc.stdout + proc.stderr
    assert slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split() == before
