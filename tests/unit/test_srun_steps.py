"""What each srun step of a Relax Slurm job asks for, how a plain (non-het) job is split into the
recipe's groups, and the order the batch step ends things in (entrypoints/slurm_steps.py, slurm_job.py).

The real-Slurm tests (the CPUs and GPUs a step gets, a step Slurm never starts) are in
tests/integration/test_slurm_steps.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from relax_core.config import load_recipe
from relax_core.entrypoints.slurm_job import end_steps
from relax_core.entrypoints.slurm_steps import Allocation, JobSteps, srun_env
from relax_core.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
RUN = RunDir(Path("/scratch/runs/r1"))


def options(command: list[str]) -> list[str]:
    """srun's own options (up to the command it runs)."""
    end = next(i for i, arg in enumerate(command) if i and not arg.startswith("-"))
    return command[1:end]


def test_a_ray_node_step_asks_for_its_groups_cores_gpus_and_the_jobs_memory():
    recipe = load_recipe(REPO / "recipes/omni_avqa.yaml")  # 8 GPUs, 64 cores a node
    steps = JobSteps(recipe, RUN, Allocation(7, 0, {"train": ["g1"], "rollout": ["g2"]}))
    node = options(steps.step_command("rollout", "g2", "ray-g2", ["relax_core.cluster.node"]))
    assert node == ["--het-group=1", "--nodes=1", "--ntasks=1", "--nodelist=g2", "--overlap",
                    "--cpus-per-task=64", "--exact", "--gres=gpu:8", "--mem=0", "--job-name=ray-g2"]


def test_the_driver_step_takes_one_cpu_no_gpu_and_reserves_no_memory():
    recipe = load_recipe(REPO / "recipes/omni_avqa.yaml")
    steps = JobSteps(recipe, RUN, Allocation(7, 0, {"train": ["g1"], "rollout": ["g2"]}))
    driver = options(steps.step_command("train", "g1", "driver", ["relax_core.entrypoints.slurm_driver"],
                                        driver=True))
    assert driver == ["--het-group=0", "--nodes=1", "--ntasks=1", "--nodelist=g1", "--overlap",
                      "--cpus-per-task=1", "--exact", "--gres=none", "--mem=0", "--overcommit",
                      "--job-name=driver"]


def test_a_cpu_group_asks_for_no_gres_and_a_typed_gpu_group_names_its_type():
    recipe = load_recipe(REPO / "recipes/quickstart.yaml", ["cluster.rollout.nodes=1",
                                                            "cluster.rollout.cpus_per_node=3"])
    steps = JobSteps(recipe, RUN, Allocation(7, 0, {"train": ["n1"], "rollout": ["n2"]}))
    assert options(steps.step_command("rollout", "n2", "ray-n2", ["x"]))[5:9] == [
        "--cpus-per-task=3", "--exact", "--gres=none", "--mem=0"]
    typed = load_recipe(REPO / "recipes/omni_avqa.yaml", ["cluster.train.gpu_type=a100"])
    steps = JobSteps(typed, RUN, Allocation(7, 0, {"train": ["g1"], "rollout": ["g2"]}))
    assert "--gres=gpu:a100:8" in options(steps.step_command("train", "g1", "ray-g1", ["x"]))


def test_srun_does_not_inherit_the_jobs_gpu_and_memory_options():
    batch = {"SLURM_JOB_ID": "7", "SLURM_GPUS_PER_NODE": "8", "SLURM_GPUS_PER_NODE_HET_GROUP_0": "8",
             "SLURM_MEM_PER_NODE": "983040", "SLURM_MEM_PER_CPU": "4000", "SLURM_CPUS_PER_TASK": "64", "PATH": "/bin",
             "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert srun_env(batch) == {"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "64", "PATH": "/bin"}


