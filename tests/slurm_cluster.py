"""A real Slurm cluster on this host, for tests of the Slurm launcher.

`SlurmCluster` writes a slurm.conf with four node names in partition "debug"
(n1..n4, 2 CPUs each, all on localhost, one `slurmd -N nX` each) and two that
look like 8-GPU nodes in partition "gpu" (g1, g2; for `sbatch --test-only` of
full-size recipes) into a temporary directory, starts its own munged,
slurmctld and slurmds, and waits until `sinfo` shows every node idle.
Preemption works as at sites that let a "scavenger" queue use idle nodes:
partition "scavenger" (n1..n4 again, PreemptMode=REQUEUE, GraceTime=10 s)
yields to partition "urgent" (n1..n4, higher PriorityTier); "debug" and "gpu"
are never preempted. `SlurmCluster.preempt(node)` submits an urgent job that
needs the whole node. What a scavenger job receives (measured on 22.05.8):
at once SIGCONT and SIGTERM to every srun step, but not to the batch script
(like `scancel --signal` without `--batch`); when the grace time is over,
SIGTERM and SIGCONT to the batch script and the steps, SIGKILL KillWait (5 s)
later. Then a requeueable job is requeued (Restarts+1, held cred_expire+1 s,
started when the node is free) and one submitted with --no-requeue ends
PREEMPTED. `--signal` is not sent at preemption (no
PreemptParameters=send_user_signal, Slurm's default).

The cluster is shared the way a university's is (tests/slurm_site.py): a
second Unix user, `relaxtest2`, submits jobs to the same nodes
(`SlurmCluster.submit_as`), and fs.protected_regular=1 while it runs. Node
d1 (partition "debian", 2 CPUs) has its own hostname, which resolves to
127.0.1.1 in its jobs, and the address 10.77.0.1 on interface relax0 (a
veth; every node shares the tests' network namespace).

Jobs are contained by cgroups as at university sites (CGROUP_TASKS, where
cgroup v1 controllers are writable): a step's cpuset is its CPUs, its memory
cgroup's limit is its --mem (a step using more is OOM-killed and the job ends
OUT_OF_MEMORY), and it may open only the stand-in GPU device files of its gres
(the others give EPERM).

Tests reach it through the session-scoped `slurm_cluster` fixture, which also
exports SLURM_CONF for the test process, so `sbatch`/`squeue`/`scancel` run by
the code under test talk to this cluster (and never read /etc/slurm, which
another run of the suite may be using).

Slurm's ports are fixed (6817, 6821-6826), so the fixture refuses to run
outside a loopback-only network namespace: run the suite with `bash tests/run`.
Daemons are stopped by the PIDs in their pid files, never by name. They are
not reaped by PID 1 here and stay as zombies: harmless.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from slurm_site import (
    DEBIAN_NODE,
    PROTECTED_REGULAR,
    ROUTABLE_INTERFACE,
    ROUTABLE_PEER,
    SECOND_USER,
    add_routable_address,
    as_user,
    debian_hosts,
    ensure_user,
    owned_dir,
    remove_routable_address,
    sysctl,
    with_own_hostname,
)

NODE_NAMES = ("n1", "n2", "n3", "n4")  # partition "debug": 2 CPUs, 4000 MB, 2 stand-in GPUs each
PARTITION = "debug"
NODE_GPU_TYPE = "tesla"  # the n nodes' gres is typed: `--gres=gpu:tesla:2` fits, another type is refused
NODE_GPUS = 2
GPU_NODE_NAMES = ("g1", "g2")  # partition "gpu": look like 8-GPU, 64-CPU, ~1 TB nodes
GPU_PARTITION = "gpu"
GPUS_PER_NODE = 8
PREEMPTIBLE_PARTITION = "scavenger"  # n1..n4 again: its jobs are requeued when an "urgent" job needs their CPUs
URGENT_PARTITION = "urgent"  # n1..n4 again, higher PriorityTier: preempts "scavenger" jobs
DEBIAN_PARTITION = "debian"  # node d1 only: its hostname resolves to 127.0.1.1 (tests/slurm_site.py)
PREEMPT_GRACE_S = 10  # GraceTime of "scavenger": SIGTERM first, SIGKILL this long after
NVIDIA_MAJOR = 195  # the character-device major number of /dev/nvidia0, /dev/nvidia1, ...
# Environment a surrounding Slurm job (or a user's shell) may set; any of it
# would steer sbatch/srun away from the test cluster.
FOREIGN_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_", "SCONTROL_")
TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
)
# Cgroup task containment, as university clusters configure it: proctrack/cgroup,
# task/cgroup+task/affinity and a cgroup.conf constraining cores, RAM and the
# gres device files (CGROUP_CONF). Slurm 22.05's cgroup/v1 plugin, with the
# v1 controllers mounted under /sys/fs/cgroup; built with multiple-slurmd
# support, each slurmd keeps its own hierarchy /sys/fs/cgroup/<ctrl>/slurm_<node>.
# Used where those controllers are mounted and writable (root); elsewhere (a
# cgroup v2-only host: 22.05's cgroup/v2 wants slurmd under systemd) the cluster
# falls back to proctrack/linuxproc + task/affinity. RELAX_TEST_SLURM_CGROUP=0
# forces the fallback, =1 forces cgroups.
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_CONTROLLERS = ("cpuset", "memory", "devices", "freezer")


def cgroup_v1_writable() -> bool:
    """Whether Slurm's cgroup/v1 plugin can make its hierarchies here: v1 controllers mounted, and root."""
    return os.geteuid() == 0 and all(
        (CGROUP_ROOT / ctl / "tasks").is_file() and os.access(CGROUP_ROOT / ctl, os.W_OK)
        for ctl in CGROUP_CONTROLLERS
    )


