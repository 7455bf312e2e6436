"""Ports of one job's Ray nodes, derived from the Slurm job id.

Each job gets a block of 1000 ports, each node (by its position in the job)
120 of them, all below Linux's ephemeral range (32768), so two jobs sharing a
node, or several node names on one test host, do not collide, and nothing
depends on a port the kernel happened to hand out.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_PORT = 10000
JOB_BLOCKS = 20  # job blocks of 1000 ports: 10000 .. 29999
NODE_SLOTS = 8  # nodes per block that get distinct ports (only nodes on one host need them)
NODE_STRIDE = 120
WORKER_PORTS = 100


@dataclass(frozen=True)
class NodePorts:
    gcs: int
    node_manager: int
    object_manager: int
    dashboard_agent_listen: int
    dashboard_agent_grpc: int
    runtime_env_agent: int
    metrics_export: int
    ray_client_server: int
    min_worker: int
    max_worker: int

    def ray_start_flags(self, head: bool) -> list[str]:
        flags = [
            f"--node-manager-port={self.node_manager}",
            f"--object-manager-port={self.object_manager}",
            f"--dashboard-agent-listen-port={self.dashboard_agent_listen}",
            f"--dashboard-agent-grpc-port={self.dashboard_agent_grpc}",
            f"--runtime-env-agent-port={self.runtime_env_agent}",
            f"--metrics-export-port={self.metrics_export}",
            f"--min-worker-port={self.min_worker}",
            f"--max-worker-port={self.max_worker}",
        ]
        if head:
            flags += [f"--port={self.gcs}", f"--ray-client-server-port={self.ray_client_server}"]
        return flags


def node_ports(job_id: int, node_index: int) -> NodePorts:
    base = FIRST_PORT + (job_id % JOB_BLOCKS) * 1000 + (node_index % NODE_SLOTS) * NODE_STRIDE
    return NodePorts(
        gcs=base, node_manager=base + 1, object_manager=base + 2, dashboard_agent_listen=base + 3,
        dashboard_agent_grpc=base + 4, runtime_env_agent=base + 5, metrics_export=base + 6,
        ray_client_server=base + 7, min_worker=base + 20, max_worker=base + 20 + WORKER_PORTS - 1,
    )
