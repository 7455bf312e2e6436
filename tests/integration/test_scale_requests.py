"""What the job's supervisor asks Slurm about its scale-out jobs, and how, against the real test cluster.

`scheduler_states` answers for the jobs asked (a heterogeneous job by its
components, a finished job the controller still holds, a job it forgot);
while `squeue` fails (a busy controller) the supervisor keeps its scale-out
jobs as they were and still cancels them when the run ends. The scale-out
jobs here are the real ones the supervisor renders and submits; their
`cluster.slurm.setup` holds them in a `sleep`, so no Ray cluster is needed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from relax_core.cluster.slurm_commands import scheduler_states
from relax_core.config import load_recipe
from relax_core.entrypoints import scale_jobs
from relax_core.entrypoints.scale_jobs import ScaleJobs, slurm_duration_s
from relax_core.run_requests import ScaleJobRequests
from relax_core.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
SLEEPING = "#!/bin/bash\nsleep 600\n"
# Slurm's own words when squeue cannot reach a busy controller.
TIMED_OUT = "slurm_load_jobs error: Socket timed out on send/recv operation"


def supervisor_of(tmp_path: Path, *overrides: str) -> ScaleJobs:
    """A run's supervisor side of the scale-out jobs; each job it submits sleeps in its setup."""
    recipe = load_recipe(QUICKSTART, ["cluster.rollout.nodes=1", "cluster.rollout.cpus_per_node=1",
                                      "cluster.slurm.setup=[sleep 600]", *overrides])
    return ScaleJobs(recipe, RunDir(tmp_path / "run").create())


def squeue_failing(tmp_path: Path, times: int) -> Path:
    """A folder to put first on PATH: its `squeue` fails `times` times as Slurm's does when the controller
    does not answer, then runs the real one."""
    real, folder, count = shutil.which("squeue"), tmp_path / "bin", tmp_path / "squeue-calls"
    folder.mkdir()
    wrapper = folder / "squeue"
    wrapper.write_text(f"""#!/bin/bash
n=$(( $(cat {count} 2>/dev/null || echo 0) + 1 ))
echo $n > {count}
if (( n <= {times} )); then
    echo "{TIMED_OUT}" >&2
    exit 1
fi
exec {real} "$@"
""")
    wrapper.chmod(0o755)
    return folder


def job_record(supervisor: ScaleJobs, op_id: str) -> dict:
    return json.loads((supervisor.folder / f"{op_id}.job.json").read_text())


def test_the_states_of_the_jobs_asked_a_het_job_by_its_components_a_forgotten_job_by_none(slurm_cluster):
    het = slurm_cluster.submit("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH hetjob\n#SBATCH --nodes=1\nsleep 600\n")
    plain = slurm_cluster.submit(SLEEPING)
    done = slurm_cluster.submit("#!/bin/bash\ntrue\n")
    try:
        slurm_cluster.wait_for_state(het, ("RUNNING",))
        slurm_cluster.wait_for_state(plain, ("RUNNING",))
        slurm_cluster.wait_for_state(done, ("COMPLETED",))
        # squeue prints the het job as 'het+0' and 'het+1' (whose own job id is het+1); asked for the job,
        # the answer is the job; the finished one is still in the controller; 987654 it never knew.
        asked = [str(het), str(plain), str(done), "987654"]
        assert scheduler_states(asked) == {str(het): "RUNNING", str(plain): "RUNNING", str(done): "COMPLETED"}
        assert scheduler_states(["987654"]) == {}  # squeue exits 1 for it ("Invalid job id"): none, not a failure
    finally:
        slurm_cluster.run(["scancel", str(het), str(plain)], check=False)


