"""The batch step's srun steps on the real test cluster (tests/slurm_cluster.py: task/affinity binds each
step to the CPUs it was given, and the n nodes have stand-in GPUs as gres).

Each test submits a real job whose batch step is a small program driving `JobSteps`
(entrypoints/slurm_steps.py) as the supervisor does, with a probe in place of the Ray node and the driver:
the probe writes what its step got (os.sched_getaffinity, CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS) and
stays a while, so the driver's step must start beside a running Ray node step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import TERMINAL_STATES, SlurmCluster, wait_until

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"

PROBE = """\
import json, os, sys, time
out = sys.argv[1]
seen = {"cpus": sorted(os.sched_getaffinity(0)), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "step_gpus": os.environ.get("SLURM_STEP_GPUS"), "step": os.environ.get("SLURM_STEP_ID")}
with open(out + ".tmp", "w") as f:
    json.dump(seen, f)
os.replace(out + ".tmp", out)
time.sleep(float(sys.argv[2]))
"""

# The batch step: a Ray node step of the train group, then the driver's step beside it, supervised.
# `blocked` names a step started without --overlap, asking for a GPU, after a step that holds all of the
# job's CPUs and GPUs (as before Slurm 22.05 --overlap shared only CPUs while a step kept all of the job's
# GPUs and memory). GPUs block it on 20.11 too, where a running --overlap step let an --exclusive one start
# on the CPUs another step held (measured on 20.11.4).
SUPERVISOR = """\
import json, subprocess, sys, time
from pathlib import Path
from relax_core.config import load_recipe
from relax_core.entrypoints.slurm_steps import Allocation, JobSteps
from relax_core.rundir import RunDir

tmp, overrides, blocked = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
recipe = load_recipe(sys.argv[4], overrides)
run = RunDir(tmp / "run")
run.logs.mkdir(parents=True, exist_ok=True)
alloc = Allocation.from_environ(recipe.cluster.groups, recipe)
steps = JobSteps(recipe, run, alloc)
node = alloc.groups["train"][0]
if blocked != "none":
    holder = subprocess.Popen(["srun", "--exact", "--ntasks=1", "--cpus-per-task=2", f"--gres=gpu:{sys.argv[5]}",
                               "--job-name=holder", "bash", "-c", f"touch {tmp / 'held'}; exec sleep 120"])
    while not (tmp / "held").exists():  # the holder's step has its CPUs (20.11 starts steps more slowly)
        time.sleep(0.1)
    command = steps.step_command
    def step_command(group, node_, name, argv, driver=False):
        own = (name == "driver") == (blocked == "driver")
        # the blocked step: --exclusive (20.11 shares a step's CPUs without it) and a GPU the holder has
        argv_ = command(group, node_, name, argv, driver)
        swap = {"--overlap": "--exclusive", "--gres=none": "--gres=gpu:1"} if own else {}
        return [swap.get(a, a) for a in argv_]
    steps.step_command = step_command
start = time.monotonic()
steps.nodes.append(steps.srun("train", node, f"ray-{node}", ["relax_probe", str(tmp / "node.json"), "40"],
                              run.logs / f"ray-{node}.log"))
if blocked == "none":
    while not (tmp / "node.json").exists():
        time.sleep(0.1)
stay = "40" if blocked == "node" else "0"  # a driver that ends would end the supervision first
steps.driver = steps.srun("train", node, "driver", ["relax_probe", str(tmp / "driver.json"), stay],
                          run.logs / "driver-step.log", driver=True)
code, failure = steps.supervise()
result = {"code": code, "failure": failure, "seconds": time.monotonic() - start,
          "node_running": steps.nodes[0].proc.poll() is None}
