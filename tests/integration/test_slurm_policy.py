"""What a site's Slurm asks of the job script, against the real test cluster (tests/slurm_cluster.py).

GPUs are asked for as generic resources (`--gres=gpu[:type]:N`, which every
select plugin takes), of a named type or not, and a type the partition lacks
is refused naming `cluster.<group>.gpu_type` and the types it has; a group may
sit in another partition (its component lands there); groups of one node shape
are one plain job of all their nodes, not a heterogeneous one.

The cluster: partition debug (n1..n4: 2 CPUs, gres gpu:tesla:2) and partition
gpu (g1, g2: 64 CPUs, untyped gres gpu:8). Jobs that are submitted run the
rendered `#SBATCH` lines with `sleep` in place of the launcher: only where
Slurm puts them is under test here (test_slurm_launch.py runs the launcher).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from relax_runs import relax
from slurm_cluster import parse_scontrol_record
from test_slurm_launch import final_status, logs_of, submit

from relax_core.config import load_recipe
from relax_core.errors import RecipeError
from relax_core.launch import slurm
from relax_core.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
# Two GPUs of each debug node (gres gpu:tesla:2) for the training group.
TRAIN_GPUS = ["cluster.train.gpus_per_node=2", "cluster.slurm.partition=debug"]


def write_script(tmp_path: Path, *overrides: str, payload: str | None = None) -> Path:
    """The job script `relax submit` would write for the quick start with `overrides`; with `payload`, that
    command instead of the launcher."""
    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True, exist_ok=True)
    text = slurm.render_job_script(load_recipe(QUICKSTART, list(overrides)), run)
    if payload:
        lines = text.rstrip("\n").splitlines()
        text = "\n".join([*lines[:-1], f"exec {payload}", ""])
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    return script


def components(cluster, job_id: int) -> list[dict[str, str]]:
    """`scontrol show job` of each component of the job (one for a plain job)."""
    out = cluster.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
    return [parse_scontrol_record(line) for line in out.splitlines() if line.strip()]


def running(cluster, job_id: int) -> list[dict[str, str]]:
    cluster.wait_for_state(job_id, ("RUNNING",), timeout=30)
    return components(cluster, job_id)


# ------------------------------------------------------------------ GPUs as gres
@pytest.mark.parametrize("overrides", [
    [*TRAIN_GPUS, "cluster.train.gpu_type=tesla"],  # typed gres on the debug nodes
    [*TRAIN_GPUS],  # any type
    ["cluster.train.gpus_per_node=8", "cluster.slurm.partition=gpu"],  # untyped gres gpu:8 on g1, g2
], ids=["typed", "any-type", "untyped-partition"])
def test_slurm_accepts_the_gpu_request_with_and_without_a_type(slurm_cluster, tmp_path, overrides):
    script = write_script(tmp_path, *overrides)
    assert "#SBATCH --gres=gpu:" in script.read_text() and "--gpus" not in script.read_text()
    slurm.test_only(script)  # raises RecipeError with Slurm's reason if Slurm refuses


def test_the_gres_request_gives_the_job_its_gpus(slurm_cluster, tmp_path):
    """Submitted, the training node gets its two tesla GPUs (Slurm's gres, the stand-in device files)."""
    script = write_script(tmp_path, *TRAIN_GPUS, "cluster.train.gpu_type=tesla", "cluster.slurm.layout=het",
                          payload="sleep 60")
    job_id = slurm_cluster.submit(script.read_text())
    try:
        train = running(slurm_cluster, job_id)[0]
        detail = slurm_cluster.run(["scontrol", "-o", "-d", "show", "job", train["JobId"]]).stdout
        assert train["Partition"] == "debug" and "GRES=gpu:tesla:2(IDX:0-1)" in detail, detail
    finally:
        slurm_cluster.run(["scancel", str(job_id)], check=False)


@pytest.mark.parametrize(("overrides", "words"), [
    ([*TRAIN_GPUS, "cluster.train.gpu_type=a100"],
     ["cluster.train.gpu_type", "partition debug has no GPUs of type a100", "its GPU types are tesla"]),
    (["cluster.train.gpus_per_node=8", "cluster.slurm.partition=gpu", "cluster.train.gpu_type=a100"],
     ["cluster.train.gpu_type", "partition gpu has no GPUs of type a100", "its GPUs have no type"]),
    ([*TRAIN_GPUS, "cluster.train.gpus_per_node=4", "cluster.train.gpu_type=tesla"],
     ["cluster.train.gpus_per_node", "a node of partition debug has at most 2 GPUs of type tesla"]),
], ids=["type-missing", "untyped-partition", "too-many"])
def test_a_gpu_request_the_partition_cannot_meet_is_refused_naming_the_field(slurm_cluster, tmp_path, overrides,
                                                                            words):
    before = set(slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split())
    proc = relax("submit", str(QUICKSTART), *overrides, "--executor", "slurm", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    message = " ".join(proc.stderr.split())
    for word in words:
        assert word in message, message
    assert "no GPUs (gres)" not in message  # not the old catch-all
    assert list(tmp_path.iterdir()) == []
    assert set(slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()) <= before  # nothing submitted


# ------------------------------------------------------ per-group Slurm settings
def test_a_rollout_group_in_another_partition_lands_there(slurm_cluster, tmp_path):
    overrides = ["cluster.slurm.partition=debug", "cluster.rollout.partition=gpu"]
    slurm.test_only(write_script(tmp_path, *overrides))
    job_id = slurm_cluster.submit(write_script(tmp_path, *overrides, payload="sleep 60").read_text())
    try:
        train, rollout = running(slurm_cluster, job_id)
        assert (train["Partition"], rollout["Partition"]) == ("debug", "gpu")
        assert train["NodeList"] in slurm_cluster.node_names and rollout["NodeList"] in slurm_cluster.gpu_node_names
    finally:
        slurm_cluster.run(["scancel", str(job_id)], check=False)


# ------------------------------------------------------------------ layout
def test_groups_of_one_shape_run_as_one_plain_job(slurm_cluster, tmp_path):
    """The quick start's training and rollout nodes ask for the same: one job of 2 nodes, no het job."""
    script = write_script(tmp_path, "cluster.slurm.partition=debug", payload="sleep 60")
    slurm.test_only(script)
    job_id = slurm_cluster.submit(script.read_text())
    try:
        (job,) = running(slurm_cluster, job_id)
        assert "HetJobId" not in job and job["NumNodes"] == "2" and job["Partition"] == "debug", job
    finally:
        slurm_cluster.run(["scancel", str(job_id)], check=False)


@pytest.mark.full(covered_by="tests/integration/test_hub_cache.py::test_a_hub_model_and_data_set_run_on_compute_nodes_from_what_the_login_node_fetched")
def test_the_quick_start_runs_to_completion_on_one_plain_job(slurm_cluster, tmp_path):
    """Both groups on 2-CPU nodes: one plain 2-node job, which the batch step splits (n1 train, n2 rollout)."""
    job_id = submit(tmp_path, "runs/plain", "cluster.train.cpus_per_node=2", "train.steps=4")
    run = tmp_path / "runs" / "plain"
    final = final_status(tmp_path, "runs/plain", 300, "the job to finish")
    assert final["state"] == "completed" and final["step"] == 4, logs_of(run)
    (job,) = components(slurm_cluster, int(job_id))
    assert "HetJobId" not in job and job["NumNodes"] == "2", job
    assert json.loads((run / "run.json").read_text())["nodes"] == {"train": ["n1"], "rollout": ["n2"]}
    assert "all 2 nodes joined" in (run / "logs" / "driver.log").read_text()


def test_single_layout_with_groups_of_different_shapes_is_refused_before_submission(slurm_cluster, tmp_path):
    proc = relax("submit", str(QUICKSTART), "cluster.slurm.layout=single", "cluster.rollout.cpus_per_node=2",
                 "--executor", "slurm", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cluster.rollout.cpus_per_node is 2 but cluster.train.cpus_per_node is 1" in proc.stderr
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RecipeError):
        load_recipe(QUICKSTART, ["cluster.slurm.layout=single", "cluster.rollout.cpus_per_node=2"])
