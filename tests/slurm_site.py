"""Site policies of a shared university cluster, for the test Slurm cluster.

tests/slurm_cluster.py starts the daemons; this module adds what makes a
node shared the way a university's is:

- a second Unix user, `relaxtest2` (no password, no home), whose jobs run on
  the same nodes as root's (`SlurmCluster.submit_as`);
- `fs.protected_regular=1`, systemd's default: opening another user's file in
  a sticky world-writable directory (/tmp) with O_CREAT is refused, even to
  root. It is a global sysctl (not per namespace): the fixture sets it while
  the cluster runs and puts the old value back.
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
