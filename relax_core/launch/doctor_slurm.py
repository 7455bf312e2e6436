"""`relax doctor --slurm`: what a compute node has, from a one-node job.

    relax doctor --slurm [RECIPE]

On the login node it opens a TCP socket, writes a folder (`doctor-<time>` in
the recipe's `logging.run_root`, private to the user) with a random token
(mode 0600) and the addresses the socket listens on, and submits a one-node
job to the recipe's partition, account, QOS and constraint (asking for the
training group's GPUs), or to the cluster's defaults without a recipe. The job
runs `python -m relax_core.launch.doctor_slurm --probe FOLDER` with this very
interpreter and writes `report.json` there: the node's Slurm version, its GPUs
and driver (nvidia-smi), its InfiniBand devices and locked-memory limit, its
open-file limit, the address and interface Relax would advertise there
(cluster/address.py), whether a TCP connection to the login node's socket gets
through (it sends the token; the socket answers nothing else and closes when
the job ends), whether the hub answers a HEAD request, and the container's
Relax version when the recipe names an image. Warnings say what to change.

Light imports only: the CLI imports this.
"""

from __future__ import annotations

import hmac
import json
import os
import resource
import secrets
import selectors
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from relax_core.cluster.container import image_ref
from relax_core.errors import UserError

REPORT, REQUEST, TOKEN = "report.json", "request.json", "token"
HUB_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
JOB_TIME = "00:10:00"
NOFILE_WANTED = 65535  # what Ray recommends


# ------------------------------------------------------------------ login node
class DoctorResult:
    """What the job reported (`report`), or why there is no report (`failure`)."""

    def __init__(self, job_id: str, folder: Path, report: dict[str, Any] | None, failure: str | None):
        self.job_id, self.folder, self.report, self.failure = job_id, folder, report, failure


def job_options(recipe) -> list[str]:
    """`#SBATCH` options of the doctor's job: one node of the recipe's training group, as the run's job
    asks for it (partition, account, QOS, constraint, GPUs, CPUs, memory, `extra_sbatch`), for a few minutes."""
    options = ["--job-name=relax-doctor", f"--time={JOB_TIME}"]
    if recipe is None:
        return [*options, "--nodes=1", "--ntasks=1"]
    from relax_core.cluster.slurm_commands import component_options

    node = recipe.cluster.train.model_copy(update={"nodes": 1})
    return [o for o in component_options(recipe, node) if not o.startswith("--time=")] + options


