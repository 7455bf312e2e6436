"""The recipe schema and loader: shipped recipes validate, mistakes are named precisely."""

from pathlib import Path

import pytest
import yaml

from relax_core.assets import asset_dir
from relax_core.config import RecipeError, dump_recipe, load_recipe
from relax_core.config.loader import parse_value
from relax_core.config.model import TinyModel
from relax_core.config.schema import Recipe
from relax_core.config.train import MegatronTrainConfig, TorchTrainConfig

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p for p in (REPO / "recipes").rglob("*") if p.suffix in (".yaml", ".yml"))

MINIMAL = {"name": "t", "model": {"source": "tiny"}, "data": {"source": "synthetic"},
           "rollout": {"engine": "cpu", "gpus_per_engine": 0}}


def write(tmp_path: Path, data) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def problem_of(tmp_path, data, overrides=()) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, data), list(overrides))
    return str(info.value)


def test_the_four_documented_recipes_ship():
    names = {p.name for p in SHIPPED}
    assert {"quickstart.yaml", "math_dapo_qwen3_4b.yaml", "vlm_openr1_qwen3vl_4b.yaml", "omni_avqa.yaml"} <= names
    assert asset_dir("recipes") == REPO / "recipes"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO / "recipes")))
def test_every_shipped_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.name
    # what validate prints must load again to the same recipe
    again = Recipe.model_validate(yaml.safe_load(dump_recipe(recipe)))
    assert again == recipe


def test_documented_sizes_of_the_gpu_recipes():
    omni = load_recipe(REPO / "recipes/omni_avqa.yaml")
    assert omni.mode == "fully_async"
    assert omni.cluster.train.gpus + omni.cluster.rollout.gpus == 16
    assert omni.cluster.train.nodes + omni.cluster.rollout.nodes == 2
    for name in ("math_dapo_qwen3_4b.yaml", "vlm_openr1_qwen3vl_4b.yaml"):
        assert load_recipe(REPO / "recipes" / name).cluster.train.gpus == 8
    assert load_recipe(REPO / "recipes/math_dapo_qwen3_4b.yaml").algorithm.name == "ppo"


def test_overrides_apply_with_types(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL), ["train.lr=2e-6", "rollout.n_samples_per_prompt=4",
                                                   "model.hidden_size=32", "cluster.slurm.setup=[module load x]"])
    assert recipe.train.lr == 2e-6
    assert recipe.rollout.n_samples_per_prompt == 4
    assert isinstance(recipe.model, TinyModel) and recipe.model.hidden_size == 32
    assert recipe.cluster.slurm.setup == ["module load x"]


def test_override_values_parse_like_a_user_expects():
    assert parse_value("2e-6") == 2e-6  # plain YAML 1.1 would give the string '2e-6'
    assert parse_value("4") == 4 and parse_value("true") is True and parse_value("null") is None
    assert parse_value("abc") == "abc" and parse_value("[1, 2]") == [1, 2]


def test_backend_is_picked_by_its_tag(tmp_path):
    assert isinstance(load_recipe(write(tmp_path, MINIMAL)).train, TorchTrainConfig)
    data = MINIMAL | {"train": {"backend": "megatron", "tensor_parallel": 2},
                      "rollout": {"engine": "sglang", "gpus_per_engine": 1},
                      "cluster": {"train": {"nodes": 1, "gpus_per_node": 4}}}
    recipe = load_recipe(write(tmp_path, data))
    assert isinstance(recipe.train, MegatronTrainConfig) and recipe.data_parallel == 2


def test_unknown_key_names_the_path_line_and_suggests(tmp_path):
    text = "name: t\nmodel: {source: tiny}\ndata: {source: synthetic}\nrollout:\n  engine: cpu\n" \
           "  gpus_per_engine: 0\n  n_sample_per_prompt: 4\n"
    message = problem_of(tmp_path, text)
    assert "rollout.n_sample_per_prompt" in message
    assert "line 7" in message and "did you mean 'n_samples_per_prompt'" in message
    assert "max_new_tokens" in message  # lists the valid keys


def test_unknown_key_inside_a_tagged_union_uses_the_users_path(tmp_path):
    message = problem_of(tmp_path, MINIMAL | {"train": {"backend": "torch", "lrr": 1}})
    assert "train.lrr" in message and "did you mean 'lr'" in message
    assert "train.torch" not in message


def test_wrong_type_names_the_full_path(tmp_path):
    message = problem_of(tmp_path, MINIMAL | {"cluster": {"train": {"nodes": "many"}}})
    assert "cluster.train.nodes" in message and "'many'" in message


def test_override_of_a_missing_key_is_named_as_an_override(tmp_path):
    message = problem_of(tmp_path, MINIMAL, ["cluster.rollout.nodez=4"])
    assert "cluster.rollout.nodez" in message and "override 'cluster.rollout.nodez=4'" in message
    assert "did you mean 'nodes'" in message


