"""Site policies of a shared university cluster, for the test Slurm cluster.

tests/slurm_cluster.py starts the daemons; this module adds what makes a
node shared the way a university's is:

- a second Unix user, `relaxtest2` (no password, no home), whose jobs run on
  the same nodes as root's (`SlurmCluster.submit_as`);
- `fs.protected_regular=1`, systemd's default: opening another user's file in
  a sticky world-writable directory (/tmp) with O_CREAT is refused, even to
  root. It is a global sysctl (not per namespace): the fixture sets it while
  the cluster runs and puts the old value back;
- a node, `d1` (partition "debian"), whose hostname resolves to 127.0.1.1 as
  under Debian's and Ubuntu's default /etc/hosts: its slurmd, and so every
  job step on it, runs in mount and UTS namespaces of its own, with hostname
  `d1` and a private /etc/hosts bound over the real one. The node also has a
  routable address: 10.77.0.1/24 on `relax0`, one end of a veth pair (its
  peer `relax0p` has no address; this kernel has no dummy interfaces) in
  the tests' network namespace, which every node shares.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SECOND_USER = "relaxtest2"
DEBIAN_NODE = "d1"  # hostname resolves to LOOPBACK_HOST_ADDRESS in its steps
LOOPBACK_HOST_ADDRESS = "127.0.1.1"
ROUTABLE_INTERFACE = "relax0"
ROUTABLE_PEER = "relax0p"
ROUTABLE_ADDRESS = "10.77.0.1"
PROTECTED_REGULAR = Path("/proc/sys/fs/protected_regular")


def ensure_user(name: str) -> None:
    """Create the Unix user `name` (no home, no password) unless it exists; needs root and useradd."""
    try:
        pwd.getpwnam(name)
        return
    except KeyError:
        pass
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    proc = subprocess.run([useradd, "-M", "-s", "/bin/bash", name], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"could not create the test user {name}: {proc.stderr.strip()}")


def owned_dir(path: Path, user: str, mode: int = 0o755) -> Path:
    """`path` as a directory that belongs to `user`."""
    path.mkdir(parents=True, exist_ok=True)
    entry = pwd.getpwnam(user)
    os.chown(path, entry.pw_uid, entry.pw_gid)
    path.chmod(mode)
    return path


def as_user(user: str, argv: list[str]) -> list[str]:
    """`argv` run as `user`, keeping this environment (SLURM_CONF, PATH) as su does without -l."""
    return argv if user == pwd.getpwuid(os.getuid()).pw_name else ["runuser", "-u", user, "--", *argv]


@contextmanager
def sysctl(path: Path, value: str) -> Iterator[bool]:
    """Set the sysctl at `path` (a /proc/sys file) while the block runs, then restore it.

    Yields whether the value holds: False where this process may not write it
    (without root, or in a user namespace), and then nothing is changed.
    """
    old = path.read_text().strip()
    try:
        path.write_text(value)
    except OSError:
        yield old == value
        return
    try:
        yield True
    finally:
        path.write_text(old)


def debian_hosts(hostname: str) -> str:
    """/etc/hosts as Debian's installer writes it: the host's own name on 127.0.1.1."""
    return f"127.0.0.1\tlocalhost\n{LOOPBACK_HOST_ADDRESS}\t{hostname}.relax.test {hostname}\n"


def with_own_hostname(hostname: str, hosts_file: Path, argv: list[str]) -> list[str]:
    """`argv` run in mount and UTS namespaces of its own: hostname `hostname`, `hosts_file` as /etc/hosts."""
    script = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
    return ["unshare", "--mount", "--uts", "sh", "-c", script, "sh", str(hosts_file), hostname, *argv]


def add_routable_address() -> None:
    """Give this network namespace a non-loopback address: ROUTABLE_ADDRESS on one end of a veth pair, both up."""
    for argv in (
        ["ip", "link", "add", ROUTABLE_INTERFACE, "type", "veth", "peer", "name", ROUTABLE_PEER],
        ["ip", "addr", "add", f"{ROUTABLE_ADDRESS}/24", "dev", ROUTABLE_INTERFACE],
        ["ip", "link", "set", ROUTABLE_PEER, "up"],
        ["ip", "link", "set", ROUTABLE_INTERFACE, "up"],
    ):
        subprocess.run(argv, check=True, capture_output=True)


def remove_routable_address() -> None:
    subprocess.run(["ip", "link", "del", ROUTABLE_INTERFACE], capture_output=True)
