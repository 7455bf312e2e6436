"""Ports of a job's Ray nodes: a block per node, leased for as long as the node runs.

Every Ray node needs `BLOCK_SIZE` ports that the other nodes reach (GCS,
raylet, agents, 100 worker ports): explicit ones, below Linux's ephemeral range
(32768), so a firewall can allow the range and no port depends on what the
kernel handed out to someone else. Several jobs (of this user or others), and
on the test host several node names, share a machine, so a node leases its
block (`lease_ports`) before it starts:

- it holds the block's lock file (`flock`) in a node-local folder all users
  share; the kernel releases it when the last process holding it ends, however
  it ends, so a crashed job never keeps its block; a lock file another user
  made is locked as it is (never re-created: `fs.protected_regular` forbids
  that), so two users never lease one block;
- every port of the block can be bound right now (another program may use one);
- the search starts at a block derived from the job id and the node's index,
  and walks on to the next one that passes both checks.

The head's block is leased by the batch step (on the head's machine), which
needs the GCS port before any node starts, and handed to the head (`--port-block`).
A job id alone (`job_id % 20` blocks, as before) made 1 pair of jobs in 20 collide.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

FIRST_PORT = 10000
LAST_PORT = 32767  # the ephemeral range starts above
BLOCK_SIZE = 120
BLOCKS = (LAST_PORT + 1 - FIRST_PORT) // BLOCK_SIZE
NODE_SLOTS = 8  # a job's nodes start their search this many blocks apart
WORKER_PORTS = 100
WORKER_OFFSET = 20


@dataclass(frozen=True)
class NodePorts:
    block: int
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


def block_ports(block: int) -> NodePorts:
    """The ports of block number `block` (0 <= block < BLOCKS)."""
    base = FIRST_PORT + block * BLOCK_SIZE
    return NodePorts(
        block=block, gcs=base, node_manager=base + 1, object_manager=base + 2, dashboard_agent_listen=base + 3,
        dashboard_agent_grpc=base + 4, runtime_env_agent=base + 5, metrics_export=base + 6,
        ray_client_server=base + 7, min_worker=base + WORKER_OFFSET,
        max_worker=base + WORKER_OFFSET + WORKER_PORTS - 1,
    )  # fmt: skip


class PortLease:
    """A leased block: its lock file stays held while this object's file descriptor is open."""

    def __init__(self, ports: NodePorts, fd: int):
        self.ports, self.fd = ports, fd

    def keep_across_exec(self) -> None:
        """Let a program this process `exec`s (`ray start --block`) hold the lease on."""
        os.set_inheritable(self.fd, True)

    def release(self) -> None:
        os.close(self.fd)


def lock_dir() -> Path:
    """The node-local folder of the lock files, shared by every user of the machine (sticky, like /tmp)."""
    path = Path(os.environ.get("RELAX_RAY_TMP", tempfile.gettempdir())) / "relax-ports"
    try:
        path.mkdir()
        path.chmod(0o1777)
    except FileExistsError:
        pass
    return path


def lease_ports(job_id: int, node_index: int, folder: Path | None = None) -> PortLease:
    """Lease the first free block, searching from the one the job id and node index point to."""
    folder = folder or lock_dir()
    first = (job_id * NODE_SLOTS + node_index) % BLOCKS
    for block in [(first + i) % BLOCKS for i in range(BLOCKS)]:
        fd = _try_lock(folder / f"block-{block}.lock")
        if fd is None:
            continue
        if _all_free(block_ports(block)):
            return PortLease(block_ports(block), fd)
        os.close(fd)
    raise RuntimeError(f"no free block of {BLOCK_SIZE} ports in {FIRST_PORT}-{LAST_PORT} on this node "
                       f"(locks in {folder})")


def _try_lock(path: Path) -> int | None:
    """The lock file's descriptor, locked; None when the block is taken (locked, or a file this user cannot use)."""
    fd = _open_lock_file(path)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return None
        raise


def _open_lock_file(path: Path) -> int | None:
    """Open (read-only suffices for flock) the block's lock file, another user's as well as this one's.

    An existing file opens without O_CREAT: with `fs.protected_regular` (systemd's default) the kernel refuses
    O_CREAT on another user's file in a sticky world-writable folder, even to root. A missing one is created
    with O_EXCL and made readable by all, so every user's leases see it. What is not a plain file this user
    can read (a symlink, a FIFO, a file another user made private) counts as a taken block, never followed.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    for _ in range(3):  # another process may create or remove the file between the two opens
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
                os.fchmod(fd, 0o644)  # whatever this user's umask
            except FileExistsError:
                continue
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.ELOOP):
                return None
            raise
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
        return None
    return None


def _all_free(ports: NodePorts) -> bool:
    """Whether nothing listens on (or holds) any port of the block, on any address."""
    for port in range(ports.gcs, ports.gcs + BLOCK_SIZE):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("", port))
            except OSError:
                return False
    return True


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on `host` only (port 0: one the kernel picks), to hand to the server
    that serves on it: nothing can take the port between choosing and binding it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def candidate_port(host: str) -> int:
    """A port free on `host` now, for a server that cannot be handed a socket (sglang-router):
    another process may bind it first, so the caller retries with a new one on "address in use"."""
    with listening_socket(host) as sock:
        return sock.getsockname()[1]