CGROUP_TASKS = {"0": False, "1": True}.get(os.environ.get("RELAX_TEST_SLURM_CGROUP", ""), cgroup_v1_writable())
# Under ConstrainRAMSpace a job's memory cgroup is its allocation (steps with --mem=0 share it): at
# 1000 MB per CPU the Ray head node of a 2-CPU job (raylet, GCS, trainer, TransferQueue, the driver)
# is OOM-killed, so with cgroups a CPU brings 2000 MB (a 2-CPU job gets its whole 4000 MB node).
DEF_MEM_PER_CPU_CGROUP = 2000
CGROUP_CONF = """\
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
ConstrainCores=yes
ConstrainRAMSpace=yes
ConstrainDevices=yes
"""
# Unix socket paths (munge's, slurmstepd's) must fit in 108 bytes.
MAX_ROOT_LEN = 60

# bf_interval=1 and bf_hetjob_immediate start a het job in ~0.5 s instead of
# ~25 s. A requeued job is held for cred_expire+1 s (Slurm's default: 120 s;
# 5 is the least it accepts) and then waits for a scheduler pass that nothing
# triggers: sched_interval=1 runs one every second instead of every 60 s.
# The g nodes let `sbatch --test-only` judge full-size GPU recipes:
# config_overrides makes slurmd report the configured size instead of this
# machine's. Every GPU is a File= in gres.conf, a character device made with
# mknod like /dev/nvidiaK (c 195 K): a job's gres sets CUDA_VISIBLE_DEVICES to
# the indices it got. task/affinity binds every task to the CPUs its job or
# step was given (os.sched_getaffinity shows them), as sites' task plugins do.
# Memory is a consumable resource (CR_Core_Memory, DefMemPerCPU), as at most
# sites: a job asking --mem=0 gets its node's memory, and before 22.05 a step
# with no --mem of its own takes all of it, so a second step waits (measured on
# 20.11.4; a step with --mem=0 does not).
# No CredType line: 20.11 calls it CryptoType (renamed in 21.08), and munge is
# the default under either name; the fixture must start any Slurm on PATH.
SLURM_CONF_TEMPLATE = """\
ClusterName=relax-test
SlurmctldHost=localhost
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket.2,cred_expire={cred_expire}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType={proctrack}
TaskPlugin={task_plugin}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU={def_mem_per_cpu}
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,bf_hetjob_immediate,bf_hetjob_prio=min,sched_min_interval=100000,sched_interval=1
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdParameters=config_overrides
GresTypes=gpu
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
NodeName=n[1-4] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[6821-6824] CPUs=2 RealMemory=4000 Gres={node_gres}
NodeName=g[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[6825-6826] CPUs=64 RealMemory=1000000 Gres=gpu:8 State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={debian_node} NodeHostname=localhost NodeAddr=127.0.0.1 Port=6827 CPUs=2 RealMemory=4000
PartitionName=debug Nodes=n[1-4] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES PreemptMode=OFF
PartitionName=gpu Nodes=g[1-2] MaxTime=INFINITE State=UP OverSubscribe=YES PreemptMode=OFF
PartitionName={debian_partition} Nodes={debian_node} MaxTime=INFINITE State=UP OverSubscribe=YES PreemptMode=OFF
PartitionName={preemptible} Nodes=n[1-4] MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime={grace}
PartitionName={urgent} Nodes=n[1-4] MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""


def gres_conf(root: Path) -> str:
    """gres.conf: one line per node, naming that node's own stand-in device files."""
    lines = [
        f"NodeName={node} Name=gpu Type={NODE_GPU_TYPE} File={root}/fake-gpu/{node}/nvidia[0-{NODE_GPUS - 1}]\n"
        for node in NODE_NAMES
    ]
    lines += [
        f"NodeName={node} Name=gpu File={root}/fake-gpu/{node}/nvidia[0-{GPUS_PER_NODE - 1}]\n"
        for node in GPU_NODE_NAMES
    ]
    return "".join(lines)


