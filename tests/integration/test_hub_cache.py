"""A recipe naming a hub model and a hub data set runs on Slurm compute nodes that cannot reach the hub.

`relax submit` (here with the hub on: HF_HUB_OFFLINE unset, HF_ENDPOINT at tests/fake_hub.py on loopback)
fetches both into the shared hub cache on the login node; the job is held while the hub server stops, so
the job's nodes have no hub at all (the test netns has no route out either); released, it runs to
completion from the cache: every process of the job has HF_HUB_OFFLINE=1 and HF_HUB_CACHE in the cache (a
reward plug-in in the driver records them), and the driver loaded the fetched folders (driver.log).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from fake_hub import DATA_ID, MODEL_ID, FakeHub, hub_recipe, tiny_repos
from test_slurm_launch import ON_TWO_NODES, QUICKSTART, final_status, logs_of
from test_slurm_policy import components

PROBE = '''import json
import os

from relax_core.rewards.builtin import copy
from relax_core.rewards.registry import reward


@reward("copy_noting_the_hub", in_process=True)
def copy_noting_the_hub(response, label, metadata=None):
    """`copy`, and the hub settings of the process that scores (the job's driver) written down."""
    with open({out!r}, "w") as out:
        json.dump({{key: os.environ.get(key) for key in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HOME")}}, out)
    return copy(response, label, metadata)
'''


def recipe_with_hub_ids(folder: Path, probe_out: Path) -> Path:
    (folder / "rewards").mkdir()
    (folder / "rewards" / "probe.py").write_text(PROBE.format(out=str(probe_out)))
    raw = hub_recipe(yaml.safe_load(QUICKSTART.read_text()),
                     reward={"name": "copy_noting_the_hub", "plugin_dirs": ["rewards"]})
    raw["train"] |= {"steps": 3}
    raw["cluster"]["slurm"] = {"extra_sbatch": ["--hold"]}  # released once the hub is gone
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def submit_env(endpoint: str) -> dict[str, str]:
    """A login node's environment: the hub on (conftest and tests/run switch it off), at `endpoint`."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                             "HF_DATASETS_OFFLINE")}
    return env | {"HF_ENDPOINT": endpoint, "COLUMNS": "200", "NO_COLOR": "1"}


def submit(cwd: Path, recipe: Path, endpoint: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relax_cli.main", "submit", str(recipe), *ON_TWO_NODES, *args,
                           "--executor", "slurm"], cwd=cwd, env=submit_env(endpoint), capture_output=True, text=True,
                          timeout=180)


def test_a_hub_model_and_data_set_run_on_compute_nodes_from_what_the_login_node_fetched(slurm_cluster, tmp_path):
    """Also the quick start's layout when both groups ask for the same (2-CPU nodes): one plain 2-node job,
    which the batch step splits (n1 train, n2 rollout)."""
    probe_out = tmp_path / "probe.json"
    recipe = recipe_with_hub_ids(tmp_path, probe_out)
    with FakeHub(tiny_repos(tmp_path / "served")) as hub:
        proc = submit(tmp_path, recipe, hub.url, "cluster.train.cpus_per_node=2", "--run-dir", "runs/hub")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        asked = list(hub.requests)
    # The hub server is stopped: its port refuses connections. Only now may the job start.
    run = tmp_path / "runs" / "hub"
    job_id = json.loads((run / "run.json").read_text())["job_id"]
    subprocess.run(["scontrol", "release", job_id], check=True, capture_output=True, timeout=30)

    final = final_status(tmp_path, "runs/hub", 300, "the job to finish")
    assert final["state"] == "completed", logs_of(run)
    assert final["step"] == 3
    assert any("/resolve/" in request for request in asked)  # fetched by the submit, on the "login node"
    state, cache = json.loads((run / "run.json").read_text()), tmp_path / "runs" / "hub-cache"
    assert state["hub"]["model.path"].startswith(str(cache / "hub" / "models--relax-test--tiny-copy"))
    assert state["hub"]["data.path"].startswith(str(cache / "hub" / "datasets--relax-test--copy-strings"))
    assert f"model.path: {MODEL_ID} fetched: {state['hub']['model.path']}" in proc.stdout
    assert json.loads(probe_out.read_text()) == {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache / "hub"),
                                                 "HF_HOME": str(cache)}
    driver_log = (run / "logs" / "driver.log").read_text()
    assert f"model.path: {MODEL_ID} from the login node's fetch: {state['hub']['model.path']}" in driver_log
    assert f"data.path: {DATA_ID} from the login node's fetch: {state['hub']['data.path']}" in driver_log
    assert (run / "recipe.yaml").read_text().count(MODEL_ID) == 1  # the run records what the user asked for

    (job,) = components(slurm_cluster, int(job_id))
    assert "HetJobId" not in job and job["NumNodes"] == "2", job
    assert state["nodes"] == {"train": ["n1"], "rollout": ["n2"]}
    assert "all 2 nodes joined" in driver_log


def test_an_id_the_login_node_cannot_fetch_submits_nothing(slurm_cluster, tmp_path):
    recipe = recipe_with_hub_ids(tmp_path, tmp_path / "probe.json")
    with FakeHub(tiny_repos(tmp_path / "served")) as hub:
        proc = submit(tmp_path, recipe, hub.url, "name=hub-refused", "data.path=relax-test/no-such-data",
                      "--run-dir", "runs/bad")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "data.path: could not fetch the hub data set 'relax-test/no-such-data'" in proc.stderr
    assert not (tmp_path / "runs" / "bad").exists()
    queue = subprocess.run(["squeue", "-h", "-t", "all", "-n", "relax-hub-refused", "-o", "%i"],
                           capture_output=True, text=True, timeout=30)
    assert queue.returncode == 0 and queue.stdout.strip() == ""  # no job of that name, in any state
