"""What starts Ray on one node of a Slurm job.

    python -m relax_core.cluster.node RUN_DIR --group rollout --index 2 --head-address 10.0.0.5:12000

runs `ray start --block` for this node, as its child: explicit
ports of a block it leases on this machine (the head: the block the batch step
leased for it, `--port-block`), a short node-local temp dir, explicit CPU/GPU
counts, the group's custom resource (`relax_train` / `relax_rollout` /
`relax_reference`) plus one that names the node, the node's address (never
loopback in a multi-node job: cluster/address.py), and the run's token. The
batch step starts the head with the same function. When Ray ends, or the
step is stopped (SIGTERM, passed on to Ray), Ray's own logs are copied into
`<run>/logs/ray/<node>/` (cluster/ray_logs.py).

Before Ray starts, the node raises its soft open-file limit to what Ray
recommends (or the hard limit) and, where InfiniBand devices exist, its soft
locked-memory limit to the hard one; what stays too low is a warning in the
node's log, naming the setting to change.

What listens, and where: Ray's own servers listen on the node's address where
Ray lets them (the runtime-env agent, the dashboard agent's HTTP server); its
core gRPC servers (GCS, raylet, object manager, workers) and the dashboard
agent's gRPC server listen on every interface whenever the node's address is
not loopback (Ray 2.60 has no option for one address), and require the run's
token. No dashboard process and no autoscaler monitor run: each would listen
on every interface too, and Relax uses neither. (The head's Ray Client server
cannot be turned off; it listens on the node's address, on a port of the block.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import socket
import stat
import sys
import tempfile
from pathlib import Path

from relax_core.cluster.address import NodeAddress, pick_address
from relax_core.cluster.local_ray import token_env
from relax_core.cluster.placement import (
    JUDGE_RESOURCE,
    REFERENCE_RESOURCE,
    ROLLOUT_RESOURCE,
    TRAIN_RESOURCE,
    engines_per_node,
    node_resource,
    scale_resource,
)
from relax_core.cluster.ports import NodePorts, block_ports, lease_ports
from relax_core.cluster.ray_compat import temp_dir_inside
from relax_core.cluster.ray_logs import run_ray_node
from relax_core.config.modes import mode_spec
from relax_core.config.schema import Recipe, rollout_group_name
from relax_core.rundir import RunDir

NOFILE = 65536  # open files a Ray node should be allowed (Ray recommends at least 65535)
INFINIBAND = Path("/sys/class/infiniband")


def multi_node(recipe: Recipe) -> bool:
    """Whether the recipe's job has more than one node (a scale-out's nodes join a head: always more than one)."""
    return sum(getattr(recipe.cluster, group).nodes for group in ("train", "rollout", "reference")) > 1


def pick_node_address(recipe: Recipe, head_address: str | None = None) -> NodeAddress:
    """This node's address (cluster/address.py); `head_address` (host:port) on every node but the head."""
    head = head_address.rsplit(":", 1)[0] if head_address else None
    return pick_address(recipe.cluster.network.interface, head=head,
                        multi_node=head is not None or multi_node(recipe))


def node_address(recipe: Recipe) -> str:
    """The head's address, as the batch step (on the head's machine) hands it to the other nodes."""
    return pick_node_address(recipe).address


def node_env(recipe: Recipe, run: RunDir, group: str, address: NodeAddress) -> dict[str, str]:
    """Environment of every process on the node: token, address, the interface NCCL and Gloo use (the one the
    address was chosen by), the group's own variables."""
    env = dict(os.environ) | token_env(run) | {"RELAX_NODE_IP": address.address} | address.socket_env()
    return env | dict(getattr(recipe.cluster, group).env)


def node_resources(recipe: Recipe, group: str, name: str, scale_op: str | None = None) -> dict[str, float]:
    nodes = getattr(recipe.cluster, group)
    resources: dict[str, float] = {node_resource(name): 1}
    if scale_op is not None:  # a node of a scale-out job: engine slots, and the ones its engines ask for
        slots = nodes.gpus_per_node or engines_per_node(recipe)
        return resources | {ROLLOUT_RESOURCE: slots, scale_resource(scale_op): slots}
    if group == "train":
        resources[TRAIN_RESOURCE] = nodes.gpus_per_node or getattr(recipe.train, "cpu_ranks_per_node", 1)
    if group == rollout_group_name(recipe):  # the engines' group
        resources[ROLLOUT_RESOURCE] = nodes.gpus_per_node or math.ceil(recipe.rollout.num_engines / nodes.nodes)
        if recipe.reward.judge_engines:
            resources[JUDGE_RESOURCE] = math.ceil(recipe.reward.judge_engines / nodes.nodes)
    if group == "reference":  # one reference worker per GPU, or per node on CPU
        resources[REFERENCE_RESOURCE] = nodes.gpus_per_node or 1
    return resources


def transfer_queue_cpus(recipe: Recipe, group: str, head: bool) -> int:
    """Ray CPUs a node adds for TransferQueue (asynchronous modes), whose actors each hold one: a storage
    unit on every training node (relax_core/data/bus.py places them there), its controller on the head."""
    if not mode_spec(recipe.mode).bus or group != "train":
        return 0
    return 2 if head else 1


def ray_temp_dir(job_id: int, index: int) -> Path:
    """The node's folder for Ray: short (Unix socket paths are limited to 107 bytes), node-local, this user's
    alone (`private_temp_dir`); Ray's temp dir is inside it (`ray_compat.temp_dir_inside`)."""
    return Path(os.environ.get("RELAX_RAY_TMP", tempfile.gettempdir())) / f"rx{os.getuid()}-{job_id}-{index}"


