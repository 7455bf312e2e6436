"""The batch step of a Relax Slurm job: a small supervisor on node 0 of het group 0.

    python -m relax_core.entrypoints.slurm_job RUN_DIR

It imports nothing heavy and needs only Slurm's commands, so it runs on the
host even when everything else runs in a container. It starts, each as an
`srun --overlap` step logging to `logs/`:

    ray-<node>.log   one Ray node per allocated node (head on node 0)
    driver.log       the driver (`relax_core.entrypoints.slurm_driver`) on node 0

then watches them: a node step that dies ends the job at once, naming the node
and its log; the driver's exit code says how the run ended. On USR1 (sent by
Slurm `signal_before_end_s` before the time limit) it tells the driver to stop:
the driver aborts the rollout in progress and checkpoints the last completed
step within seconds; then this step requeues the job, which resumes from that
checkpoint. A run whose newest checkpoint is no newer than the one it started
from made no progress and is not requeued, so a failing start-up cannot loop.
It holds the run directory's driver lock for its whole life, so no local
driver or second job drives the same run meanwhile. It also submits the
rollout-only jobs the driver asks for (`relax scale-rollout +N`,
launch/scale_jobs.py: the driver may run in a container without Slurm's
commands) and cancels them when they are done with, and all of them when the
job ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from relax_core.cluster.ports import NodePorts, lease_ports
from relax_core.config.schema import Recipe
from relax_core.errors import UserError
from relax_core.launch.rundir import DriverLock, RunDir
from relax_core.launch.scale_jobs import ScaleJobs

# Exit codes of the driver step.
DRIVER_COMPLETED, DRIVER_STOPPED, DRIVER_STARTUP_FAILED = 0, 3, 4


@dataclass
class Allocation:
    job_id: int
    restart_count: int
    groups: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def from_environ(cls, group_names: list[str]) -> Allocation:
        """The nodes of each group (`recipe.cluster.groups`, in het-group order) as Slurm allocated them."""
        env = os.environ
        if len(group_names) > 1:
            groups = {name: hostnames(env[f"SLURM_JOB_NODELIST_HET_GROUP_{i}"]) for i, name in enumerate(group_names)}
        else:
            groups = {"train": hostnames(env.get("SLURM_JOB_NODELIST_HET_GROUP_0") or env["SLURM_JOB_NODELIST"])}
        return cls(int(env["SLURM_JOB_ID"]), int(env.get("SLURM_RESTART_COUNT", "0")), groups)

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
    log_path: Path
    proc: subprocess.Popen

    def log_tail(self, lines: int = 8) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class JobSteps:
    """The job's srun steps: one Ray node per allocated node, and the driver."""

    def __init__(self, recipe: Recipe, run: RunDir, alloc: Allocation):
        self.recipe, self.run, self.alloc = recipe, run, alloc
        self.nodes: list[Step] = []
        self.driver: Step | None = None

    def step_command(self, group: str, node: str, job_name: str, argv: list[str]) -> list[str]:
        """`srun` of one step on one node, inside the container when the recipe names one."""
        groups = self.recipe.cluster.groups
        het = groups.index(group) if len(groups) > 1 else None
        return srun_command(self.recipe, self.run, group, node, job_name, argv, het)

    def srun(self, group: str, node: str, job_name: str, argv: list[str], log_path: Path) -> Step:
        command = self.step_command(group, node, job_name, argv)
        with log_path.open("ab") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return Step(node if job_name.startswith("ray") else job_name, log_path, proc)

    def start_nodes(self, head_address: str, head_block: int) -> None:
        for name, group, index in self.alloc.nodes():
            argv = ["relax_core.cluster.node", str(self.run.path), "--group", group, "--index", str(index),
                    "--head-address", "" if index == 0 else head_address]
            argv += ["--port-block", str(head_block)] if index == 0 else []
            self.nodes.append(self.srun(group, name, f"ray-{name}", argv, self.run.logs / f"ray-{name}.log"))

    def start_driver(self) -> None:
        head = self.alloc.groups["train"][0]
        argv = ["relax_core.entrypoints.slurm_driver", str(self.run.path)]
        self.driver = self.srun("train", head, "driver", argv, self.run.logs / "driver-step.log")

    def dead_node(self) -> Step | None:
        return next((s for s in self.nodes if s.proc.poll() is not None), None)

    def node_failure(self, step: Step) -> str:
        role = "head" if step is self.nodes[0] else "worker"
        return (f"the Ray {role} on node {step.name} exited with code {step.proc.returncode}; "
                f"see {step.log_path}\n{step.log_tail()}")

    def signal_driver(self, signum: int) -> None:
        """srun forwards the signal to the driver process it runs."""
        if self.driver is not None and self.driver.proc.poll() is None:
            self.driver.proc.send_signal(signum)

    def supervise(self, poll_s: float = 0.5, scale_jobs=None) -> tuple[int | None, str | None]:
        """Wait for the driver to end; returns (its exit code, or None, and a node failure if one ended it).
        Meanwhile `scale_jobs` (launch/scale_jobs.py) submits and cancels the driver's scale-out jobs."""
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
            time.sleep(poll_s)

    def stop(self) -> None:
        """Stop every step this job started (driver first), by its process group."""
        for step in ([self.driver] if self.driver else []) + list(reversed(self.nodes)):
            terminate(step.proc)


