"""The recipe's `cluster:` section: the executor, the node groups (train, rollout, reference) and what Slurm is
asked for on each, the Slurm job's options and layout, the container, the network and the hub cache."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from relax_core.config.section import Section


class NodeGroup(Section):
    """One node group of the heterogeneous job."""

    nodes: int = Field(1, ge=0)
    """Number of nodes."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node used by Relax."""
    cpus_per_node: int = Field(2, ge=1)
    """CPU cores per node."""
    mem: str | None = Field(None, pattern=r"^\d+[KMGT]?$")
    """Memory per node as Slurm writes it (e.g. `480G`); the partition default if unset. Where the site
    contains jobs with cgroups (`ConstrainRAMSpace`), that default (often `DefMemPerCPU` times the cores) is
    the node's limit for Ray, the trainer ranks and the engines together: ask for what they need."""
    gpu_type: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """GPU model as the site's Slurm names it (the type in `sinfo -o %G`'s `gpu:a100:8` is `a100`): the job
    asks for `--gres=gpu:<gpu_type>:<gpus_per_node>` on each node. Any model when unset (`--gres=gpu:N`)."""
    gpu_memory_gib: float | None = Field(None, gt=0)
    """Memory of each of this group's GPUs, in GiB: the memory plan (`relax validate`) refuses a recipe whose
    trainer ranks, engines or reference workers would not fit it. From `gpu_type` when unset and the type
    names one size (h100 80, h200 141, ...: launch/memory.py); unchecked otherwise."""
    partition: str | None = None
    """This group's partition; `cluster.slurm.partition` when unset (e.g. rollout nodes in another partition)."""
    account: str | None = None
    """This group's account; `cluster.slurm.account` when unset."""
    qos: str | None = None
    """This group's quality of service; `cluster.slurm.qos` when unset."""
    constraint: str | None = None
    """This group's node features; `cluster.slurm.constraint` when unset."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set for this group's processes (e.g. NCCL settings of a partition)."""

    @model_validator(mode="after")
    def _gpu_type_needs_gpus(self) -> NodeGroup:
        if self.gpu_type and not self.gpus_per_node:
            raise ValueError(f"gpu_type is {self.gpu_type} but gpus_per_node is 0: set gpus_per_node, "
                             "or drop gpu_type")
        if self.gpu_memory_gib and not self.gpus_per_node:
            raise ValueError(f"gpu_memory_gib is {self.gpu_memory_gib:g} but gpus_per_node is 0: set gpus_per_node, "
                             "or drop gpu_memory_gib")
        return self

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def placement(self, slurm: SlurmConfig) -> dict[str, str | None]:
        """Partition, account, QOS and constraint of this group: its own, else `cluster.slurm`'s."""
        return {name: getattr(self, name) or getattr(slurm, name) for name in PLACEMENT}

    def shape(self, slurm: SlurmConfig) -> dict[str, object]:
        """What Slurm is asked for on each of this group's nodes (groups of one shape fit one plain job)."""
        return {"cpus_per_node": self.cpus_per_node, "gpus_per_node": self.gpus_per_node,
                "gpu_type": self.gpu_type, "mem": self.mem} | self.placement(slurm)


# The Slurm settings a node group may set for itself (each defaults to cluster.slurm's).
PLACEMENT = ("partition", "account", "qos", "constraint")


# Slurm accepts MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM and D-HH:MM:SS.
_SLURM_TIME = re.compile(r"^\d+(:\d{2}){0,2}$|^\d+-\d+(:\d{2}){0,2}$")
# sbatch's GPU requests: --gres, --gpus, --gpus-per-node/-task/-socket, -G.
_GPU_OPTION = re.compile(r"^(--gres(?!-flags)|--gpus|-G)")


class SlurmConfig(Section):
    """Slurm options of the job (a node group's partition, account, qos and constraint override these)."""

    partition: str | None = None
    """Partition (`-p`)."""
    account: str | None = None
    """Account to charge (`-A`)."""
    qos: str | None = None
    """Quality of service (`--qos`)."""
    time: str = "04:00:00"
    """Wall-time limit, Slurm format (`HH:MM:SS`, `D-HH:MM:SS`, or minutes)."""
    constraint: str | None = None
    """Node features (`-C`)."""
    layout: Literal["auto", "het", "single"] = "auto"
    """How the node groups become one Slurm job. `single`: one plain job of all the groups' nodes
    (`--nodes=N+M`), split by node list: train's nodes first, then rollout's, then reference's; it needs every
    group to ask for the same node shape (cpus_per_node, gpus_per_node, gpu_type, mem, partition, account,
    qos, constraint). `het`: a heterogeneous job, one component per group (each may differ; site policies
    and submit filters then apply to each component). `auto`: `single` when the shapes are the same, else
    `het`."""
    extra_sbatch: list[str] = Field(default_factory=list)
    """Extra `#SBATCH` option lines, e.g. `--exclusive` (on every component); GPUs are asked for by
    `cluster.<group>.gpus_per_node` and `gpu_type`, never here."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run before anything starts (module load, environment activation)."""
    signal_before_end_s: int = Field(300, ge=30)
    """Seconds before the time limit at which Relax checkpoints and requeues."""
    startup_timeout_s: float = Field(300.0, ge=5.0)
    """How long the job waits for every node to join its Ray cluster before it fails, naming the missing ones."""

    @field_validator("time")
    @classmethod
    def _time_format(cls, value: str) -> str:
        if not _SLURM_TIME.match(value):
            raise ValueError(f"'{value}' is not a Slurm time (use HH:MM:SS, D-HH:MM:SS or minutes)")
        return value

    @field_validator("extra_sbatch")
    @classmethod
    def _no_gpu_options(cls, value: list[str]) -> list[str]:
        for line in value:
            if _GPU_OPTION.match(line.strip()):
                raise ValueError(f"'{line}': Relax writes each group's GPU request itself (--gres=gpu:TYPE:N): "
                                 "set cluster.<group>.gpus_per_node and cluster.<group>.gpu_type (group: train, "
                                 "rollout, reference) instead")
        return value