steps.stop()
(tmp / "result.json").write_text(json.dumps(result))
"""


def run_supervisor(cluster: SlurmCluster, tmp_path: Path, overrides: list[str], blocked: str,
                   sbatch: list[str]) -> dict:
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "relax_probe.py").write_text(PROBE)
    program = tmp_path / "supervisor.py"
    program.write_text(SUPERVISOR)
    script = (f"#!/bin/bash\nexport PYTHONPATH={tmp_path / 'probe'}:{REPO}\n"
              f"exec {sys.executable} {program} {tmp_path} '{json.dumps(overrides)}' {blocked} {QUICKSTART} "
              f"{cluster.node_gpus}\n")
    job = cluster.submit(script, "--nodes=1", "--cpus-per-task=2", f"--output={tmp_path / 'job.out'}", *sbatch)
    result = tmp_path / "result.json"
    done = wait_until(lambda: result.exists() or cluster.job_state(job) in TERMINAL_STATES, 90, 0.2)
    done = result.exists()
    assert done, f"job {job}: no result\n{(tmp_path / 'job.out').read_text(errors='replace')}\n" + "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')}" for p in (tmp_path / "run" / "logs").glob("*"))
    return json.loads(result.read_text())


def test_a_ray_node_step_gets_its_groups_cpus_and_gpus_and_the_driver_starts_beside_it(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    gpus = getattr(slurm_cluster, "node_gpus", 0)
    gpu_type = getattr(slurm_cluster, "node_gpu_type", None)
    overrides = ["cluster.rollout.nodes=0", "cluster.train.cpus_per_node=2", f"cluster.train.gpus_per_node={gpus}"]
    overrides += [f"cluster.train.gpu_type={gpu_type}"] if gpu_type else []
    gres = [f"--gres=gpu:{gpu_type}:{gpus}"] if gpus else []
    # --mem=0: all of the node's memory to the job, as on GPU nodes; the test cluster tracks memory
    # (CR_Core_Memory). Before 22.05 a step without --mem=0 would hold all of it and the driver would wait.
    result = run_supervisor(slurm_cluster, tmp_path, overrides, "none", [*gres, "--mem=0"])
    node, driver = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("node", "driver"))
    print(f"Ray node step: {node}\ndriver step: {driver}")
    assert result["code"] == 0 and result["failure"] is None and result["node_running"], result
    assert len(node["cpus"]) == 2  # cluster.train.cpus_per_node, not the one CPU a plain step is bound to
    assert len(driver["cpus"]) == 1
    if gpus:
        assert node["cuda"] == ",".join(str(i) for i in range(gpus)) and node["step_gpus"], node
        assert not driver["cuda"] and not driver["step_gpus"], driver  # the driver holds no GPU


# srun prints "step creation temporarily disabled" only after its first wait for the step (60 s or more:
# src/srun/launch.c, step_wait), so the failure here may quote nothing of srun's yet.
@pytest.mark.parametrize("blocked", ["driver", pytest.param("node", marks=pytest.mark.full(
    covered_by="tests/integration/test_slurm_steps.py::test_a_step_slurm_does_not_start_fails_the_job_within_the_startup_timeout_naming_it[driver]"))])
def test_a_step_slurm_does_not_start_fails_the_job_within_the_startup_timeout_naming_it(
        slurm_cluster: SlurmCluster, tmp_path: Path, blocked: str) -> None:
    started = time.monotonic()
    result = run_supervisor(slurm_cluster, tmp_path, ["cluster.rollout.nodes=0", "cluster.train.cpus_per_node=1",
                                                      "cluster.slurm.startup_timeout_s=5"], blocked,
                            [f"--gres=gpu:{slurm_cluster.node_gpus}"])
    print(f"{blocked}: {result}")
    assert result["code"] is None and result["seconds"] < 5 + 10, result
    failure = result["failure"]
    what = "the driver step" if blocked == "driver" else "the Ray node step ray-"
    assert f"Slurm did not start {what}" in failure and "on node n" in failure, failure
    assert "cluster.slurm.startup_timeout_s" in failure and "srun said:" in failure, failure
    assert str(tmp_path / "run" / "logs") in failure, failure
    assert time.monotonic() - started < 60


# The batch step of the signal tests: the supervisor's own signal handling and ending (slurm_job.py) around a
# driver stand-in that has checkpointed step 1 (the run made progress) and, on USR1, stops as the driver does.
# A requeued job's second start only records that it ran.
SIGNALLED = """\
import os, sys
from pathlib import Path
from relax_core.config import load_recipe
from relax_core.entrypoints.slurm_job import DRIVER_STOPPED, finish, stop_on_signals
from relax_core.entrypoints.slurm_steps import Allocation, JobSteps
from relax_core.rundir import RunDir

tmp = Path(sys.argv[1])
run = RunDir(tmp / "run")
if os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
    with open(tmp / "restarted", "a") as f:  # one line per restart: Slurm 24.11 requeues a preempted job twice
        f.write(os.environ["SLURM_RESTART_COUNT"] + "\\n")
    sys.exit(0)
run.logs.mkdir(parents=True, exist_ok=True)
recipe = load_recipe(sys.argv[2], ["cluster.rollout.nodes=0", "cluster.train.cpus_per_node=1"])
alloc = Allocation.from_environ(recipe.cluster.groups, recipe)
run.update_state(state="running", job_id=str(alloc.job_id), checkpoint_step=0)
steps = JobSteps(recipe, run, alloc)
signalled = stop_on_signals(run, steps)
stand_in = ("import signal, sys, time\\n"
            "from pathlib import Path\\n"
            "from relax_core.rundir import RunDir\\n"
            "run = RunDir(Path(sys.argv[1]))\\n"
            "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(%d))\\n"
            "run.update_state(checkpoint_step=1)\\n"
            "time.sleep(300)\\n" % DRIVER_STOPPED)
(tmp / "probe" / "driver_stand_in.py").write_text(stand_in)
steps.driver = steps.srun("train", alloc.groups["train"][0], "driver", ["driver_stand_in", str(run.path)],
                          run.logs / "driver-step.log", driver=True)