def srun_command(recipe: Recipe, run: RunDir, group: str, node: str, job_name: str, argv: list[str],
                 het_group: int | None = None) -> list[str]:
    """`srun` of `python -m argv` on one node of this job (of het group `het_group`), inside the container
    when the recipe names one."""
    from relax_core.launch.container import container_prefix

    cluster = recipe.cluster
    het = [f"--het-group={het_group}"] if het_group is not None else []
    prefix = container_prefix(cluster.container, run_dir=run.path, gpus=getattr(cluster, group).gpus_per_node > 0)
    python = "python3" if cluster.container.image else sys.executable
    return ["srun", *het, "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap",
            f"--job-name={job_name}", *prefix, python, "-m", *argv]


def terminate(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def head_address(recipe: Recipe, ports: NodePorts) -> str:
    from relax_core.cluster.node import node_address

    return f"{node_address(recipe)}:{ports.gcs}"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def main(argv: list[str] | None = None) -> int:
    from relax_core.config import load_recipe
    from relax_core.launch.hub import hub_env

    run = RunDir(Path((argv or sys.argv[1:])[0]).resolve())
    try:  # the run's driver lock, held until this batch step ends (the submitting node cannot hold it)
        _lock = DriverLock(run).acquire()
    except UserError as exc:  # another driver owns the run: leave its run.json alone
        print(f"relax: {exc}", file=sys.stderr, flush=True)
        return 2
    recipe = load_recipe(run.recipe)
    # Every step (and scale-out job) inherits this: the hub offline, its cache the one `relax submit` filled.
    os.environ.update(hub_env(recipe, run.path))
    alloc = Allocation.from_environ(recipe.cluster.groups)
    start_step = run.read_state().get("checkpoint_step", 0)
    head_lease = lease_ports(alloc.job_id, 0)  # this step runs on the head's machine, and holds it until it ends
    head = head_address(recipe, head_lease.ports)
    run.update_state(state="running", job_id=str(alloc.job_id), restart_count=alloc.restart_count,
                     nodes=alloc.groups, ray_head=head, started=_now(), error=None)
    steps = JobSteps(recipe, run, alloc)
    preempted: list[bool] = []

    def on_usr1(*_) -> None:
        preempted.append(True)
        steps.signal_driver(signal.SIGUSR1)

    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # scancel: stop the steps on the way out
    scale_jobs = ScaleJobs(recipe, run)
    try:
        steps.start_nodes(head, head_lease.ports.block)
        steps.start_driver()
        code, node_failure = steps.supervise(scale_jobs=scale_jobs)
    finally:
        steps.stop()
        scale_jobs.cancel_all()  # whatever the run started ends with it
    return finish(run, alloc, code, node_failure, start_step, bool(preempted))


def finish(run: RunDir, alloc: Allocation, code: int | None, node_failure: str | None, start_step: int,
           preempted: bool) -> int:
    if node_failure is not None:
        return _failed(run, node_failure)
    if code == DRIVER_COMPLETED:
        run.update_state(state="completed", finished=_now())
        return 0
    if code == DRIVER_STOPPED and preempted:
        if run.read_state().get("checkpoint_step", 0) <= start_step:
            return _failed(run, "signalled before making progress; not requeued")
        run.update_state(state="requeued", requeued=_now())
        subprocess.run(["scontrol", "requeue", str(alloc.job_id)], check=True, capture_output=True, text=True)
        _notify_requeued(run, alloc.job_id)
        return 0
    recorded = run.read_state().get("error")
    return _failed(run, recorded or f"the driver exited with code {code}; see {run.logs / 'driver.log'}")


def _notify_requeued(run: RunDir, job_id) -> None:
    """Tell `logging.notify` (never at the requeue's expense)."""
    from relax_core.config import load_recipe
    from relax_core.metrics.notify import Notifier

    try:
        recipe = load_recipe(run.recipe)
        notifier = Notifier(recipe.logging.notify, recipe.name)
        notifier.requeued(str(job_id), run.read_state().get("checkpoint_step", 0))
        notifier.close()
    except Exception as exc:
        print(f"relax: the requeue notification failed: {exc}", file=sys.stderr, flush=True)


def _failed(run: RunDir, message: str) -> int:
    run.update_state(state="failed", finished=_now(), error=message)
    print(f"relax: {message}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
