"""What a running job looks like from /proc: its processes and the TCP sockets they listen on.

A test marks a job by an environment variable of its own (`mark_env`), which
every process the job starts inherits (Ray's processes included, whatever
their parent), and adds the driver's descendants (sglang-router overwrites its
environment with its process title), so the job's processes are found without
trusting the code under test. Listening sockets come from `/proc/<pid>/net/tcp{,6}` (the socket
table of that process's network namespace), mapped to processes through the
socket inodes in `/proc/<pid>/fd`.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
MARK = "RELAX_TEST_JOB"
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str
    address: str
    port: int

    def __str__(self) -> str:
        return f"{self.process} (pid {self.pid}) on {self.address}:{self.port}"


def mark_env() -> dict[str, str]:
    """An environment that marks every process started from it."""
    return {MARK: uuid.uuid4().hex}


def marked(env: dict[str, str]) -> list[int]:
    """Live processes whose initial environment carries the mark of `env`."""
    needle = f"{MARK}={env[MARK]}".encode()
    return [pid for pid in _pids() if needle in _read(f"/proc/{pid}/environ").split(b"\0") and alive(pid)]


def job_processes(env: dict[str, str], driver: int) -> dict[int, str]:
    """The job's processes now, by PID: marked ones and the driver's descendants, with their start
    times (a PID that ends may be given to another process later)."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        children.setdefault(_stat(pid)[1] if _stat(pid) else 0, []).append(pid)
    tree, todo = set(), [driver]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return {pid: _stat(pid)[19] for pid in tree | set(marked(env)) if alive(pid)}


def still_running(processes: dict[int, str]) -> list[int]:
    """Those of `processes` (from `job_processes`) that still run as the same process."""
    return [pid for pid, started in processes.items() if alive(pid) and _stat(pid)[19] == started]


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name: state, ppid, ... (field 22, the start time, is [19])."""
    stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
    fields = stat.rsplit(")", 1)[1].split() if stat else []
    return [fields[0], int(fields[1]), *fields[2:]] if fields else []


def alive(pid: int) -> bool:
    """Running (a zombie has ended; only its parent has not collected it yet)."""
    stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
    return bool(stat) and stat.rsplit(")", 1)[1].split()[0] != "Z"


def cmdline(pid: int) -> str:
    """A process's command line (Ray's processes rename themselves `ray::Name`)."""
    return _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()


def describe(pid: int) -> str:
    return cmdline(pid)[:160]


def listeners(pids: list[int]) -> list[Listener]:
    """Every TCP socket in the listening state that one of `pids` holds."""
    found = []
    for pid in pids:
        table = _listening_table(pid)
        for inode in _socket_inodes(pid):
            if inode in table:
                found.append(Listener(pid, describe(pid)[:60], *table[inode]))
    return sorted(set(found), key=lambda item: (item.pid, item.port))


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # "::ffff:127.0.0.1": an IPv6 socket bound to 127.0.0.1
    return (mapped or ip).is_loopback


def start_quickstart(cwd: Path, env: dict[str, str], *overrides: str, prefix: list[str] | None = None):
    """`relax submit recipes/quickstart.yaml` on this machine, in the background; returns the Popen."""
    log = (cwd / "submit.log").open("wb")
    command = [sys.executable, "-m", "relax_cli.main", "submit", str(QUICKSTART), *overrides,
               "--executor", "local", "--run-dir", "runs/job"]
    return subprocess.Popen([*(prefix or []), *command], cwd=cwd, env=os.environ | env | {"NO_COLOR": "1"},
                            stdout=log, stderr=subprocess.STDOUT)


def wait_for_first_step(cwd: Path, proc: subprocess.Popen, timeout: float = 400) -> None:
    metrics = cwd / "runs" / "job" / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().strip():
            return
        assert proc.poll() is None, (cwd / "submit.log").read_text(errors="replace")[-4000:]
        time.sleep(1)
    raise AssertionError(f"no step after {timeout:.0f}s:\n{(cwd / 'submit.log').read_text()[-4000:]}")


def wait_until_gone(env: dict[str, str], processes: dict[int, str], timeout: float) -> list[int]:
    """Wait until none of `processes` and no marked process runs; returns those still running at the deadline."""
    deadline = time.monotonic() + timeout
    while (left := sorted(set(still_running(processes)) | set(marked(env)))) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:  # ended meanwhile
        return b""


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _listening_table(pid: int) -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of the listening sockets in `pid`'s network namespace."""
    table = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in _read(f"/proc/{pid}/net/{name}").decode().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN:
                hex_address, hex_port = fields[1].split(":")
                table[fields[9]] = (_address(hex_address, family), int(hex_port, 16))
    return table


def _address(hex_address: str, family: int) -> str:
    raw = bytes.fromhex(hex_address)
    # The kernel prints each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw)
