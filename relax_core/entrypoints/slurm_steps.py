"""The `srun` steps of a Relax Slurm job, and how the batch step watches them (`slurm_job.py`).

Every step states what it needs, so no site default and no Slurm version decides it:

    a Ray node   --cpus-per-task=<group's cpus_per_node> --gres=gpu[:<type>]:<gpus_per_node> (or none) --mem=0
    the driver   --cpus-per-task=1 --gres=none --mem=0 --overcommit

all with `--overlap`, so the driver and the head's Ray node share node 0. Why each:
`srun` does not read the job's SLURM_CPUS_PER_TASK on 22.05 and 23.02 (its man
page: request it again with --cpus-per-task), so without it a Ray node gets the
site's binding default, often 1 or 2 CPUs. Before 22.05 `--overlap` shares only
CPUs and a step gets all of the job's GRES unless it says otherwise (srun(1):
"--gres=none"), so the Ray head would hold node 0's GPUs and the driver's step
would wait forever; `--gres=none` exists from 20.11 to 24.11. `--mem=0` is
Slurm's special case for a step: all of the job's memory on the node, counted
against nothing (step_mgr.c: SSF_MEM_ZERO "use all memory but do not count
against the job's memory allocation"), so neither step can block the other on
any version, and the memory the job inherited from sbatch (SLURM_MEM_PER_NODE)
is not asked for twice. What sbatch leaves in the environment for the job's
GPUs and memory is removed from srun's, so it adds nothing to what each step
states (srun reads SLURM_GPUS_PER_NODE, SLURM_MEM_PER_CPU, ... as options).

A step has started when Slurm lists it (`squeue --steps`); one that Slurm has
not started within `cluster.slurm.startup_timeout_s` fails the job, naming the
step, its node and what srun said ("step creation temporarily disabled").
"""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from relax_core.cluster.lifetime import Child
from relax_core.config.cluster import NodeGroup
from relax_core.config.schema import Recipe
from relax_core.rundir import RunDir

# Variables sbatch sets for the job's resources that srun would read as options of every step, and the job's
# GPU visibility (Slurm sets a step's own for the GPUs it asks for; before 22.05 a step with --gres=none kept
# the job's, so the driver saw every GPU of the node).
INHERITED_RESOURCES = ("SLURM_GPUS", "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_SOCKET", "SLURM_GPUS_PER_TASK",
                       "SLURM_CPUS_PER_GPU", "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_GPU", "SLURM_MEM_PER_NODE",
                       "SLURM_GRES", "SLURM_STEP_GRES", "SLURM_TRES_PER_TASK", "CUDA_VISIBLE_DEVICES",
                       "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")
# `--exact`: the step binds only the CPUs it asks for (implied by --cpus-per-task from 21.08; on 20.11 a step
# got every CPU of the job on the node).
# `--overcommit`: on 21.08 the driver's step in a job of several nodes waited forever ("Requested nodes are
# busy") beside a Ray node step holding all of node 0's CPUs, though both asked --overlap (measured on 21.08.5,
# tests/slurm_versions); with it the driver shares them, as it does on 20.11 and 22.05 to 24.11 without.
DRIVER_RESOURCES = ["--cpus-per-task=1", "--exact", "--gres=none", "--mem=0", "--overcommit"]


@dataclass
class Allocation:
    job_id: int
    restart_count: int
    groups: dict[str, list[str]] = field(default_factory=dict)
    het: bool = True

    @classmethod
    def from_environ(cls, group_names: list[str], recipe: Recipe | None = None) -> Allocation:
        """The nodes of each group (`recipe.cluster.groups`, in het-group order) as Slurm allocated them.

        A plain job (no SLURM_JOB_NODELIST_HET_GROUP_0: `relax submit` made one `--nodes=N+M` job) is split
        in node-list order by the groups' node counts, train first."""
        env = os.environ
        job = int(env["SLURM_JOB_ID"]), int(env.get("SLURM_RESTART_COUNT", "0"))
        if "SLURM_JOB_NODELIST_HET_GROUP_0" not in env:
            nodes = hostnames(env["SLURM_JOB_NODELIST"])
            if len(group_names) == 1:
                return cls(*job, {group_names[0]: nodes}, het=False)
            assert recipe is not None, "a plain job of several groups is split by the recipe's node counts"
            groups, start = {}, 0
            for name in group_names:
                count = getattr(recipe.cluster, name).nodes
                groups[name], start = nodes[start:start + count], start + count
            return cls(*job, groups, het=False)
        groups = {name: hostnames(env[f"SLURM_JOB_NODELIST_HET_GROUP_{i}"]) for i, name in enumerate(group_names)}
        return cls(*job, groups)

    def sharing(self) -> str | None:
        """Why this allocation cannot run, when Slurm gave one node to two het groups (its docs allow it where
        the node has room for both): each node runs one Ray node, which would advertise both groups' resource
        and write one log. None when every node is in one group."""
        shared = {}
        for group, names in self.groups.items():
            for name in names:
                shared.setdefault(name, []).append(group)
        both = {name: groups for name, groups in shared.items() if len(groups) > 1}
        if not both:
            return None
        named = ", ".join(f"{name} ({' and '.join(groups)})" for name, groups in both.items())
        return (f"Slurm gave node {named} to two het groups, and a node runs one Ray node: give the groups "
                f"nodes of their own (cluster.slurm.extra_sbatch: ['--exclusive']), or make them one plain job "
                f"(cluster.slurm.layout: single, when they ask for the same nodes)")

    def nodes(self) -> list[tuple[str, str, int]]:
        """(name, group, index) of every node, in het-group order; index = position in the job (0 = the head)."""
        ordered = [(name, group) for group, names in self.groups.items() for name in names]
        return [(name, group, i) for i, (name, group) in enumerate(ordered)]


def hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


@dataclass
class Step:
    name: str
    node: str
    log_path: Path
    proc: Child
    launched: float = field(default_factory=time.monotonic)
    started: bool = False

    def log_tail(self, lines: int = 8) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def srun_said(self) -> str:
        """srun's own last lines in the step's log (why Slurm has not started it)."""
        said = [line for line in self.log_tail(40).splitlines() if line.startswith("srun:")]
        # srun says "step creation temporarily disabled" after its first wait for the step: a minute or more
        return "\n".join(said[-3:]) or "nothing yet (srun reports a step it waits for after a minute or more)"


def node_resources(group: NodeGroup) -> list[str]:
    """What a Ray node step of `group` asks Slurm for: the group's cores, GPUs and all of the job's memory."""
    gpu_type = f"{group.gpu_type}:" if group.gpu_type else ""
    gres = f"--gres=gpu:{gpu_type}{group.gpus_per_node}" if group.gpus_per_node else "--gres=none"
    return [f"--cpus-per-task={group.cpus_per_node}", "--exact", gres, "--mem=0"]


def srun_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """srun's environment: this one without the job's resource variables (each step states its own)."""
    environ = dict(os.environ if environ is None else environ)
    return {k: v for k, v in environ.items() if not k.startswith(INHERITED_RESOURCES)}


def srun_command(recipe: Recipe, run: RunDir, group: str, node: str, job_name: str, argv: list[str],
                 het_group: int | None = None, driver: bool = False) -> list[str]:
    """`srun` of `python -m argv` on one node of this job (of het group `het_group`), inside the container
    when the recipe names one: a Ray node of `group`, or the driver (`driver=True`)."""
    from relax_core.cluster.container import step_prefix

    cluster = recipe.cluster
    het = [f"--het-group={het_group}"] if het_group is not None else []
    resources = DRIVER_RESOURCES if driver else node_resources(getattr(cluster, group))
    prefix = step_prefix(recipe, run.path, gpus=getattr(cluster, group).gpus_per_node > 0)
    python = "python3" if cluster.container.image else sys.executable
    return ["srun", *het, "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap", *resources,
            f"--job-name={job_name}", *prefix, python, "-m", *argv]


