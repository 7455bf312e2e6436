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
from relax_core.launch.rundir import RunDir
from relax_core.launch.slurm import render_job_script

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


def test_heterogeneous_job_has_one_component_per_node_group():
    omni = load_recipe(REPO / "recipes/omni_avqa.yaml")
    train, rollout = sbatch_components(render("omni_avqa"))
    assert f"--nodes={omni.cluster.train.nodes}" in train and f"--nodes={omni.cluster.rollout.nodes}" in rollout
    assert "--gpus-per-node=8" in train and "--gpus-per-node=8" in rollout
    assert "--signal=B:USR1@600" in train and "--requeue" in train  # job-wide options: first component
    assert len(sbatch_components(render("math_dapo_qwen3_4b"))) == 1  # no rollout group, no het job
    assert len(sbatch_components(render("quickstart"))) == 2  # one train and one rollout node


def test_container_wraps_every_step_but_not_the_supervisor():
    from relax_core.entrypoints.slurm_job import Allocation, JobSteps

    recipe = load_recipe(REPO / "recipes/omni_avqa.yaml", CONTAINER)
    text = render("omni_avqa_container")
    supervisor = shlex.split(text.strip().splitlines()[-1].removeprefix("exec "))
    assert supervisor == ["python3", "-m", "relax_core.entrypoints.slurm_job", str(RUN.path)]  # calls srun: host
    assert "--partition=gpu" in sbatch_components(text)[1] and "--account=proj42" in sbatch_components(text)[0]
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
