"""Hub ids are fetched by `relax submit` on the login node, into the shared hub cache, from a hub of our own
(tests/fake_hub.py on loopback): every field that may name one, the cache hit that asks the hub nothing,
the id that cannot be fetched (exit 2 naming the field and the id, no run directory), and the job's side:
the recipe the job runs names the fetched folders, and a data set's folder yields its split only.
The run on Slurm compute nodes without the hub: tests/integration/test_hub_cache.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fake_hub import DATA_ID, MODEL_ID, FakeHub, hub_recipe, tiny_repos
from test_container_steps import fake_apptainer  # noqa: F401  (fixture: tests/fake_apptainer.py as apptainer)

from relax_core.config import load_recipe

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
FETCH = """
import json, sys
from relax_core.config import load_recipe
from relax_core.launch.hub import fetch_hub
print(json.dumps(fetch_hub(load_recipe(sys.argv[1], []), sys.argv[2])))
"""


def online(endpoint: str) -> dict[str, str]:
    """This environment with the hub on (conftest switches it off) at `endpoint`."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return env | {"HF_ENDPOINT": endpoint, "COLUMNS": "200", "NO_COLOR": "1"}


def write_recipe(folder: Path, raw: dict) -> Path:
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def hub(tmp_path):
    with FakeHub(tiny_repos(tmp_path / "served")) as served:
        yield served


def test_each_hub_id_is_fetched_into_the_cache_once_then_read_from_it(hub, tmp_path):
    recipe = write_recipe(tmp_path, hub_recipe(QUICKSTART))
    run_dir = tmp_path / "runs" / "first"

    def fetch() -> dict[str, str]:
        proc = subprocess.run([sys.executable, "-c", FETCH, str(recipe), str(run_dir)], env=online(hub.url),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.splitlines()[-1])

    fetched = fetch()
    cache = tmp_path / "runs" / "hub-cache" / "hub"  # beside the run directory by default
    assert fetched["model.path"].startswith(str(cache / "models--relax-test--tiny-copy" / "snapshots"))
    assert (Path(fetched["model.path"]) / "model.safetensors").is_file()
    data = Path(fetched["data.path"])
    assert data.is_relative_to(cache / "datasets--relax-test--copy-strings")
    assert [p.name for p in data.rglob("*.parquet")] == ["train-00000-of-00001.parquet"]  # the split only
    assert any("/resolve/" in r for r in hub.requests)
    hub.requests.clear()
    assert fetch() == fetched
    assert hub.requests == []  # offline first: a cached snapshot costs no request