def running_steps(job_ids: set[int]) -> dict[tuple[str, str], str] | None:
    """Slurm's id (`JOB.STEP`) of every step it runs for these jobs (het components), by (step name, node);
    None if squeue failed."""
    try:
        proc = subprocess.run(["squeue", "--steps", "--noheader", "--user", getpass.getuser(), "--format=%i|%j|%N"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    steps = {}
    for line in proc.stdout.splitlines():
        step_id, _, rest = line.strip().partition("|")
        name, _, nodes = rest.partition("|")
        job = step_id.split(".")[0].split("+")[0]
        if job.isdigit() and int(job) in job_ids:
            steps[(name, nodes)] = step_id
    return steps


class JobSteps:
    """The job's srun steps: one Ray node per allocated node, and the driver."""

    def __init__(self, recipe: Recipe, run: RunDir, alloc: Allocation):
        self.recipe, self.run, self.alloc = recipe, run, alloc
        self.nodes: list[Step] = []
        self.driver: Step | None = None

    def step_command(self, group: str, node: str, job_name: str, argv: list[str], driver: bool = False) -> list[str]:
        """`srun` of one step on one node, inside the container when the recipe names one."""
        groups = self.recipe.cluster.groups
        het = groups.index(group) if self.alloc.het and len(groups) > 1 else None
        return srun_command(self.recipe, self.run, group, node, job_name, argv, het, driver=driver)

    def srun(self, group: str, node: str, job_name: str, argv: list[str], log_path: Path,
             driver: bool = False) -> Step:
        command = self.step_command(group, node, job_name, argv, driver=driver)
        return Step(job_name, node, log_path, Child(command, log=log_path, env=srun_env()))

    def start_nodes(self, head_address: str, head_block: int) -> None:
        for name, group, index in self.alloc.nodes():
            argv = ["relax_core.cluster.node", str(self.run.path), "--group", group, "--index", str(index),
                    "--head-address", "" if index == 0 else head_address]
            argv += ["--port-block", str(head_block)] if index == 0 else []
            self.nodes.append(self.srun(group, name, f"ray-{name}", argv, self.run.logs / f"ray-{name}.log"))

    def start_driver(self) -> None:
        head = self.alloc.groups["train"][0]
        argv = ["relax_core.entrypoints.slurm_driver", str(self.run.path)]
        self.driver = self.srun("train", head, "driver", argv, self.run.logs / "driver-step.log", driver=True)

    def dead_node(self) -> Step | None:
        return next((s for s in self.nodes if s.proc.poll() is not None), None)

    def node_failure(self, step: Step) -> str:
        role = "head" if step is self.nodes[0] else "worker"
        return (f"the Ray {role} on node {step.node} exited with code {step.proc.returncode}; "
                f"see {step.log_path}\n{step.log_tail()}")

    def not_started(self) -> str | None:
        """Why the job cannot go on when a step Slurm has not started within `cluster.slurm.startup_timeout_s`
        (None while every step started or may still start)."""
        waiting = [s for s in [*self.nodes, self.driver] if s is not None and not s.started]
        if not waiting:
            return None
        running = running_steps(self.job_ids())
        timeout = self.recipe.cluster.slurm.startup_timeout_s
        for step in waiting:
            if step.proc.poll() is not None or (running is not None and (step.name, step.node) in running):
                step.started = True
            elif running is not None and time.monotonic() - step.launched > timeout:
                what = "driver step" if step is self.driver else f"Ray node step {step.name}"
                return (f"Slurm did not start the {what} on node {step.node} within {timeout:.0f}s "
                        f"(cluster.slurm.startup_timeout_s); srun said:\n{step.srun_said()}\nsee {step.log_path}")
        return None

    def signal_driver(self, signum: int) -> None:
        """srun forwards the signal to the driver process it runs."""
        if self.driver is not None and self.driver.proc.poll() is None:
            self.driver.proc.send_signal(signum)

    def supervise(self, poll_s: float = 0.5, scale_jobs=None) -> tuple[int | None, str | None]:
        """Wait for the driver to end; returns (its exit code, or None, and why the job failed otherwise: a node
        that ended, or a step Slurm did not start in time). Meanwhile `scale_jobs` (entrypoints/scale_jobs.py) submits
        and cancels the driver's scale-out jobs."""
        assert self.driver is not None
        while True:
            if scale_jobs is not None:
                scale_jobs.poll()
            code = self.driver.proc.poll()
            if code is not None:
                return code, None
            dead = self.dead_node()
            if dead is not None:
                return None, self.node_failure(dead)
            stuck = self.not_started()
            if stuck is not None:
                return None, stuck
            time.sleep(poll_s)

    def job_ids(self) -> set[int]:
        """The ids of this job's het components (the leader's and the ones after it; one for a plain job)."""
        return set(range(self.alloc.job_id, self.alloc.job_id + len(self.alloc.groups)))

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop every step this job started, the driver first. The Ray node steps get SIGTERM through Slurm
        (`scancel --signal=TERM JOB.STEP`), as at the job's end, so each node saves Ray's logs into the run
        directory before it ends (cluster/ray_logs.py): srun itself answers a SIGTERM by killing its tasks at
        once ("forcing job termination"). A step still running `grace_s` later is stopped by its process group."""
        if self.driver is not None:
            self.driver.proc.stop()
        live = [step for step in reversed(self.nodes) if step.proc.poll() is None]
        ids = (running_steps(self.job_ids()) or {}) if live else {}
        for step in live:
            if (step.name, step.node) in ids:
                subprocess.run(["scancel", "--signal=TERM", ids[(step.name, step.node)]], capture_output=True,
                               timeout=30)
        deadline = time.monotonic() + grace_s
        for step in live:
            try:
                step.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            step.proc.stop()