def private_temp_dir(path: Path) -> Path:
    """Make the node's folder for Ray this user's alone (mode 0700), or take back the one an earlier attempt
    of the job left (a requeue runs under the same job id). One that is not a folder of this user's is
    refused: its name is predictable, and whoever made it would hold the cluster's sockets."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
        what = "a symbolic link" if stat.S_ISLNK(found.st_mode) else (
            f"owned by uid {found.st_uid}" if stat.S_ISDIR(found.st_mode) else "not a folder")
        raise PrivateDirError(f"{path} exists and is {what}, not a folder of this user's (uid {os.getuid()}): "
                              "remove it, or point RELAX_RAY_TMP at a folder only you can write to")
    os.chmod(path, 0o700)
    return path


class PrivateDirError(RuntimeError):
    """The node's Ray temp dir exists and is not this user's."""


def ray_start_command(recipe: Recipe, run: RunDir, *, group: str, index: int, name: str, address: str,
                      job_id: int, head_address: str | None, ports: NodePorts,
                      scale_op: str | None = None) -> list[str]:
    nodes = getattr(recipe.cluster, group)
    queue_cpus = 0 if scale_op else transfer_queue_cpus(recipe, group, head_address is None)
    temp_dir = ray_temp_dir(job_id, index)
    # `python -m`, not the `ray` script: in a venv over system packages (common with HPC modules) the
    # script is not next to the interpreter. `ray_compat` is `ray start` without a dashboard process.
    command = [sys.executable, "-m", "relax_core.cluster.ray_compat", "start", "--block", "--disable-usage-stats",
               f"--node-ip-address={address}",
               f"--num-cpus={nodes.cpus_per_node + queue_cpus}", f"--num-gpus={nodes.gpus_per_node}",
               f"--resources={json.dumps(node_resources(recipe, group, name, scale_op))}",
               f"--temp-dir={temp_dir_inside(temp_dir)}", *ports.ray_start_flags(head=head_address is None)]
    if head_address is None:
        return command + ["--head", "--include-dashboard=false", "--no-monitor"]
    return command + [f"--address={head_address}"]


def raise_limits() -> list[str]:
    """Raise this process's soft limits, which Ray and all it starts inherit: open files to min(hard, NOFILE),
    locked memory to its hard limit where InfiniBand devices exist. Returns warnings on what stays too low."""
    warnings = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = NOFILE if hard == resource.RLIM_INFINITY else min(hard, NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    if hard != resource.RLIM_INFINITY and hard < NOFILE:
        warnings.append(f"the open-file limit's hard limit is {hard}, below the {NOFILE} Ray recommends: large "
                        f"runs may fail with 'Too many open files' (the site sets it: `nofile` in "
                        f"/etc/security/limits.conf, LimitNOFILE of slurmd)")
    devices = sorted(path.name for path in INFINIBAND.iterdir()) if INFINIBAND.is_dir() else []
    if devices:
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
        if hard != resource.RLIM_INFINITY:
            warnings.append(f"the locked-memory limit (RLIMIT_MEMLOCK) is {hard} bytes on a node with InfiniBand "
                            f"devices ({', '.join(devices)}); NCCL over InfiniBand needs it unlimited. Slurm passes "
                            f"the submitting shell's limits on (PropagateResourceLimits): set `memlock unlimited` in "
                            f"/etc/security/limits.conf where you submit, or ask the admins for "
                            f"PropagateResourceLimitsExcept=MEMLOCK in slurm.conf and LimitMEMLOCK=infinity for slurmd")
    return warnings


def node_ports(args: argparse.Namespace, job_id: int) -> NodePorts:
    """The head's block as leased by the batch step, or one this node leases now and holds while it runs."""
    if args.port_block is not None:
        return block_ports(args.port_block)
    lease = lease_ports(job_id, args.index)
    lease.keep_across_exec()  # `ray start --block` holds the lock too, as long as it runs
    return lease.ports


def main(argv: list[str] | None = None) -> None:
    from relax_core.config import load_recipe

    parser = argparse.ArgumentParser(prog="python -m relax_core.cluster.node")
    parser.add_argument("run_dir")
    parser.add_argument("--group", choices=("train", "rollout", "reference"), required=True)
    parser.add_argument("--index", type=int, required=True, help="position of this node in the job")
    parser.add_argument("--head-address", default="", help="the head's address:port; empty on the head itself")
    parser.add_argument("--port-block", type=int, default=None, help="the head's leased port block")
    parser.add_argument("--scale-op", default=None, help="a node of this scale-out's job (elastic.py)")
    args = parser.parse_args(argv)
    run = RunDir(Path(args.run_dir))
    recipe = load_recipe(run.recipe)
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    for warning in raise_limits():
        print(f"relax node {name}: warning: {warning}", file=sys.stderr, flush=True)
    picked = pick_node_address(recipe, args.head_address or None)
    address = picked.address
    job_id = int(os.environ["SLURM_JOB_ID"])
    command = ray_start_command(recipe, run, group=args.group, index=args.index, name=name, address=address,
                                job_id=job_id, head_address=args.head_address or None,
                                ports=node_ports(args, job_id), scale_op=args.scale_op)
    role = f"{args.group}, scale-out {args.scale_op}" if args.scale_op else args.group
    print(f"relax node {name} ({role}, index {args.index}, {address}): {' '.join(command)}", flush=True)
    env = node_env(recipe, run, args.group, picked)
    try:
        temp_dir = private_temp_dir(ray_temp_dir(job_id, args.index))
    except PrivateDirError as exc:
        print(f"relax node {name}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    code = run_ray_node(command, env, temp_dir_inside(temp_dir), run.logs / "ray" / name)
    shutil.rmtree(temp_dir, ignore_errors=True)  # Ray has ended and its logs are kept in the run directory
    sys.exit(code)


if __name__ == "__main__":
    main()