def test_cluster_hub_cache_names_where_the_ids_are_fetched(hub, tmp_path):
    raw = hub_recipe(QUICKSTART)
    raw["cluster"] |= {"hub_cache": str(tmp_path / "shared" / "hf")}
    recipe = write_recipe(tmp_path, raw)
    proc = subprocess.run([sys.executable, "-c", FETCH, str(recipe), str(tmp_path / "runs" / "r")],
                          env=online(hub.url), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    fetched = json.loads(proc.stdout.splitlines()[-1])
    assert all(Path(folder).is_relative_to(tmp_path / "shared" / "hf" / "hub") for folder in fetched.values())
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("field,override,hub_on", [
    ("model.path", "model.path=relax-test/no-such-model", True),
    ("data.path", "data.path=relax-test/no-such-data", True),
    ("model.path", None, False),  # HF_HUB_OFFLINE on the login node, nothing cached
])
def test_an_id_that_cannot_be_fetched_exits_2_naming_the_field_and_writes_no_run(hub, tmp_path, field, override,
                                                                                 hub_on):
    recipe = write_recipe(tmp_path, hub_recipe(QUICKSTART))
    env = online(hub.url) if hub_on else os.environ | {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "1"}
    argv = ["submit", str(recipe), *([override] if override else []), "--executor", "local", "--run-dir", "runs/r"]
    proc = subprocess.run([sys.executable, "-m", "relax_cli.main", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    named = override.split("=")[1] if override else MODEL_ID
    assert f"{field}: could not fetch" in proc.stderr and named in proc.stderr
    assert ("unset it" in proc.stderr) == (not hub_on)  # the way out: HF_HUB_OFFLINE on the login node
    assert not (tmp_path / "runs" / "r").exists()


def test_the_job_runs_the_fetched_folders_and_reads_only_its_split(tmp_path):
    from relax_core.data.prompts import load_rows
    from relax_core.models.model_dir import with_fetched
    from relax_core.rundir import RunDir

    repos = tiny_repos(tmp_path / "served")
    recipe = load_recipe(write_recipe(tmp_path, hub_recipe(QUICKSTART)))
    run = RunDir(tmp_path / "run").create()
    run.update_state(hub={"model.path": str(repos["model", MODEL_ID]), "data.path": str(repos["dataset", DATA_ID])})
    job_recipe = with_fetched(recipe, run)
    assert job_recipe.model.path == str(repos["model", MODEL_ID])
    rows = load_rows(job_recipe.data)  # the folder holds a test split too
    assert len(rows) == 8 and "zz" not in [row["prompt"] for row in rows]
    assert with_fetched(recipe, RunDir(tmp_path / "never-fetched")) is recipe


def test_every_field_that_can_name_a_hub_id_is_fetched(tmp_path):
    from relax_core.launch.hub import hub_refs

    raw = hub_recipe(QUICKSTART, algorithm={"name": "ppo", "critic": {"init_from": "org/critic"}})
    raw["model"]["tokenizer"] = "org/tokenizer"
    raw["reward"] = {"name": "genrm", "genrm": {"model": "org/judge"}}
    refs = {ref.field: (ref.repo_id, ref.repo_type) for ref in hub_refs(load_recipe(write_recipe(tmp_path, raw)))}
    assert refs == {"model.path": (MODEL_ID, "model"), "model.tokenizer": ("org/tokenizer", "model"),
                    "algorithm.critic.init_from": ("org/critic", "model"), "reward.genrm.model": ("org/judge", "model"),
                    "data.path": (DATA_ID, "dataset")}
    local = tmp_path / "org" / "critic"
    local.mkdir(parents=True)  # a folder of that name is a path, not a hub id
    raw["algorithm"]["critic"]["init_from"] = str(local)
    assert "algorithm.critic.init_from" not in {ref.field for ref in hub_refs(load_recipe(write_recipe(tmp_path, raw)))}


@pytest.mark.usefixtures("fake_apptainer")
def test_in_a_container_the_steps_read_the_hub_cache_not_the_images_hf_home(tmp_path):
    """The environment the batch step gives every step (`hub_env`) reaches the process inside the image,
    over the image's own HF_HOME, and the cache is bound (tests/fake_apptainer.py applies both as
    Apptainer does)."""
    from relax_core.cluster.container import step_prefix
    from relax_core.models.hub_cache import hub_env

    image = tmp_path / "relax.sif"
    image.write_text(json.dumps({"env": {"HF_HOME": "/opt/image/huggingface"}}))  # read-only in a real image
    raw = hub_recipe(QUICKSTART)
    raw["cluster"] |= {"container": {"image": str(image)}}
    recipe = load_recipe(write_recipe(tmp_path, raw))
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    cache = tmp_path / "runs" / "hub-cache"
    (cache / "hub").mkdir(parents=True)
    argv = [*step_prefix(recipe, run_dir, gpus=False), "python3", "-c",
            "import json, os; print(json.dumps(dict(os.environ)))"]
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)} | hub_env(recipe, run_dir)
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    inside = json.loads(proc.stdout.splitlines()[-1])
    assert (inside["HF_HOME"], inside["HF_HUB_CACHE"]) == (str(cache), str(cache / "hub"))
    assert inside["HF_HUB_OFFLINE"] == "1"
    binds = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--bind"]
    assert any(str(cache).startswith(bind.split(":")[0]) for bind in binds), binds
