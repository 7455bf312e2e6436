"""What the job's supervisor asks Slurm about its scale-out jobs, and how, against the real test cluster.

`scheduler_states` answers for the jobs asked (a heterogeneous job by its
components, a finished job the controller still holds, a job it forgot);
while `squeue` fails (a busy controller) the supervisor keeps its scale-out
jobs as they were and still cancels them when the run ends. The scale-out
jobs here are the real ones the supervisor renders and submits; their
`cluster.slurm.setup` holds them in a `sleep`, so no Ray cluster is needed.
"""

from __future__ import annotations

from relax_core.launch.slurm import scheduler_states

SLEEPING = "#!/bin/bash\nsleep 600\n"


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
