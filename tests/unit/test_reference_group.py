"""`cluster.reference`: a node group of its own for the reference service of `fully_async`.

What the group changes before anything runs: the recipes that may have one,
the Ray resource its nodes advertise (`relax_reference`, which the reference
service places its workers with), its cores on one machine, and its het
component (het group 2) in the Slurm job with the srun of its node's Ray
worker. The real-Slurm test that its node joins Ray is in
tests/integration/test_slurm_launch.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_job_script import GOLDEN, RUN, sbatch_components

from relax_core.cluster.node import node_resources, ray_start_command
from relax_core.cluster.placement import REFERENCE_RESOURCE, local_cpu_sets, local_slots, node_resource
from relax_core.cluster.ports import block_ports
from relax_core.config import load_recipe
from relax_core.entrypoints.slurm_job import Allocation, JobSteps
from relax_core.errors import RecipeError
from relax_core.launch.executors import executor_named
from relax_core.launch.preflight import preflight
from relax_core.launch.slurm import render_job_script

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
# fully_async with a KL term: the one recipe shape a reference group serves
WITH_REFERENCE = ["mode=fully_async", "algorithm.kl.coef=0.01", "cluster.reference.nodes=1",
                  "cluster.reference.cpus_per_node=1"]


def reference_recipe(*overrides: str):
    return load_recipe(QUICKSTART, [*WITH_REFERENCE, *overrides])


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("mode", ["colocate", "hybrid"])
def test_a_reference_group_outside_fully_async_is_refused(mode):
    with pytest.raises(RecipeError, match=f"cluster.reference.nodes: mode {mode} computes the reference log-probs "
                                          "inside the trainer's processes, so a reference node group "
                                          r"needs mode=fully_async \(or set cluster.reference.nodes=0\)"):
        reference_recipe(f"mode={mode}")


def test_a_reference_group_without_a_reference_model_is_refused():
    with pytest.raises(RecipeError, match="cluster.reference.nodes: algorithm grpo with algorithm.kl.coef=0 uses "
                                          "no reference model, so a reference node group has "
                                          r"nothing to run \(set algorithm.kl.coef above 0"):
        reference_recipe("algorithm.kl.coef=0")
    assert reference_recipe().cluster.groups == ["train", "rollout", "reference"]  # with the KL term it is accepted


def test_the_refusal_exits_2_naming_the_field(tmp_path):
    env = os.environ | {"COLUMNS": "200", "NO_COLOR": "1"}
    proc = subprocess.run([sys.executable, "-m", "relax_cli.main", "submit", str(QUICKSTART), "--dry-run",
                           "--executor", "local", "cluster.reference.nodes=1"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cluster.reference.nodes" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_no_reference_group_by_default():
    recipe = load_recipe(QUICKSTART, ["mode=fully_async", "algorithm.kl.coef=0.01", "cluster.slurm.layout=het"])
    assert recipe.cluster.reference.nodes == 0 and recipe.cluster.groups == ["train", "rollout"]
    assert REFERENCE_RESOURCE not in local_slots(recipe)
    assert len(sbatch_components(render_job_script(recipe, RUN, python="python3"))) == 2


def test_the_local_executor_runs_a_reference_group_of_one_node_only():
    preflight(reference_recipe(), QUICKSTART, executor_named("local"))  # raises if refused
    with pytest.raises(RecipeError, match="cluster.reference.nodes: the local executor runs each node group"):
        preflight(reference_recipe("cluster.reference.nodes=2"), QUICKSTART, executor_named("local"))


# ----------------------------------------------------------------- resources
def test_only_the_reference_nodes_advertise_the_reference_resource():
    recipe = reference_recipe()
    assert REFERENCE_RESOURCE == "relax_reference"
    assert node_resources(recipe, "reference", "n3") == {node_resource("n3"): 1, REFERENCE_RESOURCE: 1}
    assert REFERENCE_RESOURCE not in node_resources(recipe, "train", "n1")
    assert REFERENCE_RESOURCE not in node_resources(recipe, "rollout", "n2")
    # the engines stay on the rollout group, the trainer ranks on the training group
    assert set(node_resources(recipe, "train", "n1")) == {node_resource("n1"), "relax_train"}
    assert set(node_resources(recipe, "rollout", "n2")) == {node_resource("n2"), "relax_rollout"}


def test_the_reference_nodes_ray_start_carries_its_resource_and_cores():
    recipe = reference_recipe("cluster.reference.cpus_per_node=2")
    command = ray_start_command(recipe, RUN, group="reference", index=2, name="n3", address="10.0.0.3", job_id=7,
                                head_address="10.0.0.1:6380", ports=block_ports(3))
    flags = dict(arg.split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)
    assert json.loads(flags["--resources"]) == {node_resource("n3"): 1, REFERENCE_RESOURCE: 1}
    assert flags["--num-cpus"] == "2" and flags["--num-gpus"] == "0" and flags["--address"] == "10.0.0.1:6380"


def test_the_local_ray_node_has_one_reference_slot():
    # relax_rollout: one engine slot per core (the recipe's engine and what a scale-out may add here)
    assert local_slots(reference_recipe()) == {"relax_train": 1, "relax_rollout": os.cpu_count(), REFERENCE_RESOURCE: 1}


@pytest.mark.parametrize("cores, expected", [
    (5, {"train": [0], "rollout": [1], "reference": [2, 3]}),  # train 1 + rollout 1 + reference 2 fit
    (3, {"train": [0], "rollout": [1]}),                       # the reference's 2 do not: it is left unpinned
    (1, {}),                                                   # train and rollout do not fit either
])
def test_the_reference_group_gets_its_own_cores_after_train_and_rollout(monkeypatch, cores, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))  # a machine of that many cores
    assert local_cpu_sets(reference_recipe("cluster.reference.cpus_per_node=2")) == expected


# --------------------------------------------------------------------- slurm
def test_the_job_script_has_the_reference_group_as_het_group_2():
    text = render_job_script(reference_recipe("cluster.reference.cpus_per_node=2", "cluster.reference.mem=8G"),
                             RUN, python="python3")
    golden = GOLDEN / "quickstart_reference.sbatch"
    if os.environ.get("RELAX_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
    train, rollout, reference = sbatch_components(text)
    assert "# het group 2: reference nodes" in text
    assert reference == ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2", "--mem=8G", "--time=04:00:00"]
    assert "--requeue" in train and "--requeue" not in rollout + reference  # job-wide options: first component


def test_the_batch_step_starts_the_reference_nodes_ray_worker_in_het_group_2():
    steps = JobSteps(reference_recipe(), RUN, Allocation(7, 0, {"train": ["n1"], "rollout": ["n2"],
                                                                "reference": ["n3"]}))
    assert steps.alloc.nodes() == [("n1", "train", 0), ("n2", "rollout", 1), ("n3", "reference", 2)]
    started = []
    steps.srun = lambda group, node, job_name, argv, log_path: started.append(
        (steps.step_command(group, node, job_name, argv), argv))
    steps.start_nodes("10.0.0.1:6380", 3)
    command, argv = started[2]
    assert command[:6] == ["srun", "--het-group=2", "--nodes=1", "--ntasks=1", "--nodelist=n3", "--overlap"]
    assert argv[:3] == ["relax_core.cluster.node", str(RUN.path), "--group"] and argv[3:6] == [
        "reference", "--index", "2"]
    assert [c[:2] for c, _ in started[:2]] == [["srun", "--het-group=0"], ["srun", "--het-group=1"]]


@pytest.mark.parametrize(("overrides", "workers"), [
    (WITH_REFERENCE, 1),  # one per node of a CPU group
    ([*WITH_REFERENCE, "cluster.reference.nodes=2", "cluster.reference.gpus_per_node=4"], 8),  # one per GPU
    (["mode=fully_async", "algorithm.kl.coef=0.01"], 0),  # no group: the trainer ranks hold the reference
])
def test_reference_workers_run_only_on_a_group_of_their_own_one_per_gpu(overrides, workers):
    from relax_core.config.modes import reference_service, reference_workers
    from relax_core.train.settings import trainer_config

    recipe = load_recipe(QUICKSTART, overrides)
    assert reference_workers(recipe) == workers
    assert reference_service(recipe) is (workers > 0)
    assert trainer_config(recipe).reference_service is (workers > 0)  # else the trainer loads the reference


@pytest.mark.parametrize("mode", ["fully_async", "hybrid", "colocate"])
def test_logp_old_and_the_critic_are_the_trainers_own_in_every_mode(mode):
    """What depends on the weights a step starts from is computed by the trainer ranks: no service for it."""
    from relax_core.services import launch
    from relax_core.train.settings import trainer_config

    recipe = load_recipe(QUICKSTART, [f"mode={mode}", "algorithm.name=ppo", "algorithm.critic.lr=1e-3",
                                      "train.ppo_epochs=2"])
    assert not hasattr(launch, "actor_forward_service") and not hasattr(launch, "critic_service")
    assert trainer_config(recipe).critic_lr == 1e-3  # the trainer builds the critic


FSDP = REPO / "recipes" / "math_dapo_qwen3_4b_fsdp.yaml"
GPU_REFERENCE = ["mode=fully_async", "cluster.rollout.nodes=1", "algorithm.kl.coef=0.01", "cluster.reference.nodes=1"]


def test_a_gpu_recipes_reference_workers_get_a_gpu_each_and_the_plan_shows_them():
    from relax_core.launch.plan import plan_lines

    recipe = load_recipe(FSDP, [*GPU_REFERENCE, "cluster.reference.gpus_per_node=2"])
    from relax_core.launch.preflight import unavailable_features

    assert unavailable_features(recipe) == []  # was refused: the reference service on GPUs had no code
    lines = plan_lines(recipe, "slurm")
    assert "  cluster.reference: 1 node x 2 GPUs = 2 GPUs: 2 reference workers (one per GPU)" in lines
    workers = [line for line in lines if "reference worker" in line and line.startswith("  reference[")]
    assert [line.split()[1:3] for line in workers] == [["GPU", "0"], ["GPU", "1"]]
    assert all("with the reference model" not in line for line in lines)  # the trainer ranks do not hold it


def test_a_gpu_recipes_reference_group_without_gpus_is_refused_naming_the_field():
    with pytest.raises(RecipeError, match="cluster.reference.gpus_per_node: the reference workers would run the "
                                          "model on the CPUs of a GPU recipe"):
        load_recipe(FSDP, GPU_REFERENCE)
    lines_in_trainer = load_recipe(FSDP, ["mode=fully_async", "cluster.rollout.nodes=1", "algorithm.kl.coef=0.01"])
    from relax_core.launch.plan import plan_lines

    assert "trainer rank 0 (torch, with the critic and the reference model)" in "\n".join(
        plan_lines(lines_in_trainer, "slurm"))
