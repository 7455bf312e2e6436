"""Port blocks of Ray nodes sharing a machine: leased blocks never share a port.

Real locks (flock on files in a temporary folder) and real binds on this
machine; each lease here stands for one Ray node of some job.
"""

from __future__ import annotations

import socket
import subprocess
import sys

from relax_core.cluster.ports import BLOCKS, block_ports, lease_ports


def ports_of(lease) -> set[int]:
    p = lease.ports
    return {p.gcs, p.node_manager, p.object_manager, p.dashboard_agent_listen, p.dashboard_agent_grpc,
            p.runtime_env_agent, p.metrics_export, p.ray_client_server, *range(p.min_worker, p.max_worker + 1)}


def test_many_jobs_on_one_node_never_share_a_port_while_held(tmp_path):
    # Job ids that collided before (the same id modulo 20) and nodes of one job on one host.
    requests = [(job, node) for job in (7, 27, 47, 1007, 123456) for node in range(4)] + [(7, 0)] * 3
    leases = [lease_ports(job, node, tmp_path) for job, node in requests]
    taken: set[int] = set()
    for lease in leases:
        assert not ports_of(lease) & taken, f"block {lease.ports.block} overlaps another held block"
        taken |= ports_of(lease)
    assert len({lease.ports.block for lease in leases}) == len(requests)
    assert all(10000 <= port < 32768 for port in taken)  # below the ephemeral range


def test_a_released_block_is_leased_again(tmp_path):
    first = lease_ports(42, 0, tmp_path)
    block = first.ports.block
    assert lease_ports(42, 0, tmp_path).ports.block != block  # held: the next one is taken
    first.release()
    assert lease_ports(42, 0, tmp_path).ports.block == block


def test_a_lease_held_by_a_process_that_died_is_free(tmp_path):
    code = ("import sys, os; from relax_core.cluster.ports import lease_ports; "
            f"lease = lease_ports(5, 1, __import__('pathlib').Path({str(tmp_path)!r})); print(lease.ports.block); "
            "os._exit(0)")  # ends without releasing anything
    block = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert lease_ports(5, 1, tmp_path).ports.block == block


def test_a_block_whose_port_another_program_uses_is_skipped(tmp_path):
    wanted = lease_ports(99, 2, tmp_path)
    block = wanted.ports.block
    wanted.release()
    with socket.socket() as other:  # some other program listens on a worker port of that block
        other.bind(("127.0.0.1", block_ports(block).min_worker + 7))
        other.listen()
        lease = lease_ports(99, 2, tmp_path)
        assert lease.ports.block == (block + 1) % BLOCKS
