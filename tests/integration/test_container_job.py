"""A Relax Slurm job whose steps run in a container: the whole quickstart, through a stand-in apptainer.

Apptainer cannot run on the test machine; tests/fake_apptainer.py takes its place on PATH. It applies
`--cleanenv`, `APPTAINERENV_*`, `--env` and the binds' existence as Apptainer documents them and records
each call, then runs the step's command for real: the Ray nodes and the driver run and train.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_slurm_launch import ON_TWO_NODES, QUICKSTART, final_status, logs_of

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]


def test_a_container_job_runs_with_a_clean_environment_and_the_recipes_paths_bound(slurm_cluster, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apptainer").write_text(f"#!/bin/sh\nexec {sys.executable} {REPO / 'tests' / 'fake_apptainer.py'} "
                                       '"$@"\n')
    (bin_dir / "apptainer").chmod(0o755)
    (bin_dir / "python3").symlink_to(sys.executable)
    image = tmp_path / "relax.sif"  # the image's Python imports this checkout's Relax
    image.write_text(json.dumps({"env": {"PYTHONPATH": str(REPO)}}))
    plugins, scratch = tmp_path / "plugins", tmp_path / "scratch"
    plugins.mkdir()
    scratch.mkdir()
    calls = tmp_path / "apptainer.jsonl"
    env = os.environ | {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_APPTAINER_LOG": str(calls),
                        "HF_HUB_OFFLINE": "1", "NCCL_IB_HCA": "mlx5_from_a_module", "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "relax_cli.main", "submit", str(QUICKSTART), *ON_TWO_NODES,
                           "train.steps=3", f"cluster.container.image={image}", f"reward.plugin_dirs=[{plugins}]",
                           f"checkpoint.dir={scratch}/ckpt/quick", "--executor", "slurm", "--run-dir", "runs/c"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "runs" / "c"
    final = final_status(tmp_path, "runs/c", 300, "the container job to finish")
    assert final["state"] == "completed", logs_of(run)
    steps = [json.loads(line) for line in calls.read_text().splitlines() if "-m" in json.loads(line)["argv"]]
    job_id = str(final["job_id"])
    started = []
    for call in steps:
        argv, caller = call["argv"], call["env"]
        assert argv[1:3] == ["exec", "--cleanenv"]
        binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
        # The plug-in folder, the checkpoint folder's nearest existing parent, the run directory, each once.
        assert {str(plugins), str(scratch), str(run)} <= set(binds) and len(binds) == len(set(binds)), binds
        assert caller["APPTAINERENV_SLURM_JOB_ID"] == job_id  # what srun set for the step, passed in
        assert "APPTAINERENV_NCCL_IB_HCA" not in caller  # a module's NCCL setting stays out
        started.append((argv[argv.index("-m") + 1], caller["APPTAINERENV_SLURMD_NODENAME"]))
    assert sorted(started) == [("relax_core.cluster.node", "n1"), ("relax_core.cluster.node", "n2"),
                               ("relax_core.entrypoints.slurm_driver", "n1")]