def run_doctor(recipe=None, *, timeout_s: float = 600.0, on_wait=None) -> DoctorResult:
    """Submit the doctor's job and wait for its report; `scancel` it if it has not ended by `timeout_s`."""
    if not shutil.which("sbatch"):
        raise UserError("relax doctor --slurm: sbatch is not on PATH (load Slurm's module)")
    root = Path(recipe.logging.run_root if recipe is not None else "runs").expanduser().resolve()
    folder = root / time.strftime("doctor-%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, mode=0o700)
    token = secrets.token_hex(16)
    fd = os.open(folder / TOKEN, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("", 0))
        server.listen(8)
        request = {"login": login_addresses(), "port": server.getsockname()[1],
                   "image": image_ref(recipe.cluster.container.image) if recipe is not None
                   and recipe.cluster.container.image else None,
                   "interface": recipe.cluster.network.interface if recipe is not None else None}
        (folder / REQUEST).write_text(json.dumps(request))
        job_id = submit(folder, job_options(recipe))
        connected = serve_until_done(server, token, job_id, folder, timeout_s, on_wait)
    report_file = folder / REPORT
    if report_file.exists():
        report = json.loads(report_file.read_text())
        report["login_connection"] = connected  # what the login node's side saw
        return DoctorResult(job_id, folder, report, None)
    return DoctorResult(job_id, folder, None, failure_reason(job_id, folder))


def login_addresses() -> list[str]:
    """Where the compute node may reach this machine: its name, then each interface's IPv4 address."""
    from relax_core.cluster.address import interfaces, ipv4_address

    addresses = [socket.getfqdn()]
    addresses += [a for a in (ipv4_address(name) for name in interfaces()) if a and a not in addresses]
    return addresses


def submit(folder: Path, options: list[str]) -> str:
    argv = [sys.executable, "-m", __name__, "--probe", str(folder)]
    script = "#!/bin/bash\n" + "".join(f"#SBATCH {o}\n" for o in options)
    script += f"#SBATCH --output={folder / 'slurm-%j.out'}\n" + f"exec {shlex.join(argv)}\n"
    (folder / "doctor.sbatch").write_text(script)
    proc = subprocess.run(["sbatch", "--parsable", str(folder / "doctor.sbatch")], capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        raise UserError(f"relax doctor --slurm: sbatch refused the job: {proc.stderr.strip()} "
                        f"(options: {' '.join(options)}; the recipe's cluster.slurm sets them)")
    return proc.stdout.strip().split(";")[0]


def serve_until_done(server: socket.socket, token: str, job_id: str, folder: Path, timeout_s: float,
                     on_wait) -> str | None:
    """Answer the job's connection (the right token only) until the job has ended; returns the address
    the job connected from, or None."""
    connected, deadline, last_state = None, time.monotonic() + timeout_s, None
    with selectors.DefaultSelector() as selector:
        selector.register(server, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            for _ in selector.select(timeout=1.0):
                conn, peer = server.accept()
                with conn:
                    conn.settimeout(CONNECT_TIMEOUT_S)
                    try:
                        sent = conn.recv(256).decode(errors="replace").strip()
                    except OSError:
                        continue
                    if hmac.compare_digest(sent, token):
                        conn.sendall(b"ok\n")
                        connected = peer[0]
            state = job_state(job_id)
            if state != last_state and on_wait is not None:
                on_wait(job_id, state or "ended")
            last_state = state
            if state is None:
                return connected
        subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
        (folder / "timed-out").write_text(f"{timeout_s:.0f} s\n")
    return connected


def job_state(job_id: str) -> str | None:
    """The job's state while Slurm lists it, else None."""
    proc = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60)
    state = proc.stdout.strip()
    return state if proc.returncode == 0 and state else None


def failure_reason(job_id: str, folder: Path) -> str:
    if (folder / "timed-out").exists():
        return (f"job {job_id} did not end within {(folder / 'timed-out').read_text().strip()} and was cancelled "
                f"(busy partition? `relax doctor --slurm --timeout` waits longer); see {folder}")
    out = folder / f"slurm-{job_id}.out"
    tail = "\n".join(out.read_text(errors="replace").splitlines()[-10:]) if out.exists() else "(no output)"
    return f"job {job_id} ended without a report; its output ({out}):\n{tail}"


# ------------------------------------------------------------------ compute node
def probe(folder: Path) -> dict[str, Any]:
    """Everything the report holds, measured on this node."""
    request = json.loads((folder / REQUEST).read_text())
    report: dict[str, Any] = {"node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(), "warnings": []}
    report["slurm"] = slurm_versions(report["node"])
    report["gpus"] = gpus()
    report.update(limits(report["warnings"]))
    report["address"], report["login"] = address_and_login(request, (folder / TOKEN).read_text().strip())
    report["hub"] = hub_reachable(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    if request.get("image"):
        report["container"] = container_relax(request["image"])
        report["warnings"] += container_warnings(report["container"], report["infiniband"])
    return report


def slurm_versions(node: str) -> dict[str, str]:
    client = _run(["sinfo", "-V"]) or "?"
    record = _run(["scontrol", "show", "node", node]) or ""
    fields = dict(item.split("=", 1) for item in record.split() if "=" in item)
    return {"client": client, "slurmd": fields.get("Version", "?")}


def gpus() -> dict[str, Any]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not shutil.which("nvidia-smi"):
        return {"devices": [], "driver": None, "detail": "no nvidia-smi on this node",
                "CUDA_VISIBLE_DEVICES": visible}
    out = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    rows = [[part.strip() for part in line.split(",")] for line in (out or "").splitlines() if line.strip()]
    return {"devices": [row[0] for row in rows], "driver": rows[0][1] if rows and len(rows[0]) > 1 else None,
            "detail": "nvidia-smi" if out is not None else "nvidia-smi failed", "CUDA_VISIBLE_DEVICES": visible}


def limits(warnings: list[str]) -> dict[str, Any]:
    """The limits the job got from Slurm, then what a Ray node raises them to (cluster/node.py) and its warnings."""
    from relax_core.cluster.node import INFINIBAND, raise_limits

    kinds = {"nofile": resource.RLIMIT_NOFILE, "memlock": resource.RLIMIT_MEMLOCK}
    got = {name: resource.getrlimit(kind) for name, kind in kinds.items()}
    warnings += raise_limits()
    raised = {name: resource.getrlimit(kind) for name, kind in kinds.items()}
    devices = sorted(path.name for path in INFINIBAND.iterdir()) if INFINIBAND.is_dir() else []
    return {"infiniband": devices,
            "limits": {name: {"soft": _limit(got[name][0]), "hard": _limit(got[name][1]),
                              "relax_raises_to": _limit(raised[name][0])} for name in got}}


def address_and_login(request: dict[str, Any], token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The address Relax would advertise here (toward the login node, as toward a head), and a TCP connect
    to the login node's socket with the token."""
    from relax_core.cluster.address import pick_address

    attempts = []
    for host in request["login"]:
        try:
            with socket.create_connection((host, request["port"]), timeout=CONNECT_TIMEOUT_S) as conn:
                conn.sendall(token.encode() + b"\n")
                conn.settimeout(CONNECT_TIMEOUT_S)
                if conn.recv(16).strip() == b"ok":
                    login = {"reached": True, "via": host, "failed": attempts}
                    break
                attempts.append(f"{host}: no answer")
        except OSError as exc:
            attempts.append(f"{host}: {exc}")
    else:
        login = {"reached": False, "via": None, "failed": attempts}
    try:
        picked = pick_address(request.get("interface"), head=login["via"] or request["login"][0], multi_node=True)
        address = {"address": picked.address, "interface": picked.interface or "(by hostname)"}
    except RuntimeError as exc:
        address = {"address": None, "interface": None, "error": str(exc)}
    return address, login


def hub_reachable(endpoint: str) -> dict[str, Any]:
    request = urllib.request.Request(endpoint, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=HUB_TIMEOUT_S) as response:
            return {"endpoint": endpoint, "reachable": True, "detail": f"HTTP {response.status}"}
    except urllib.error.HTTPError as exc:  # an answer is an answer
        return {"endpoint": endpoint, "reachable": True, "detail": f"HTTP {exc.code}"}
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return {"endpoint": endpoint, "reachable": False, "detail": str(reason)}


def container_relax(image: str) -> dict[str, Any]:
    from relax_core.launch.container import probe_image

    found = probe_image(image)
    if isinstance(found, str):
        return {"image": image, "relax": None, "libibverbs": None, "detail": found}
    return {"image": image, "relax": found[0], "libibverbs": found[1], "detail": "apptainer exec"}


def container_warnings(found: dict[str, Any], infiniband: list[str]) -> list[str]:
    from importlib.metadata import version

    if found["relax"] is None:
        return [f"cluster.container.image: {found['detail']}"]
    warnings = []
    if found["relax"] != version("relax-rl"):
        warnings.append(f"cluster.container.image: the image has Relax {found['relax']}, the host "
                        f"{version('relax-rl')}; relax submit refuses it: rebuild the image from this checkout")
    if infiniband and not found["libibverbs"]:
        warnings.append(f"cluster.container.image: this node has InfiniBand ({', '.join(infiniband)}) but the image "
                        "has no libibverbs: NCCL would use TCP; rebuild it with apptainer/relax.def (rdma-core)")
    return warnings


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def _run(argv: list[str]) -> str | None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


# ------------------------------------------------------------------ report
def table(result: DoctorResult, host_relax: str) -> list[tuple[str, str]]:
    """The report as (check, finding) rows."""
    r = result.report or {}
    lim, gpu, login, address = r.get("limits", {}), r.get("gpus", {}), r.get("login", {}), r.get("address", {})
    rows = [("job", f"{result.job_id} on {r.get('node')}"),
            ("slurm", f"client {r['slurm']['client']}, slurmd {r['slurm']['slurmd']}"),
            ("gpus", f"{len(gpu['devices'])} x {', '.join(sorted(set(gpu['devices'])))}, driver {gpu['driver']}"
             if gpu.get("devices") else f"none ({gpu.get('detail')})"),
            ("infiniband", ", ".join(r.get("infiniband") or []) or "none"),
            ("memlock", _limits_row(lim.get("memlock", {}))),
            ("open files", _limits_row(lim.get("nofile", {}))),
            ("address", f"{address.get('address')} ({address.get('interface')})" if address.get("address")
             else f"none: {address.get('error')}"),
            ("login node", f"reached via {login['via']}" if login.get("reached")
             else "not reached: " + "; ".join(login.get("failed") or ["no address to try"])),
            ("hub", f"{r['hub']['endpoint']}: {'reachable' if r['hub']['reachable'] else 'unreachable'} "
                    f"({r['hub']['detail']})")]
    if "container" in r:
        c = r["container"]
        rows.append(("container", f"Relax {c['relax']} (this machine {host_relax}), libibverbs "
                                  f"{c['libibverbs'] or 'missing'}" if c["relax"] else c["detail"]))
    return rows + [("warning", w) for w in r.get("warnings", [])]


def _limits_row(limit: dict[str, str]) -> str:
    return (f"soft {limit.get('soft')}, hard {limit.get('hard')} "
            f"(a Ray node raises it to {limit.get('relax_raises_to')})")


def main(argv: list[str] | None = None) -> int:
    """`python -m relax_core.launch.doctor_slurm --probe FOLDER`: the job's side."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "--probe":
        print("usage: python -m relax_core.launch.doctor_slurm --probe FOLDER", file=sys.stderr)
        return 2
    folder = Path(args[1])
    report = probe(folder)
    (folder / (REPORT + ".tmp")).write_text(json.dumps(report, indent=2))
    os.replace(folder / (REPORT + ".tmp"), folder / REPORT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
