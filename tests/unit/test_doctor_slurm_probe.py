"""`relax doctor --slurm`'s job options and command line (the job itself: tests/integration/test_doctor_slurm.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from relax_core.config import load_recipe
from relax_core.launch.doctor_slurm import job_options

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def test_the_job_goes_where_the_recipes_training_group_would():
    recipe = load_recipe(QUICKSTART, ["cluster.slurm.partition=gpu", "cluster.slurm.account=proj1",
                                      "cluster.slurm.qos=short", "cluster.slurm.constraint=a100",
                                      "cluster.train.gpus_per_node=4"])
    options = job_options(recipe)
    for option in ("--partition=gpu", "--account=proj1", "--qos=short", "--constraint=a100", "--nodes=1"):
        assert option in options
    assert [o for o in options if "gpu" in o and "4" in o] in (["--gres=gpu:4"], ["--gpus-per-node=4"])
    assert [o for o in options if o.startswith("--time=")] == ["--time=00:10:00"]  # not the run's hours


def test_without_a_recipe_the_cluster_defaults_apply():
    assert sorted(job_options(None)) == ["--job-name=relax-doctor", "--nodes=1", "--ntasks=1", "--time=00:10:00"]


def test_a_recipe_without_slurm_is_refused():
    proc = subprocess.run([sys.executable, "-m", "relax_cli.main", "doctor", str(QUICKSTART)], capture_output=True,
                          text=True, cwd=REPO, env=os.environ | {"COLUMNS": "200"}, timeout=120)
    assert proc.returncode == 2
    assert "--slurm" in proc.stderr


def _login_socket(token: str):
    """A socket answering as relax doctor's login side does: `ok` to the right token, nothing otherwise."""
    import hmac
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))

    def answer():
        for _ in range(2):
            conn, _ = server.accept()
            with conn:
                if hmac.compare_digest(conn.recv(256).decode().strip(), token):
                    conn.sendall(b"ok\n")

    threading.Thread(target=answer, daemon=True).start()
    return server


def test_the_probe_reaches_the_login_node_with_the_token_only():
    from relax_core.launch.doctor_slurm import address_and_login

    server = _login_socket("s3cret")
    request = {"login": ["127.0.0.1"], "port": server.getsockname()[1], "interface": ["lo"]}
    address, login = address_and_login(request, "s3cret")
    assert login == {"reached": True, "via": "127.0.0.1", "failed": []}
    assert address == {"address": "127.0.0.1", "interface": "lo"}  # cluster.network.interface decides
    address, login = address_and_login(request, "wrong")
    assert login == {"reached": False, "via": None, "failed": ["127.0.0.1: no answer"]}
    server.close()
