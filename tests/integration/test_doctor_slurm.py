"""`relax doctor --slurm` on the test Slurm cluster: a real one-node job reports what its node has."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import fake_apptainer
import pytest
from relax_runs import relax
from slurm_cluster import SlurmCluster
from slurm_site import ROUTABLE_ADDRESS, ROUTABLE_INTERFACE

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def relax_doctor(*args: str) -> subprocess.CompletedProcess:
    return relax("doctor", "--slurm", *args, cwd=REPO, timeout=300)


def test_doctor_slurm_reports_the_compute_node(slurm_cluster: SlurmCluster, tmp_path) -> None:
    proc = relax_doctor(str(QUICKSTART), f"logging.run_root={tmp_path}")
    print(proc.stdout, proc.stderr)  # the report, in the test's output (-s)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = dict(line.split(None, 1) for line in proc.stdout.splitlines() if line.strip() and " " in line)
    client = slurm_cluster.run(["sinfo", "-V"]).stdout.strip()  # e.g. "slurm 22.05.8"
    version = client.split()[-1]
    assert rows["slurm"].strip() == f"client {client}, slurmd {version}"
    job, node = re.fullmatch(r"(\d+) on (\S+)", rows["job"].strip()).groups()
    assert node in slurm_cluster.all_node_names
    open_files = next(line for line in proc.stdout.splitlines() if line.startswith("open files"))
    soft, hard = re.search(r"soft (\S+), hard (\S+) ", open_files).groups()
    assert (soft, hard) == tuple(slurm_cluster.run(["bash", "-c", "echo $(ulimit -Sn) $(ulimit -Hn)"]).stdout.split())
    assert rows["memlock"].startswith("soft ")
    assert rows["login"].strip().startswith("node   reached via")
    # The node's hostname resolves to loopback; Relax takes the one other interface up (the test cluster's veth).
    assert rows["address"].strip() == f"{ROUTABLE_ADDRESS} ({ROUTABLE_INTERFACE})"
    assert "unreachable" in rows["hub"]  # the test cluster's namespace has no route out
    assert rows["gpus"].startswith("none (no nvidia-smi")
    assert rows["infiniband"].strip() == "none"
    assert (tmp_path / next(p.name for p in tmp_path.iterdir()) / f"slurm-{job}.out").exists()


def test_doctor_slurm_names_a_partition_slurm_refuses(slurm_cluster: SlurmCluster, tmp_path) -> None:
    proc = relax_doctor(str(QUICKSTART), f"logging.run_root={tmp_path}", "cluster.slurm.partition=nosuch")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "sbatch refused the job" in proc.stderr and "--partition=nosuch" in proc.stderr


def test_doctor_slurm_uses_the_recipes_interface(slurm_cluster: SlurmCluster, tmp_path) -> None:
    proc = relax_doctor(str(QUICKSTART), f"logging.run_root={tmp_path}", "cluster.network.interface=[lo]")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "address      127.0.0.1 (lo)" in proc.stdout.splitlines()


def test_doctor_slurm_reports_the_containers_relax(slurm_cluster: SlurmCluster, tmp_path) -> None:
    """The job runs the recipe's image (tests/fake_apptainer.py stands in for apptainer, which cannot run here)."""
    from importlib.metadata import version

    path = fake_apptainer.on_path(tmp_path)
    image = tmp_path / "relax.sif"
    image.write_text("SIF")
    proc = subprocess.run([sys.executable, "-m", "relax_cli.main", "doctor", "--slurm", str(QUICKSTART),
                           f"logging.run_root={tmp_path}/runs", f"cluster.container.image={image}"],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=os.environ | {"PATH": path, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ours = version("relax-rl")
    row = next(line for line in proc.stdout.splitlines() if line.startswith("container"))
    assert row.split(None, 1)[1].startswith(f"Relax {ours} (this machine {ours}), libibverbs ")