@pytest.fixture
def slurm_conf(tmp_path, monkeypatch):
    """A slurm.conf for `scontrol show hostnames` (which needs one, but no controller)."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=relax-unit\nSlurmctldHost=localhost\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    for key in ("SLURM_HET_SIZE", "SLURM_JOB_NODELIST_HET_GROUP_0", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    return conf


def test_a_plain_job_is_split_by_the_groups_node_counts_and_its_steps_name_no_het_group(slurm_conf, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08],gpu11")
    recipe = load_recipe(REPO / "recipes/omni_avqa.yaml", ["cluster.rollout.nodes=2"])
    alloc = Allocation.from_environ(recipe.cluster.groups, recipe)
    assert alloc.groups == {"train": ["gpu07"], "rollout": ["gpu08", "gpu11"]} and not alloc.het
    assert alloc.nodes()[0] == ("gpu07", "train", 0)
    command = JobSteps(recipe, RUN, alloc).step_command("rollout", "gpu11", "ray-gpu11", ["x"])
    assert not [arg for arg in command if arg.startswith("--het-group")]
    assert "--nodelist=gpu11" in command


def test_a_het_job_is_read_per_component(slurm_conf, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08,11]")
    monkeypatch.setenv("SLURM_JOB_NODELIST_HET_GROUP_0", "gpu07")
    monkeypatch.setenv("SLURM_JOB_NODELIST_HET_GROUP_1", "gpu[08,11]")
    recipe = load_recipe(REPO / "recipes/omni_avqa.yaml", ["cluster.rollout.nodes=2"])
    alloc = Allocation.from_environ(recipe.cluster.groups, recipe)
    assert (alloc.job_id, alloc.restart_count, alloc.het) == (42, 2, True)
    assert alloc.groups == {"train": ["gpu07"], "rollout": ["gpu08", "gpu11"]}
    assert "--het-group=1" in JobSteps(recipe, RUN, alloc).step_command("rollout", "gpu11", "r", ["x"])


def test_a_node_slurm_gives_to_two_het_groups_is_refused_naming_it(slurm_conf, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST_HET_GROUP_0", "gpu07")
    monkeypatch.setenv("SLURM_JOB_NODELIST_HET_GROUP_1", "gpu[07-08]")
    recipe = load_recipe(REPO / "recipes/omni_avqa.yaml", ["cluster.rollout.nodes=2"])
    why = Allocation.from_environ(recipe.cluster.groups, recipe).sharing()
    assert why is not None and why.startswith("Slurm gave node gpu07 (train and rollout) to two het groups")
    assert "cluster.slurm.layout: single" in why
    monkeypatch.setenv("SLURM_JOB_NODELIST_HET_GROUP_1", "gpu[08,11]")
    assert Allocation.from_environ(recipe.cluster.groups, recipe).sharing() is None


def test_the_scale_out_jobs_are_cancelled_before_the_steps_are_stopped():
    """scancel frees a scale-out job's nodes at once; stopping this job's steps may take each its grace time."""
    order: list[str] = []

    class Steps:
        def stop(self):
            order.append("steps stopped")

    class ScaleOut:
        def cancel_all(self):
            order.append("scale-out jobs cancelled")

    end_steps(Steps(), ScaleOut())
    assert order == ["scale-out jobs cancelled", "steps stopped"]


def test_relax_cancel_marks_the_run_before_scancel(tmp_path, monkeypatch):
    """The batch step reads the mark on scancel's SIGTERM, so the user's cancel is never requeued."""
    from relax_core.launch.slurm import SlurmExecutor

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scancel = bin_dir / "scancel"  # records run.json as scancel's SIGTERM would find it
    scancel.write_text(f"#!/bin/sh\ncp {tmp_path / 'run' / 'run.json'} {tmp_path / 'seen.json'}\n")
    scancel.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.update_state(state="running", job_id="42")
    SlurmExecutor().cancel(run, run.read_state())
    assert json.loads((tmp_path / "seen.json").read_text())["cancel_requested"]
    assert run.read_state()["state"] == "cancelled"