def test_a_scale_out_job_is_kept_while_squeue_fails_and_cancelled_when_the_run_ends(slurm_cluster, tmp_path,
                                                                                     monkeypatch, capsys):
    supervisor = supervisor_of(tmp_path)
    monkeypatch.setattr(scale_jobs, "STATE_EVERY_S", 0.0)  # ask Slurm at every poll
    ScaleJobRequests(supervisor.run).submit("s1", 1)
    supervisor.poll()
    job_id = job_record(supervisor, "s1")["job_id"]
    assert slurm_cluster.wait_for_state(int(job_id), ("RUNNING",)) == "RUNNING"

    monkeypatch.setenv("PATH", f"{squeue_failing(tmp_path, times=3)}{os.pathsep}{os.environ['PATH']}")
    for _ in range(3):  # the controller does not answer
        supervisor.poll()
        assert "ended" not in job_record(supervisor, "s1")
        assert supervisor.jobs == {"s1": job_id}
    supervisor.poll()  # it answers again: the job runs
    assert supervisor.jobs == {"s1": job_id} and "ended" not in job_record(supervisor, "s1")
    err = capsys.readouterr().err
    assert err.count("cannot ask Slurm about the scale-out jobs") == 1 and TIMED_OUT in err  # one line, not three

    supervisor.cancel_all()  # the run ends: its scale-out job with it
    assert slurm_cluster.wait_for_state(int(job_id), ("CANCELLED",)) == "CANCELLED"
    assert job_record(supervisor, "s1")["ended"] == "cancelled"
    # A job Slurm reports gone is marked ended (here: cancelled by hand, outside the run).
    ScaleJobRequests(supervisor.run).submit("s2", 1)
    supervisor.poll()
    second = job_record(supervisor, "s2")["job_id"]
    slurm_cluster.run(["scancel", second])
    slurm_cluster.wait_for_state(int(second), ("CANCELLED",))
    supervisor.poll()
    assert supervisor.jobs == {} and job_record(supervisor, "s2")["ended"] == f"slurm job {second} cancelled"



def test_a_scale_out_job_asks_for_what_the_runs_job_has_left_and_backfill_may_start_it_sooner(
        slurm_cluster, tmp_path, monkeypatch, capsys):
    supervisor = supervisor_of(tmp_path)  # signal_before_end_s 300: at least 5 + 10 min are worth a job
    run_job = slurm_cluster.submit(SLEEPING, "--time=20")  # the run's own job, with 20 minutes
    soon_over = slurm_cluster.submit(SLEEPING, "--time=12")  # a run's job with 12 minutes: too little
    try:
        slurm_cluster.wait_for_state(run_job, ("RUNNING",))
        monkeypatch.setenv("SLURM_JOB_ID", str(run_job))  # the supervisor runs in the run's batch step
        left = slurm_duration_s(slurm_cluster.run(["squeue", "-h", "-j", str(run_job), "-o", "%L"]).stdout)
        ScaleJobRequests(supervisor.run).submit("s1", 1)
        supervisor.poll()
        job = slurm_cluster.job_info(int(job_record(supervisor, "s1")["job_id"]))
        limit = slurm_duration_s(job["TimeLimit"])
        assert left - 60 <= limit <= left <= 20 * 60 and limit % 60 == 0  # what is left, in whole minutes
        assert job["TimeMin"] == "00:15:00"
        supervisor.cancel_all()

        slurm_cluster.wait_for_state(soon_over, ("RUNNING",))
        monkeypatch.setenv("SLURM_JOB_ID", str(soon_over))
        ScaleJobRequests(supervisor.run).submit("s2", 1)
        supervisor.poll()
        error = job_record(supervisor, "s2")["error"]
        assert "ends in 12 min" in error and "needs 15 min" in error and "nothing submitted" in error
        assert supervisor.jobs == {} and not (supervisor.folder / "s2.sbatch").exists()
        assert f"relax: scale-out s2: {error}" in capsys.readouterr().err  # in the run's log: the batch step's
        names = slurm_cluster.run(["squeue", "-h", "-o", "%j"]).stdout.split()
        assert f"relax-{supervisor.recipe.name}-s2" not in names
    finally:
        slurm_cluster.run(["scancel", str(run_job), str(soon_over)], check=False)
