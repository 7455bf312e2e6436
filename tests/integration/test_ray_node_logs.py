"""A Ray node of a Slurm job, started by its real entrypoint (`python -m relax_core.cluster.node`, as the
job's srun step runs it, here without Slurm: the job's variables set by hand): Ray runs with the open-file
limit raised from a login shell's 1024, and when the step is stopped with SIGTERM (what Slurm sends at a
step's or job's end) Ray's own logs are in the run directory, a huge one cut to its tail.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from relax_runs import wait_for

from relax_core.cluster.lifetime import descendants, reap
from relax_core.cluster.ray_compat import temp_dir_inside
from relax_core.cluster.ray_logs import FILE_BYTES
from relax_core.config import dump_recipe, load_recipe
from relax_core.rundir import RunDir

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"


def raylet_of(node_pid: int) -> int | None:
    for pid in descendants(node_pid):
        try:
            if b"raylet" in Path(f"/proc/{pid}/comm").read_bytes():
                return pid
        except OSError:
            continue
    return None


def max_open_files(pid: int) -> int:
    line = next(line for line in Path(f"/proc/{pid}/limits").read_text().splitlines() if "open files" in line)
    return int(line.split()[3])


def test_a_stopped_ray_node_leaves_its_logs_in_the_run_directory(tmp_path):
    run = RunDir(tmp_path / "run").create()
    run.recipe.write_text(dump_recipe(load_recipe(QUICKSTART, ["cluster.network.interface=lo"])))
    ray_tmp = Path(tempfile.mkdtemp(prefix="rxt", dir="/tmp"))  # short: Ray's socket paths
    env = os.environ | {"SLURM_JOB_ID": "4242", "SLURMD_NODENAME": "n7", "RELAX_RAY_TMP": str(ray_tmp)}
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    out = (tmp_path / "step.log").open("w")
    node = subprocess.Popen([sys.executable, "-m", "relax_core.cluster.node", str(run.path), "--group", "train",
                             "--index", "0"], env=env, stdout=out, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)))
    seen = {}
    try:
        raylet = wait_for(lambda: raylet_of(node.pid), 120, "the raylet")
        assert max_open_files(raylet) == min(hard, 65536)  # Ray runs with the raised limit, not 1024
        private = ray_tmp / f"rx{os.getuid()}-4242-0"
        logs = temp_dir_inside(private) / "session_latest" / "logs"
        wait_for(lambda: (logs / "raylet.out").exists(), 60, "raylet.out")
        # Ray opens the folders it makes to every user; the node's folder above them stays this user's alone.
        assert stat.S_IMODE(private.stat().st_mode) == 0o700 and private.stat().st_uid == os.getuid()
        huge = logs / "worker-huge.out"  # a worker that printed far too much
        huge.write_bytes(b"x" * (FILE_BYTES + 5000) + b"the last line\n")
        session = logs.parent.resolve().name
        seen = descendants(node.pid)
        node.send_signal(signal.SIGTERM)
        node.wait(timeout=90)
    finally:
        reap(seen | descendants(node.pid))  # by PID, whatever is left of what this test started
        node.kill()
        node.wait()
        out.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not private.exists()  # the node's folder goes with it, its logs kept below
    kept = run.logs / "ray" / "n7" / session
    step_log = (tmp_path / "step.log").read_text()
    assert (kept / "raylet.out").stat().st_size > 0, step_log
    assert (kept / "gcs_server.out").exists(), sorted(p.name for p in kept.iterdir())
    copy = (kept / "worker-huge.out").read_bytes()
    assert copy.startswith(b"[relax: the first 5014 of ") and copy.endswith(b"x" * 100 + b"the last line\n")
    assert len(copy) < FILE_BYTES + 200