(tmp / "ready").write_text("")
code, failure = steps.supervise()
steps.stop()
sys.exit(finish(run, alloc, code, failure, 0, bool(signalled)))
"""


def start_signalled_job(cluster: SlurmCluster, tmp_path: Path, *sbatch: str) -> int:
    (tmp_path / "probe").mkdir()
    program = tmp_path / "signalled.py"
    program.write_text(SIGNALLED)
    script = (f"#!/bin/bash\nexport PYTHONPATH={tmp_path / 'probe'}:{REPO}\n"
              f"exec {sys.executable} {program} {tmp_path} {QUICKSTART}\n")
    job = cluster.submit(script, "--nodes=1", "--cpus-per-task=2", "--requeue", f"--output={tmp_path / 'job.out'}",
                         *sbatch)
    run = tmp_path / "run" / "run.json"
    progressed = wait_until(lambda: (tmp_path / "ready").exists() and run.exists()
                            and json.loads(run.read_text()).get("checkpoint_step") == 1, 60, 0.2)
    assert progressed, (tmp_path / "job.out").read_text(errors="replace")
    return job


def test_sigterm_from_slurm_requeues_a_job_that_made_progress(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """SIGTERM to the batch step and every step, as Slurm's time limit and an administrator's scancel send it:
    the run is requeued (it made progress) and its job starts again."""
    job = start_signalled_job(slurm_cluster, tmp_path)
    slurm_cluster.run(["scancel", "--signal=TERM", "--full", str(job)])
    assert wait_until((tmp_path / "restarted").exists, 60, 0.2), (tmp_path / "job.out").read_text(errors="replace")
    assert (tmp_path / "restarted").read_text().split()[0] == "1"
    assert json.loads((tmp_path / "run" / "run.json").read_text())["state"] == "requeued"


def test_the_users_cancel_is_never_requeued(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """`relax cancel` (SlurmExecutor.cancel) of a run that made progress: the job ends cancelled, not requeued."""
    from relax_core.launch.slurm import SlurmExecutor
    from relax_core.rundir import RunDir

    job = start_signalled_job(slurm_cluster, tmp_path)
    run = RunDir(tmp_path / "run")
    SlurmExecutor().cancel(run, run.read_state())
    slurm_cluster.wait_for_state(job, ("CANCELLED",), timeout=30)
    time.sleep(slurm_cluster.cred_expire + 5)  # a requeued job would start again by now
    assert not (tmp_path / "restarted").exists() and slurm_cluster.job_state(job) == "CANCELLED"
    assert json.loads((tmp_path / "run" / "run.json").read_text())["state"] == "cancelled"


def test_a_preempted_job_is_requeued_at_once(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """A site's preemption (PreemptMode=REQUEUE, GraceTime): SIGTERM reaches the steps, not the batch step; the
    steps end, and the batch step, seeing Slurm's PreemptTime, requeues the job instead of failing the run (and
    before the grace time is over: a job that ended by then is not requeued by Slurm)."""
    partition = getattr(slurm_cluster, "preemptible_partition", None)
    assert partition, "tests/slurm_cluster.py has no preemption partition"
    job = start_signalled_job(slurm_cluster, tmp_path, f"--partition={partition}", "--nodelist=n1")
    preempted = time.monotonic()
    slurm_cluster.preempt("n1")
    assert wait_until((tmp_path / "restarted").exists, 90, 0.2), (tmp_path / "job.out").read_text(errors="replace")
    print(f"preempted -> started again {time.monotonic() - preempted:.1f}s later")
    assert json.loads((tmp_path / "run" / "run.json").read_text())["state"] == "requeued"
    # Relax requeued it once: its first restart is restart 1 (Slurm 24.11 requeues it once more when that
    # restart ends; a run that completed meanwhile is left alone, test_a_restart_of_a_completed_run_...).
    assert (tmp_path / "restarted").read_text().split()[0] == "1"
    assert int(slurm_cluster.job_info(job)["Restarts"]) >= 1


def test_a_restart_of_a_completed_run_leaves_it_completed(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """A job that starts again after its run completed (Slurm 24.11 requeues a preempted job once more when its
    next run ends; an administrator's `scontrol requeue`) ends at once: nothing starts, run.json is unchanged."""
    from relax_core.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.update_state(state="completed", job_id="7", checkpoint_step=150, finished="2026-12-05T10:00:00")
    before = (run.path / "run.json").read_bytes()
    out = tmp_path / "job.out"
    script = (f"#!/bin/bash\nexport PYTHONPATH={REPO}\n"
              f"exec {sys.executable} -m relax_core.entrypoints.slurm_job {run.path}\n")
    job = slurm_cluster.submit(script, "--nodes=1", f"--output={out}")
    assert slurm_cluster.wait_for_state(job) == "COMPLETED", out.read_text(errors="replace")
    assert (run.path / "run.json").read_bytes() == before
    assert "already completed" in out.read_text()
    assert not run.logs.exists() or not any(run.logs.iterdir())
