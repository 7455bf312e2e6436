"""The `relax` command line as a user runs it: exit codes, messages, nothing written on error."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from relax_runs import relax

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def test_help_lists_the_commands():
    proc = relax("--help")
    assert proc.returncode == 0
    for command in ("validate", "recipes", "list", "doctor"):
        assert command in proc.stdout


def test_cli_import_pulls_in_no_heavy_package():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import relax_cli.main"],
                          capture_output=True, text=True, check=True)
    imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if "|" in line}
    assert not imported & {"torch", "ray", "transformers", "sglang", "megatron"}


def test_validate_prints_the_resolved_recipe():
    proc = relax("validate", str(QUICKSTART), "train.lr=2e-4", "rollout.n_samples_per_prompt=4")
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["train"]["lr"] == 2e-4 and resolved["rollout"]["n_samples_per_prompt"] == 4
    assert resolved["train"]["grad_clip"] == 1.0  # defaults are filled in


def test_validate_refuses_paths_this_machine_cannot_see_as_submit_does(tmp_path):
    recipe = yaml.safe_load(QUICKSTART.read_text()) | {"data": {"source": "file", "path": "/cluster/data/train.jsonl"}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    proc = relax("validate", str(tmp_path / "r.yaml"))
    assert proc.returncode == 2, proc.stderr
    assert "data.path: file '/cluster/data/train.jsonl' does not exist" in proc.stderr and proc.stdout == ""


BAD_RECIPES = {
    "empty": ("", ["empty"]),
    "a list": ("- name: x\n- model: y\n", ["YAML list", "mapping"]),
    "bad yaml": ("name: x\nmodel: {source: tiny\n", ["invalid YAML", "line"]),
    "unknown key": ("name: x\nmodel: {source: tiny}\ndata: {source: synthetic}\nrolout: {}\n",
                    ["rolout", "did you mean 'rollout'", "line 4"]),
    "wrong type": ("name: x\nmodel: {source: tiny}\ndata: {source: synthetic}\ntrain: {steps: lots}\n",
                   ["train.steps", "'lots'"]),
    "negative nodes": ("name: x\nmodel: {source: tiny}\ndata: {source: synthetic}\n"
                       "cluster: {train: {nodes: -1}}\n", ["cluster.train.nodes", "greater than or equal"]),
}


@pytest.mark.parametrize("case", BAD_RECIPES, ids=list(BAD_RECIPES))
def test_bad_recipe_exits_2_naming_file_and_field(tmp_path, case):
    text, words = BAD_RECIPES[case]
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    before = sorted(tmp_path.rglob("*"))
    proc = relax("validate", str(recipe), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "bad.yaml" in proc.stderr
    for word in words:
        assert word in proc.stderr
    assert len(proc.stderr.splitlines()) < 25  # one screen
    assert "Traceback" not in proc.stderr
    assert proc.stdout == "" and sorted(tmp_path.rglob("*")) == before  # nothing printed or written


@pytest.mark.parametrize(
    ("override", "words"),
    [("train.lrate=1", ["train.lrate", "override 'train.lrate=1'", "did you mean 'lr'"]),
     ("train.lr", ["KEY=VALUE"]),
     ("cluster.train.nodes=-3", ["cluster.train.nodes", "override"])],
)
def test_bad_override_exits_2(tmp_path, override, words):
    proc = relax("validate", str(QUICKSTART), override, cwd=tmp_path)
    assert proc.returncode == 2
    for word in words:
        assert word in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_missing_recipe_file(tmp_path):
    proc = relax("validate", str(tmp_path / "nope.yaml"), cwd=tmp_path)
    assert proc.returncode == 2 and "nope.yaml" in proc.stderr and "not found" in proc.stderr


def test_usage_mistake_exits_2():
    assert relax("validate").returncode == 2
    assert relax("list", "widgets").returncode == 2


def test_recipes_lists_every_shipped_recipe_with_a_description():
    proc = relax("recipes")
    assert proc.returncode == 0
    for name in ("quickstart.yaml", "math_dapo_qwen3_4b.yaml", "vlm_openr1_qwen3vl_4b.yaml", "omni_avqa.yaml"):
        line = next(line for line in proc.stdout.splitlines() if name in line)
        assert len(line.replace(name, "").strip()) > 10


def test_list_algorithms_json_matches_what_recipes_accept(tmp_path):
    entries = json.loads(relax("list", "algorithms", "--json").stdout)
    names = {e["name"] for e in entries}
    assert "grpo" in names
    base = yaml.safe_load(QUICKSTART.read_text())
    for name in names:
        recipe = tmp_path / f"{name}.yaml"
        extra = {"ppo": {"critic": {}}, "opd": {"teacher": {"path": "teacher"}}}.get(name, {})
        recipe.write_text(yaml.safe_dump(base | {"algorithm": {"name": name, **extra}}))
        assert relax("validate", str(recipe)).returncode == 0
    assert all(e["description"] and isinstance(e["parameters"], dict) for e in entries)


def test_list_rewards_includes_the_quickstart_reward():
    proc = relax("list", "rewards", "--json")
    assert proc.returncode == 0
    assert yaml.safe_load(QUICKSTART.read_text())["reward"]["name"] in {e["name"] for e in json.loads(proc.stdout)}


def test_doctor_reports_what_each_executor_misses():
    proc = relax("doctor", "--json")
    assert proc.returncode == 0
    report = json.loads(proc.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["python"]["detail"] == ".".join(map(str, sys.version_info[:3]))
    assert checks["torch"]["found"]
    assert set(report["executors"]) >= {"local (CPU)", "slurm"}
    assert report["executors"]["local (CPU)"]["missing"] == []
    sbatch_found = checks["sbatch"]["found"]
    assert ("sbatch" in report["executors"]["slurm"]["missing"]) != sbatch_found


def test_auto_executor_runs_locally_without_slurm(tmp_path):
    """A laptop (no sbatch) runs the recipe here; --dry-run records which executor it chose."""
    bare = tmp_path / "bin"  # a PATH with no sbatch, whatever this machine has installed
    bare.mkdir()
    env = os.environ | {"PATH": str(bare), "NO_COLOR": "1"}
    proc = subprocess.run([sys.executable, "-m", "relax_cli.main", "submit", str(QUICKSTART), "--dry-run",
                           "--run-dir", "r"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "r" / "run.json").read_text())["executor"] == "local"