def make_fake_gpus(directory: Path, count: int) -> None:
    """Character devices nvidia0..nvidia{count-1} (major 195, like NVIDIA's) in `directory`.

    Without the right to mknod (a user namespace) they are plain files: slurmd
    logs "not a valid character or block device" and carries on.
    """
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        path = directory / f"nvidia{index}"
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, index))
        except PermissionError:
            path.touch()


class SlurmCommandError(subprocess.CalledProcessError):
    """A Slurm client command failed; the message carries its stderr."""

    def __str__(self) -> str:
        return f"{shlex.join(self.cmd)} exited {self.returncode}: {(self.stderr or '').strip()}"


def require_isolated_network() -> None:
    """Fail unless this process is in a loopback-only namespace with 127.0.0.2 on lo."""
    others = sorted(name for _, name in socket.if_nameindex() if name not in ("lo", ROUTABLE_INTERFACE, ROUTABLE_PEER))
    if others:
        pytest.fail(
            f"the Slurm test cluster binds fixed ports and must run in a loopback-only network "
            f"namespace, but this one has interfaces {others}: run the tests via `bash tests/run`",
            pytrace=False,
        )
    addrs = subprocess.run(["ip", "-o", "-4", "addr", "show", "dev", "lo"], capture_output=True, text=True).stdout
    if "127.0.0.2/" not in addrs:
        # Slurm's getaddrinfo(AI_ADDRCONFIG) finds no address when 127.0.0.1 is the only one.
        pytest.fail("lo needs a second address for Slurm: run the tests via `bash tests/run`", pytrace=False)


def require_slurm_installed() -> None:
    missing = [exe for exe in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(exe) is None]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not found: apt-get install -y --no-install-recommends slurm-wlm munge",
            pytrace=False,
        )


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll `predicate` until it holds or `timeout` seconds pass; return whether it held."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def process_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (nobody reaps our daemons)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # never started


def stop_daemon(pid_file: Path, name: str, timeout: float = 10.0) -> None:
    """SIGTERM the daemon named in `pid_file`, SIGKILL it after `timeout` seconds."""
    pid = read_pid(pid_file)
    if pid is None or not process_running(pid):
        return
    if Path(f"/proc/{pid}/comm").read_text().strip() != name:
        return  # the PID was reused by someone else's process: not ours to stop
    os.kill(pid, signal.SIGTERM)
    if not wait_until(lambda: not process_running(pid), timeout):
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not process_running(pid), 5.0)


def parse_scontrol_record(line: str) -> dict[str, str]:
    """`scontrol -o show job` prints one `Key=Value ...` line per job (component)."""
    return dict(re.findall(r"(?:^|\s)([\w/:]+)=(\S*)", line))


