"""Entry points: the processes that bring up a cluster and start the controller on it.

    local_driver   the local executor's driver (`relax submit` on this machine)
    slurm_job      the Slurm batch step: Ray nodes across the allocation, then the driver step
    slurm_driver   the driver step on the head node of a Slurm job
    scale_jobs     the batch step's supervisor of the rollout-only jobs a running job grows onto
    slurm_scale    the batch step of such a scale-out job

They sit above `controller` (the training loops, which expect a running Ray
cluster) and `cluster` (what runs on each node), and are the only modules that
import both.
"""