class ContainerConfig(Section):
    """Run every step inside an Apptainer image."""

    image: str | None = None
    """Path of the `.sif` image; no container when unset."""
    binds: list[str] = Field(default_factory=list)
    """Bind mounts (`src[:dst[:opts]]`) besides those Relax adds: the run directory and every path the recipe
    names (model, tokenizer, data, environment and agent code, reward plug-ins, judge, `checkpoint.dir`, the
    hub cache), each at the same path inside."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set inside the container. The host's environment does not pass in (`--cleanenv`:
    no module's PYTHONPATH, LD_LIBRARY_PATH or NCCL_*), except what Slurm sets for the step (SLURM_*, the GPUs
    it assigned) and RELAX_*, HF_* and WANDB_*; set anything else (NCCL_SOCKET_IFNAME, ...) here."""


_INTERFACE_PATTERN = re.compile(r"[A-Za-z0-9_.:@*?\[\]-]{1,64}")


class NetworkConfig(Section):
    """Which network the job's processes talk over."""

    interface: list[str] | None = None
    """Network interfaces for Ray's node address and NCCL/Gloo sockets, in order of preference: names or shell
    patterns (`[ib0, "ib*", "eth*"]`; one name alone also works); each node takes the first that exists there
    with an IPv4 address, so node types with differently named interfaces share a recipe. Unset: the address
    the node's hostname resolves to, or where that is loopback (127.0.1.1 under Debian's /etc/hosts), the
    interface that routes to the head, the default route's, or the first other interface that is up."""

    @field_validator("interface", mode="before")
    @classmethod
    def _names_or_patterns(cls, value: Any) -> Any:
        names = [value] if isinstance(value, str) else value
        if isinstance(names, list):
            bad = [name for name in names if not isinstance(name, str) or not _INTERFACE_PATTERN.fullmatch(name)]
            if bad or not names:
                raise ValueError(f"{bad or names} is not a list of interface names or patterns (e.g. [ib0, 'eth*'])")
        return names


class ClusterConfig(Section):
    """Where the job runs."""

    executor: Literal["auto", "slurm", "local"] = "auto"
    """`slurm`, `local` (this machine), or `auto` (Slurm when `sbatch` is on PATH)."""
    train: NodeGroup = Field(default_factory=NodeGroup)
    """Training node group (het group 0)."""
    rollout: NodeGroup = Field(default_factory=lambda: NodeGroup(nodes=0))
    """Rollout node group (het group 1); may stay empty in colocate mode (engines then share the training nodes)."""
    reference: NodeGroup = Field(default_factory=lambda: NodeGroup(nodes=0))
    """Reference-model node group (het group 2; `fully_async` with a reference model only): the frozen reference
    model's workers run there, one per GPU (one per node of a CPU group). 0 nodes: no group of its own, the
    trainer ranks hold the reference model and compute its log-probs themselves."""
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    """Slurm options."""
    container: ContainerConfig = Field(default_factory=ContainerConfig)
    """Apptainer container."""
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    """Network selection."""
    hub_cache: str | None = None
    """Shared folder where `relax submit` downloads the recipe's hub models and data sets on the login node
    (compute nodes often have no internet; the job reads them from here with the hub offline); it must be
    visible from every node. Unset: `hub-cache` beside the run directory (in its parent folder)."""

    @property
    def groups(self) -> list[str]:
        """The node groups that have nodes, in het-group order: the job's het group i is `groups[i]`."""
        return [name for name in ("train", "rollout", "reference") if getattr(self, name).nodes]

    @property
    def heterogeneous(self) -> bool:
        """A heterogeneous Slurm job (one component per group), not one plain job (`cluster.slurm.layout`)."""
        return len(self.groups) > 1 and (self.slurm.layout == "het" or bool(self.shape_differences()))

    def shape_differences(self) -> list[str]:
        """Where the groups' node shapes differ, as `cluster.<group>.<field>` is X but ... is Y."""
        first, *others = self.groups or ["train"]
        shape = getattr(self, first).shape(self.slurm)
        return [f"cluster.{name}.{key} is {_unset(value)} but cluster.{first}.{key} is {_unset(shape[key])}"
                for name in others for key, value in getattr(self, name).shape(self.slurm).items()
                if value != shape[key]]

    @model_validator(mode="after")
    def _single_needs_one_shape(self) -> ClusterConfig:
        if self.slurm.layout == "single" and self.shape_differences():
            raise ValueError("slurm.layout is single (one plain job), but the node groups ask for different nodes: "
                             f"{'; '.join(self.shape_differences())}; make them the same, or set "
                             "cluster.slurm.layout to auto or het (a heterogeneous job)")
        return self


def _unset(value: object) -> object:
    return "unset" if value is None else value
