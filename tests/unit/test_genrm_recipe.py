"""The recipe's `reward.genrm` section: refused where it would not act, and placed where it fits.

- a judge model with a reward that is not `genrm` (and no routing column) is refused, naming the section;
- `reward.name: genrm` without a judge model (and no `RELAX_GENRM_URL`) is refused, naming
  `reward.genrm.model`; with the variable (a judge server of the user's own) it is accepted;
- a template with an unknown placeholder, or none for the response, is refused;
- the judge model must exist, and may ship its own code only with `reward.genrm.trust_remote_code`;
- `reward.genrm.num_engines` judge slots are advertised on the engines' node group (Slurm) and on the
  local Ray node, beside the engine slots;
- the reward hub of such a recipe needs the judge's endpoints (plain, picklable data) and asks them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from model_dirs import custom_code_model

from relax_core.cluster.node import node_resources
from relax_core.cluster.placement import JUDGE_RESOURCE, ROLLOUT_RESOURCE, local_slots
from relax_core.config import RecipeError, load_recipe
from relax_core.config.checks import reference_problems
from relax_core.config.reward import DEFAULT_TEMPLATE
from relax_core.models import tiny

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())


@pytest.fixture(autouse=True)
def no_external_judge(monkeypatch):
    monkeypatch.delenv("RELAX_GENRM_URL", raising=False)


def recipe_file(tmp_path: Path, reward: dict, **sections) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(QUICKSTART | {"reward": reward} | sections))
    return path


def test_a_judge_model_for_a_reward_that_is_not_genrm_is_refused(tmp_path):
    with pytest.raises(RecipeError) as error:
        load_recipe(recipe_file(tmp_path, {"name": "copy", "genrm": {"model": "judge"}}))
    message = " ".join(str(error.value).split())
    assert "reward.genrm: a judge model is set, but reward.name is 'copy'" in message
    assert "set reward.name=genrm, or remove reward.genrm" in message


def test_a_judge_model_is_accepted_when_rows_route_to_their_own_rewards(tmp_path):
    data = {"source": "file", "path": "rows.jsonl", "reward_key": "task"}
    recipe = load_recipe(recipe_file(tmp_path, {"name": "copy", "genrm": {"model": "judge"}}, data=data))
    assert recipe.reward.genrm.model == "judge" and recipe.reward.judge_engines == 1


def test_genrm_without_a_judge_is_refused_naming_the_model_field(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "relax_cli.main", "validate",
                           str(recipe_file(tmp_path, {"name": "genrm"}))],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env=os.environ | {"COLUMNS": "200", "NO_COLOR": "1"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    message = " ".join(proc.stderr.split())
    assert "reward.genrm.model: reward genrm needs a judge model: set reward.genrm.model" in message
    assert "RELAX_GENRM_URL" in message


def test_genrm_with_a_judge_server_of_ones_own_needs_no_section(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_GENRM_URL", "http://127.0.0.1:9")
    recipe = load_recipe(recipe_file(tmp_path, {"name": "genrm"}))
    assert recipe.reward.genrm is None and recipe.reward.judge_engines == 0


def test_section_defaults(tmp_path):
    judge = load_recipe(recipe_file(tmp_path, {"name": "genrm", "genrm": {"model": "judge"}})).reward.genrm
    assert (judge.num_engines, judge.max_new_tokens, judge.max_score, judge.trust_remote_code) == (1, 16, 10.0, False)
    assert judge.template == DEFAULT_TEMPLATE


@pytest.mark.parametrize("template,words", [
    ("Grade {answer}", "unknown placeholder(s) {answer}"),
    ("Is {label} right? Score:", "the template has no {response}"),
    ("Grade {response", "not a format string"),
])
def test_templates_the_judge_cannot_use_are_refused(tmp_path, template, words):
    with pytest.raises(RecipeError, match="reward.genrm.template") as error:
        load_recipe(recipe_file(tmp_path, {"name": "genrm", "genrm": {"model": "judge", "template": template}}))
    assert words in str(error.value)


@pytest.mark.parametrize("field,value", [("num_engines", 0), ("max_new_tokens", 0), ("max_score", 0)])
def test_bounds(tmp_path, field, value):
    with pytest.raises(RecipeError, match=f"reward.genrm.{field}"):
        load_recipe(recipe_file(tmp_path, {"name": "genrm", "genrm": {"model": "judge", field: value}}))


def test_the_judge_model_must_exist_and_run_its_own_code_only_when_trusted(tmp_path):
    def problems(**judge) -> list[str]:
        recipe = load_recipe(recipe_file(tmp_path, {"name": "genrm", "genrm": judge}))
        return [p for p in reference_problems(recipe) if p.startswith("reward.genrm")]

    assert problems(model=str(tmp_path / "nowhere")) == [
        f"reward.genrm.model: '{tmp_path / 'nowhere'}' is neither a local model directory with a config.json "
        "nor a hub id like Org/Name"]
    assert problems(model=str(tiny.materialize_tiny_model(tmp_path / "plain"))) == []
    assert problems(model="Org/Judge") == []  # a hub id
    shipped = str(custom_code_model(tmp_path / "custom"))
    assert problems(model=shipped) == [f"reward.genrm.model: '{shipped}' ships its own code (auto_map in "
                                       "config.json); set reward.genrm.trust_remote_code=true if you trust it"]
    assert problems(model=shipped, trust_remote_code=True) == []


def test_judge_slots_sit_on_the_engines_group(tmp_path):
    judge = {"name": "genrm", "genrm": {"model": "judge", "num_engines": 3}}
    apart = QUICKSTART["cluster"] | {"rollout": {"nodes": 2, "cpus_per_node": 1}}
    recipe = load_recipe(recipe_file(tmp_path, judge, cluster=apart))
    assert node_resources(recipe, "rollout", "n1")[JUDGE_RESOURCE] == 2  # 3 judges over 2 nodes
    assert JUDGE_RESOURCE not in node_resources(recipe, "train", "n0")
    shared = QUICKSTART["cluster"] | {"rollout": {"nodes": 0}}  # colocate without a rollout group
    recipe = load_recipe(recipe_file(tmp_path, judge, cluster=shared))
    assert node_resources(recipe, "train", "n0")[JUDGE_RESOURCE] == 3
    # one engine slot per core: the recipe's engine, and as many as a scale-out may add on this machine
    assert local_slots(recipe)[JUDGE_RESOURCE] == 3 and local_slots(recipe)[ROLLOUT_RESOURCE] == os.cpu_count()


def test_no_judge_slots_without_a_judge(tmp_path):
    recipe = load_recipe(recipe_file(tmp_path, {"name": "copy"}))
    assert JUDGE_RESOURCE not in node_resources(recipe, "rollout", "n1")
    assert JUDGE_RESOURCE not in local_slots(recipe)


def test_the_hub_of_a_recipe_with_a_judge_model_needs_the_judges_endpoints(tmp_path):
    import pickle

    from relax_core.rewards.genrm import JudgeEndpoints
    from relax_core.rewards.hub import RewardHub, RewardItem

    config = load_recipe(recipe_file(tmp_path, {"name": "genrm", "genrm": {"model": "judge"}})).reward
    with pytest.raises(ValueError, match="reward.genrm set, no judge endpoints"):
        RewardHub.from_config(config)
    endpoints = pickle.loads(pickle.dumps(JudgeEndpoints(("http://127.0.0.1:9",), "key")))  # travels to any process
    assert "key" not in repr(endpoints)
    with RewardHub.from_config(config, judge=endpoints) as hub:  # asks those endpoints, not $RELAX_GENRM_URL
        [result] = hub.score_sync([RewardItem("x", None)])
    assert result.status == "error" and result.error.startswith("EngineUnreachable: http://127.0.0.1:9/"), result.error


def test_judge_engines_on_sglang_start_in_their_engine_slots_and_cpu_judges_in_judge_slots(tmp_path):
    """What JudgeService asks Ray for each judge engine: with SGLang engines, the placement-group bundle of
    its engine slot (the engines' group's last ones, GpuSlots.engine_options) and an SGLang server of the
    engines' TP size; with CPU engines, a `relax_judge` slot and a CPU engine pinned to the group's cores."""
    from relax_core.rewards.judge_service import JudgeService
    from relax_core.rundir import RunDir

    started = []

    class Ray:  # records each actor's options and arguments; starts nothing
        def remote(self, **options):
            def wrap(cls):
                class Handle:
                    @staticmethod
                    def remote(index, settings, log_path, api_key, cpus):
                        started.append((options, index, settings, cpus))
                        return type("Actor", (), {"wait_ready": type("M", (), {"remote": lambda: None})})()
                return Handle
            return wrap

    class Slots:
        def engine_options(self, slot):
            return {"num_cpus": 0, "num_gpus": 2, "bundle": slot}, None

    judge_dir = str(tiny.materialize_tiny_model(tmp_path / "judge", architecture="qwen3"))
    run = RunDir(tmp_path / "run").create()
    gpu = load_recipe(REPO / "recipes" / "math_dapo_qwen3_4b_fsdp.yaml",
                      ["mode=fully_async", "cluster.rollout.nodes=1", "rollout.num_engines=2", "reward.name=genrm",
                       f"reward.genrm.model={judge_dir}", "reward.genrm.num_engines=2"])
    JudgeService.start(Ray(), gpu, run, threads=4, cpus=[0, 1], slots=Slots())
    assert [(o, i, s.engine, s.tp_size, s.model_dir, cpus) for o, i, s, cpus in started] == [
        ({"num_cpus": 0, "num_gpus": 2, "bundle": 2}, 0, "sglang", 2, judge_dir, None),
        ({"num_cpus": 0, "num_gpus": 2, "bundle": 3}, 1, "sglang", 2, judge_dir, None)]
    started.clear()
    cpu = load_recipe(recipe_file(tmp_path, {"name": "genrm", "genrm": {"model": judge_dir}}))
    JudgeService.start(Ray(), cpu, run, threads=4, cpus=[0, 1])
    assert [(o, s.engine, cpus) for o, _, s, cpus in started] == [
        ({"num_cpus": 0, "resources": {JUDGE_RESOURCE: 1}}, "cpu", [0, 1])]