@pytest.mark.parametrize("override", ["train.lr", "=3", "train..lr=1"])
def test_malformed_overrides(tmp_path, override):
    assert "override" in problem_of(tmp_path, MINIMAL, [override])


def test_override_through_a_value_is_refused(tmp_path):
    assert "name is a value" in problem_of(tmp_path, MINIMAL, ["name.x=1"])


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"mode": "fully_async"}, "cluster.rollout.nodes", "needs a rollout node group"),
        ({"rollout": {"engine": "cpu", "gpus_per_engine": 1}}, "rollout.gpus_per_engine", "set it to 0"),
        ({"rollout": {"engine": "cpu", "gpus_per_engine": 0, "prompts_per_step": 3, "n_samples_per_prompt": 1},
          "train": {"cpu_ranks_per_node": 2}}, "rollout.prompts_per_step", "2 data-parallel ranks"),
        ({"train": {"backend": "megatron", "tensor_parallel": 2}}, "train.tensor_parallel",
         "does not divide the 1 trainer ranks"),
        ({"train": {"backend": "megatron", "cpu_ranks_per_node": 2, "expert_parallel": 4}}, "train.expert_parallel",
         "does not divide the 2 data-parallel ranks"),
        ({"cluster": {"train": {"nodes": 0}}}, "cluster.train.nodes", "at least 1 node"),
        ({"data": {"source": "file", "path": "x.jsonl", "system_prompt": "Be brief.", "apply_chat_template": False}},
         "apply_chat_template", "system_prompt"),
        ({"data": {"source": "file", "path": "x.parquet", "image_key": "image", "apply_chat_template": False}},
         "apply_chat_template", "image_key"),
        ({"data": {"source": "synthetic", "task": "colours", "apply_chat_template": False}},
         "apply_chat_template", "colours has media"),
    ],
)
def test_cross_field_checks(tmp_path, change, field, words):
    message = problem_of(tmp_path, MINIMAL | change)
    assert field in message and words in message


def test_colocate_may_put_its_engines_on_a_rollout_group(tmp_path):
    from relax_core.launch.plan import resource_problems

    data = MINIMAL | {"rollout": {"engine": "sglang", "num_engines": 2, "gpus_per_engine": 4},
                      "cluster": {"train": {"gpus_per_node": 8}, "rollout": {"nodes": 1, "gpus_per_node": 4}}}
    [message] = resource_problems(load_recipe(write(tmp_path, data)))  # they must fit the rollout group
    assert message.startswith("cluster.rollout: 2 engines x 4 GPUs = 8 GPUs, but the rollout group has 1 node x 4")
    data["cluster"]["rollout"]["gpus_per_node"] = 8
    recipe = load_recipe(write(tmp_path, data))
    assert recipe.mode == "colocate" and resource_problems(recipe) == []


def test_negative_node_count(tmp_path):
    message = problem_of(tmp_path, MINIMAL | {"cluster": {"rollout": {"nodes": -2}}})
    assert "cluster.rollout.nodes" in message and "greater than or equal to 0" in message


def test_missing_required_sections(tmp_path):
    message = problem_of(tmp_path, {"name": "t"})
    assert "model" in message and "data" in message and "missing" in message


def test_ppo_needs_a_critic(tmp_path):
    message = problem_of(tmp_path, MINIMAL | {"algorithm": {"name": "ppo"}})
    assert "algorithm.critic" in message and "missing" in message


def test_slurm_time_format(tmp_path):
    assert load_recipe(write(tmp_path, MINIMAL | {"cluster": {"slurm": {"time": "1-12:00:00"}}}))
    assert "not a Slurm time" in problem_of(tmp_path, MINIMAL | {"cluster": {"slurm": {"time": "12h"}}})


def test_every_field_is_documented():
    from pydantic import BaseModel

    seen, todo = set(), [Recipe]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no docstring"
            for arg in getattr(info.annotation, "__args__", ()) + (info.annotation,):
                for inner in getattr(arg, "__args__", ()) + (arg,):
                    origin = getattr(inner, "__origin__", inner)
                    if isinstance(origin, type) and issubclass(origin, BaseModel):
                        todo.append(origin)
    assert len(seen) > 10


def test_schema_imports_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys, relax_core.config, relax_core.catalog; "
            "print(sorted(m for m in ('torch','ray','transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_queue_budget_outside_the_asynchronous_modes_is_refused_naming_it(tmp_path):
    problem = problem_of(tmp_path, MINIMAL, ["mode=colocate", "rollout.max_queue_mb=512"])
    assert "rollout.max_queue_mb" in problem and "mode=fully_async" in problem and "remove it" in problem
    assert "max_queue_mb" in problem_of(tmp_path, MINIMAL, ["rollout.max_queue_mb=0"])  # must be above 0
