"""The Slurm job script `relax submit` renders, for every shipped recipe.

Golden files (tests/golden/*.sbatch) were read line by line when written;
a change to the rendered script shows up as a diff to review. Regenerate
them with RELAX_UPDATE_GOLDEN=1 after checking the new output by eye. The
semantic checks below hold independently of the golden files.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from relax_core.config import load_recipe
from relax_core.errors import RecipeError
from relax_core.launch.plan import plan_lines
from relax_core.launch.slurm import render_job_script
from relax_core.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
RUN = RunDir(Path("/scratch/alice/runs/demo-20261129-100000"))
CONTAINER = ["cluster.container.image=/scratch/images/relax.sif",
             "cluster.container.binds=[/scratch/data:/data:ro, /scratch/hf]",
             "cluster.container.env={HF_HOME: /scratch/hf}",
             "cluster.slurm.partition=gpu", "cluster.slurm.account=proj42",
             "cluster.slurm.setup=[module load apptainer]"]
CASES = {
    "quickstart": ("quickstart.yaml", []),
    "math_dapo_qwen3_4b": ("math_dapo_qwen3_4b.yaml", []),
    "vlm_openr1_qwen3vl_4b": ("vlm_openr1_qwen3vl_4b.yaml", []),
    "omni_avqa": ("omni_avqa.yaml", []),
    "omni_avqa_container": ("omni_avqa.yaml", CONTAINER),
}


def render(case: str) -> str:
    recipe_file, overrides = CASES[case]
    return render_job_script(load_recipe(REPO / "recipes" / recipe_file, overrides), RUN, python="python3")


@pytest.mark.parametrize("case", CASES)
def test_rendered_script_matches_golden_file(case):
    golden = GOLDEN / f"{case}.sbatch"
    text = render(case)
    if os.environ.get("RELAX_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def sbatch_components(text: str) -> list[list[str]]:
    components: list[list[str]] = [[]]
    for line in text.splitlines():
        if line == "#SBATCH hetjob":
            components.append([])
        elif line.startswith("#SBATCH "):
            components[-1].append(line.removeprefix("#SBATCH "))
        elif line and not line.startswith("#"):
            break  # sbatch reads no directive after the first command
    return components


def script(recipe_file: str, *overrides: str) -> str:
    return render_job_script(load_recipe(REPO / "recipes" / recipe_file, list(overrides)), RUN, python="python3")


def test_heterogeneous_job_has_one_component_per_node_group():
    omni = load_recipe(REPO / "recipes/omni_avqa.yaml")
    train, rollout = sbatch_components(script("omni_avqa.yaml", "cluster.slurm.layout=het"))
    assert f"--nodes={omni.cluster.train.nodes}" in train and f"--nodes={omni.cluster.rollout.nodes}" in rollout
    assert "--gres=gpu:8" in train and "--gres=gpu:8" in rollout
    assert "--signal=B:USR1@600" in train and "--requeue" in train  # job-wide options: first component
    assert len(sbatch_components(render("math_dapo_qwen3_4b"))) == 1  # no rollout group, no het job
    assert len(sbatch_components(script("quickstart.yaml", "cluster.rollout.cpus_per_node=2"))) == 2  # shapes differ


# ------------------------------------------------------------------ GPUs as gres
def test_gpus_are_asked_for_as_a_generic_resource_of_the_named_type():
    """`--gpus-per-node` is refused on select/cons_res and select/linear and names no GPU model; `--gres` is not."""
    typed = script("omni_avqa.yaml", "cluster.train.gpu_type=a100", "cluster.rollout.gpu_type=h100")
    train, rollout = sbatch_components(typed)
    assert "--gres=gpu:a100:8" in train and "--gres=gpu:h100:8" in rollout
    assert "--gres=gpu:8" in sbatch_components(render("omni_avqa"))[0]  # no type: any GPU
    assert "--gpus" not in typed and "--gpus" not in render("omni_avqa")
    assert not any("--gres" in line for line in sbatch_components(render("quickstart"))[0])  # CPU groups ask none


@pytest.mark.parametrize("line", ["--gres=gpu:a100:8", "--gpus-per-node=8", "--gpus=16", "-G 2"])
def test_gpu_options_in_extra_sbatch_are_refused_naming_the_fields_that_ask_for_gpus(line):
    with pytest.raises(RecipeError) as refused:
        load_recipe(REPO / "recipes/omni_avqa.yaml", [f"cluster.slurm.extra_sbatch=[{line}]"])
    assert "cluster.slurm.extra_sbatch" in str(refused.value) and line in str(refused.value)
    assert "cluster.<group>.gpus_per_node" in str(refused.value) and "cluster.<group>.gpu_type" in str(refused.value)
    assert load_recipe(REPO / "recipes/omni_avqa.yaml", ["cluster.slurm.extra_sbatch=[--gres-flags=enforce-binding]"])


@pytest.mark.parametrize(("overrides", "words"), [
    (["cluster.train.gpu_type=a100"], ["cluster.train", "gpu_type", "gpus_per_node is 0"]),  # would ask for nothing
    (["cluster.rollout.gpu_type=a100:8"], ["cluster.rollout.gpu_type"]),  # not a gres type name
])
def test_a_gpu_type_that_cannot_act_is_refused(overrides, words):
    with pytest.raises(RecipeError) as refused:
        load_recipe(REPO / "recipes/quickstart.yaml", overrides)
    for word in words:
        assert word in str(refused.value)


# ------------------------------------------------------ per-group Slurm settings
def test_each_group_may_have_its_own_partition_account_qos_and_constraint():
    text = script("omni_avqa.yaml", "cluster.slurm.partition=gpu", "cluster.slurm.account=proj42",
                  "cluster.rollout.partition=inference", "cluster.rollout.account=proj7", "cluster.rollout.qos=low",
                  "cluster.rollout.constraint=h100")
    train, rollout = sbatch_components(text)  # the groups differ: a het job, one component each
    assert {"--partition=gpu", "--account=proj42"} <= set(train) and not {"--qos=low", "--constraint=h100"} & set(train)
    assert {"--partition=inference", "--account=proj7", "--qos=low", "--constraint=h100"} <= set(rollout)
    assert "--partition=gpu" not in rollout and "--account=proj42" not in rollout


# ------------------------------------------------------------------ layout
def test_groups_of_one_shape_are_one_plain_job_of_all_their_nodes():
    text = script("quickstart.yaml", "cluster.train.nodes=2", "cluster.rollout.nodes=3")
    (job,) = sbatch_components(text)
    assert "--nodes=5" in job and "#SBATCH hetjob" not in text
    assert "# one job of 5 nodes: 2 training, then 3 rollout" in text
    assert len(sbatch_components(script("quickstart.yaml", "cluster.slurm.layout=het"))) == 2  # forced


def test_the_plan_says_which_job_and_why_it_is_heterogeneous():
    same = load_recipe(REPO / "recipes/quickstart.yaml")
    assert "(one job of 2 nodes: 1 train, then 1 rollout)" in plan_lines(same, "slurm")[0]
    differ = load_recipe(REPO / "recipes/quickstart.yaml", ["cluster.rollout.partition=other"])
    header, reason = plan_lines(differ, "slurm")[:2]
    assert header.endswith("(het group 0: train, 1: rollout)")
    assert "cluster.rollout.partition is other but cluster.train.partition is unset" in reason


@pytest.mark.parametrize("override", ["cluster.rollout.cpus_per_node=2", "cluster.rollout.mem=8G",
                                      "cluster.rollout.partition=other", "cluster.rollout.qos=low"])
def test_groups_of_different_shapes_are_a_het_job_and_single_refuses_them(override):
    field = override.split("=")[0]
    assert len(sbatch_components(script("quickstart.yaml", override))) == 2
    with pytest.raises(RecipeError) as refused:
        load_recipe(REPO / "recipes/quickstart.yaml", [override, "cluster.slurm.layout=single"])
    assert f"{field} is" in str(refused.value) and "layout is single" in str(refused.value)


def test_container_wraps_every_step_but_not_the_supervisor():
    from relax_core.entrypoints.slurm_job import Allocation, JobSteps

    recipe = load_recipe(REPO / "recipes/omni_avqa.yaml", CONTAINER)
    text = render("omni_avqa_container")
    supervisor = shlex.split(text.strip().splitlines()[-1].removeprefix("exec "))
    assert supervisor == ["python3", "-m", "relax_core.entrypoints.slurm_job", str(RUN.path)]  # calls srun: host
    (job,) = sbatch_components(text)  # both groups ask for the same nodes: one plain job
    assert "--partition=gpu" in job and "--account=proj42" in job
    assert text.index("module load apptainer") < text.index("exec python3")  # setup runs first

    steps = JobSteps(recipe, RUN, Allocation(7, 0, {"train": ["g1"], "rollout": ["g2"]}))
    command = steps.step_command("rollout", "g2", "ray-g2", ["relax_core.cluster.node", str(RUN.path)])
    assert command[:6] == ["srun", "--het-group=1", "--nodes=1", "--ntasks=1", "--nodelist=g2", "--overlap"]
    inner = command[command.index("apptainer"):]
    assert inner[:4] == ["apptainer", "exec", "--cleanenv", "--nv"]
    assert inner[inner.index("/scratch/images/relax.sif") + 1:] == [
        "python3", "-m", "relax_core.cluster.node", str(RUN.path)]
    binds = [inner[i + 1] for i, arg in enumerate(inner) if arg == "--bind"]
    assert str(RUN.path) in binds and "/scratch/data:/data:ro" in binds


def test_values_are_quoted_for_the_shell(tmp_path):
    run = RunDir(tmp_path / "a dir with spaces")
    text = render_job_script(load_recipe(REPO / "recipes/quickstart.yaml"), run, python="python3")
    assert f"export RELAX_RUN_DIR='{run.path}'" in text
    assert shlex.split(text.splitlines()[-1])[-1] == str(run.path)
