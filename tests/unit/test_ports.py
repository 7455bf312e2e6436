"""Port blocks of Ray nodes sharing a machine: leased blocks never share a port.

Real locks (flock on files in a temporary folder) and real binds on this
machine; each lease here stands for one Ray node of some job. Two users on one
node: a real second Unix user (created when absent; the suite runs as root in CI)
and the kernel's `fs.protected_regular=1` (systemd's default), set for the test.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from relax_core.cluster.ports import BLOCKS, block_ports, lease_ports

REPO = Path(__file__).resolve().parents[2]
SECOND_USER = "relaxtest2"  # tests/slurm_cluster.py's second user runs jobs under the same name


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


@pytest.fixture
def second_user() -> pwd.struct_passwd:
    """Another Unix user of this machine (created with useradd when absent: needs root, as CI runs)."""
    assert os.geteuid() == 0, "this test needs root: it creates a second Unix user and sets fs.protected_regular"
    try:
        return pwd.getpwnam(SECOND_USER)
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", SECOND_USER], check=True)
        return pwd.getpwnam(SECOND_USER)


@pytest.fixture
def protected_regular():
    """fs.protected_regular=1 for the test (a global sysctl: its value is put back)."""
    sysctl = Path("/proc/sys/fs/protected_regular")
    before = sysctl.read_text()
    sysctl.write_text("1")
    yield
    sysctl.write_text(before)


@pytest.fixture
def shared_folder():
    """A lock folder like /tmp/relax-ports: sticky and world-writable, on /tmp (reachable by every user)."""
    folder = Path(tempfile.mkdtemp(prefix="relax-ports-test-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder)


HOLD_AS_USER = """
import sys, time
from pathlib import Path
from relax_core.cluster.ports import lease_ports
lease = lease_ports(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
print(lease.ports.block, flush=True)
sys.stdin.read()
"""


def runs_as(user: pwd.struct_passwd, python: str) -> bool:
    try:
        return subprocess.run([python, "-c", ""], user=user.pw_uid, group=user.pw_gid, extra_groups=[]).returncode == 0
    except PermissionError:
        return False


def hold_as(user: pwd.struct_passwd, job: int, node: int, folder: Path) -> tuple[subprocess.Popen, int]:
    """A process of `user` holding a lease until its stdin closes, and the block it leased."""
    python = next(p for p in (sys.executable, "/usr/bin/python3") if runs_as(user, p))  # pyenv's is under /root
    proc = subprocess.Popen([python, "-c", HOLD_AS_USER, str(job), str(node), str(folder)], user=user.pw_uid,
                            group=user.pw_gid, extra_groups=[], cwd="/", env={"PYTHONPATH": str(REPO)},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.strip().isdigit(), proc.stderr.read() if proc.poll() is not None else line
    return proc, int(line)


def test_two_users_on_one_node_never_share_a_block(second_user, protected_regular, shared_folder):
    # The other user leases first, so the lock files on the way are theirs; this user leases beside them.
    other, their_block = hold_as(second_user, 7, 0, shared_folder)
    try:
        assert (shared_folder / f"block-{their_block}.lock").stat().st_uid == second_user.pw_uid
        mine = lease_ports(7, 0, shared_folder)  # the same job id on another user's cluster: same first block
        assert mine.ports.block != their_block
    finally:
        other.stdin.close()
        other.wait(timeout=30)
    # They are gone, their lock file stays behind: this user leases its block now.
    again = lease_ports(7, 0, shared_folder)
    assert again.ports.block == their_block
    # And the other way round: the other user locks the files this user made, and takes neither block.
    other, theirs = hold_as(second_user, 7, 0, shared_folder)
    other.stdin.close()
    other.wait(timeout=30)
    assert theirs not in (mine.ports.block, again.ports.block)
    assert (shared_folder / f"block-{mine.ports.block}.lock").stat().st_uid == 0