class SlurmCluster:
    """Daemons and client helpers for one test Slurm cluster.

    Args:
        root: a short, empty directory for the config, state, logs and sockets.
        cred_expire: seconds a requeued job is held before it may start again
            (also the job credential lifetime; Slurm's default is 120).
    """

    partition = PARTITION
    node_names = NODE_NAMES
    gpu_partition = GPU_PARTITION
    gpu_node_names = GPU_NODE_NAMES
    gpus_per_node = GPUS_PER_NODE
    node_gpu_type = NODE_GPU_TYPE
    node_gpus = NODE_GPUS
    preemptible_partition = PREEMPTIBLE_PARTITION
    urgent_partition = URGENT_PARTITION
    preempt_grace_s = PREEMPT_GRACE_S
    second_user = SECOND_USER
    debian_node = DEBIAN_NODE
    debian_partition = DEBIAN_PARTITION
    # Whether fs.protected_regular=1 holds while the cluster runs (the fixture sets it; see slurm_site).
    protected_regular = False

    def __init__(self, root: Path, cred_expire: int = 5) -> None:
        if cred_expire < 5:
            raise ValueError("Slurm ignores cred_expire below 5 (and falls back to 120)")
        if len(str(root)) > MAX_ROOT_LEN:
            raise ValueError(f"{root} is too long for Unix socket paths; use a shorter base directory")
        self.root = root
        self.cred_expire = cred_expire
        self.conf_path = root / "slurm.conf"
        self.state_dir = root / "state"
        self.log_dir = root / "log"
        self.run_dir = root / "run"
        self.munge_dir = root / "munge"

    @property
    def all_node_names(self) -> tuple[str, ...]:
        return self.node_names + self.gpu_node_names + (self.debian_node,)

    @property
    def env(self) -> dict[str, str]:
        """The current environment, pointed at this cluster, for client commands and jobs."""
        return clean_environ(os.environ) | {"SLURM_CONF": str(self.conf_path)}

    # -- life cycle ---------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        if CGROUP_TASKS:
            busy = [str(d) for d in self.cgroup_dirs() if cgroup_has_tasks(d)]
            if busy:
                raise RuntimeError(f"another Slurm cluster's jobs are in the cgroups this one would use: {busy}")
            self.remove_cgroups()  # empty ones a previous run left
        self._write_files()
        self._start_munged()
        self._daemon(["slurmctld", "-i"])
        for node in self.node_names + self.gpu_node_names:
            self._daemon(["slurmd", "-N", node])
        hosts = self.root / "hosts"
        hosts.write_text(debian_hosts(self.debian_node))
        self._daemon(with_own_hostname(self.debian_node, hosts, ["slurmd", "-N", self.debian_node]))
        if not wait_until(self.all_idle, timeout, interval=0.2):
            raise RuntimeError(f"Slurm nodes not idle after {timeout:.0f} s:\n{self.diagnostics()}")

    def stop(self) -> None:
        """Cancel leftover jobs (their processes are ours too), then stop the daemons."""
        self._cancel_all_jobs()
        for node in self.all_node_names:
            stop_daemon(self.run_dir / f"slurmd-{node}.pid", "slurmd")
        stop_daemon(self.run_dir / "slurmctld.pid", "slurmctld")
        stop_daemon(self.run_dir / "munged.pid", "munged")
        if CGROUP_TASKS:
            self.remove_cgroups()

    def cgroup_dirs(self) -> list[Path]:
        """Each slurmd's cgroup hierarchies, /sys/fs/cgroup/<controller>/slurm_<node> (those that exist)."""
        return [d for ctl in CGROUP_CONTROLLERS for node in self.all_node_names
                if (d := CGROUP_ROOT / ctl / f"slurm_{node}").is_dir()]

    def remove_cgroups(self) -> None:
        """Remove the nodes' cgroup hierarchies, deepest first; one still holding a process stays."""
        for top in self.cgroup_dirs():
            for sub in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True) + [top]:
                if sub.is_dir():
                    try:
                        sub.rmdir()
                    except OSError:
                        pass

    def _write_files(self) -> None:
        for sub in ("state", "log", "run", "munge", "spool", "jobs", "fake-gpu"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for node in self.node_names:
            make_fake_gpus(self.root / "fake-gpu" / node, NODE_GPUS)
        for node in self.gpu_node_names:
            make_fake_gpus(self.root / "fake-gpu" / node, GPUS_PER_NODE)
        self.munge_dir.chmod(0o755)  # munged refuses a group/world-writable socket directory
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.conf_path.write_text(
            SLURM_CONF_TEMPLATE.format(
                root=self.root, cred_expire=self.cred_expire, node_gres=f"gpu:{NODE_GPU_TYPE}:{NODE_GPUS}",
                preemptible=PREEMPTIBLE_PARTITION,
                urgent=URGENT_PARTITION,
                grace=PREEMPT_GRACE_S,
                debian_node=DEBIAN_NODE,
                debian_partition=DEBIAN_PARTITION,
                proctrack="proctrack/cgroup" if CGROUP_TASKS else "proctrack/linuxproc",
                task_plugin="task/cgroup,task/affinity" if CGROUP_TASKS else "task/affinity",
                def_mem_per_cpu=DEF_MEM_PER_CPU_CGROUP if CGROUP_TASKS else 1000,
            )
        )
        # Slurm reads gres.conf (and cgroup.conf) from the directory SLURM_CONF is in.
        (self.root / "gres.conf").write_text(gres_conf(self.root))
        if CGROUP_TASKS:
            (self.root / "cgroup.conf").write_text(CGROUP_CONF)

    def _start_munged(self) -> None:
        socket_path = self.munge_dir / "munge.socket.2"
        self._daemon(
            [
                "munged",
                "--force",  # it refuses sockets under 0700 directories such as pytest's tmp dirs
                f"--socket={socket_path}",
                f"--key-file={self.munge_dir / 'munge.key'}",
                f"--pid-file={self.run_dir / 'munged.pid'}",
                f"--seed-file={self.munge_dir / 'seed'}",
                f"--log-file={self.log_dir / 'munged.log'}",
            ]
        )
        if not wait_until(socket_path.exists, 10.0):
            raise RuntimeError(f"munged did not create {socket_path}:\n{self.diagnostics()}")

    def _daemon(self, argv: list[str]) -> None:
        """Start a daemon; it forks into the background and its launcher exits at once."""
        proc = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} exited {proc.returncode}: {proc.stderr}\n{self.diagnostics()}")

    def all_idle(self) -> bool:
        proc = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=10)
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        return proc.returncode == 0 and all(states.get(node) == "idle" for node in self.all_node_names)

    def end_jobs_left_behind(self, timeout: float = 60.0) -> list[str]:
        """Cancel every job still queued or running (any user's), then wait until every node is idle again;
        return them as "ID NAME STATE" lines. A test's jobs end with it, so the next test's land where it says."""
        left = self.run(["squeue", "-h", "-o", "%i %j %T"], check=False).stdout.splitlines()
        if left:
            self._cancel_all_jobs()
        if left or not self.all_idle():
            wait_until(self.all_idle, timeout, 0.5)
        return left

    def _cancel_all_jobs(self, timeout: float = 15.0) -> None:
        ctld = read_pid(self.run_dir / "slurmctld.pid")
        if ctld is None or not process_running(ctld):
            return
        jobs = self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
        if jobs:
            self.run(["scancel", *jobs], check=False)
            wait_until(lambda: not self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip(), timeout, 0.2)

    # -- client helpers -----------------------------------------------------

    def run(
        self,
        cmd: str | Sequence[str],
        *,
        check: bool = True,
        timeout: float = 60.0,
        input: str | None = None,
        user: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster (a string is split like a shell would).

        `user` runs it as that Unix user (with runuser), e.g. `cluster.second_user`.
        """
        argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
        if user is not None:
            argv = as_user(user, argv)
        proc = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout, input=input)
        if check and proc.returncode != 0:
            raise SlurmCommandError(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc

    def submit(self, script: str, *sbatch_args: str) -> int:
        """`sbatch` a script text (from the jobs/ directory); return the job id."""
        return self._sbatch(self.root / "jobs", script, sbatch_args, user=None)

    def submit_as(self, user: str, script: str, *sbatch_args: str) -> int:
        """`sbatch` a script text as Unix user `user`, from `user_dir(user)`; return the job id."""
        return self._sbatch(self.user_dir(user), script, sbatch_args, user=user)

    def user_dir(self, user: str) -> Path:
        """A directory of `user`'s own in the cluster's root: its jobs' working directory."""
        return owned_dir(self.root / "users" / user, user)

    def _sbatch(self, workdir: Path, script: str, sbatch_args: Sequence[str], user: str | None) -> int:
        fd, path = tempfile.mkstemp(suffix=".sh", dir=workdir)
        with os.fdopen(fd, "w") as handle:
            handle.write(script)
        os.chown(path, workdir.stat().st_uid, workdir.stat().st_gid)
        out = self.run(["sbatch", "--parsable", f"--chdir={workdir}", *sbatch_args, path], user=user).stdout
        return int(out.strip().split(";")[0])

    def gpu_device_files(self, node: str) -> list[Path]:
        """The stand-in device files of `node`'s GPUs (character devices 195:K, as gres.conf names them)."""
        return sorted((self.root / "fake-gpu" / node).glob("nvidia*"))

    def preempt(self, node: str, hold_s: float = 1.0) -> int:
        """Submit an "urgent" job that needs all of `node` for `hold_s` seconds; return its id.

        A "scavenger" job on the node is preempted at once (see the module
        docstring for the signals); a "debug" job is not, and the urgent job
        waits for it.
        """
        script = f"#!/bin/bash\nsleep {hold_s}\n"
        return self.submit(script, f"--partition={URGENT_PARTITION}", f"--nodelist={node}", "--exclusive",
                           "--output=/dev/null")

    def job_info(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` fields of the job (of the leader, for a het job)."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        return parse_scontrol_record(out.splitlines()[0])

    def job_state(self, job_id: int) -> str:
        return self.job_info(job_id)["JobState"]

    def wait_for_state(self, job_id: int, states: Sequence[str] = ("COMPLETED",), timeout: float = 30.0) -> str:
        """Wait until the job is in one of `states` (or a terminal one); return its state."""
        wanted = set(states) | TERMINAL_STATES
        if not wait_until(lambda: self.job_state(job_id) in wanted, timeout, interval=0.2):
            raise TimeoutError(f"job {job_id} still {self.job_state(job_id)} after {timeout} s:\n{self.diagnostics()}")
        return self.job_state(job_id)

    def diagnostics(self, lines: int = 15) -> str:
        """The tail of every daemon log, for error messages."""
        parts = []
        for log in sorted(self.log_dir.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(parts) or f"(no logs in {self.log_dir})"


def cgroup_has_tasks(directory: Path) -> bool:
    """Whether a process is in the cgroup `directory` or one below it."""
    return any(tasks.read_text().strip() for tasks in directory.rglob("tasks"))


def clean_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without Slurm variables inherited from a surrounding job or shell."""
    return {k: v for k, v in environ.items() if not k.startswith(FOREIGN_ENV_PREFIXES)}


def cluster_root() -> Path:
    """A new short directory under /tmp that every user may enter (the second user reads slurm.conf there).

    Not pytest's temporary directory: its parent is private to the user running the tests.
    """
    root = Path(tempfile.mkdtemp(prefix="relax-slurm-", dir="/tmp"))
    root.chmod(0o755)
    return root


def point_environ_at(conf_path: Path) -> dict[str, str | None]:
    """Export SLURM_CONF and drop foreign Slurm variables; return what to restore."""
    keys = [k for k in os.environ if k.startswith(FOREIGN_ENV_PREFIXES)] + ["SLURM_CONF"]
    saved = {k: os.environ.get(k) for k in keys}
    for k in keys:
        os.environ.pop(k, None)
    os.environ["SLURM_CONF"] = str(conf_path)
    return saved


def restore_environ(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A running test cluster; SLURM_CONF points at it and fs.protected_regular is 1 for the whole session.

    The cluster's directory (config, logs, the jobs' working directories) is
    removed at the end of the session.
    """
    require_slurm_installed()
    require_isolated_network()
    if os.geteuid() == 0:
        ensure_user(SECOND_USER)
    cluster = SlurmCluster(cluster_root())
    saved_environ = point_environ_at(cluster.conf_path)
    add_routable_address()
    try:
        with sysctl(PROTECTED_REGULAR, "1") as cluster.protected_regular:
            cluster.start()
            yield cluster
    finally:
        cluster.stop()
        restore_environ(saved_environ)
        remove_routable_address()
        shutil.rmtree(cluster.root, ignore_errors=True)


@pytest.fixture(autouse=True)
def slurm_jobs_end_with_their_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test that used the cluster, no job of it is left: one that failed half-way (a run and its
    scale-out job still running) would otherwise take the nodes the next test's jobs expect."""
    yield
    if "slurm_cluster" in request.fixturenames:
        left = request.getfixturevalue("slurm_cluster").end_jobs_left_behind()
        if left:
            print(f"\n{request.node.nodeid} left Slurm jobs behind, cancelled: {left}", file=sys.stderr)


def slurm_version() -> str:
    """The version of the first `slurmd` on PATH (the one the fixture starts), e.g. "22.05.8"."""
    try:
        out = subprocess.run(["slurmd", "-V"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return "not installed"
    return out.split()[-1] if out.strip() else "unknown"


def mark_slurm_tests(items: list[pytest.Item]) -> None:
    """Give the `slurm` marker to every test that uses the cluster (call from conftest)."""
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)
