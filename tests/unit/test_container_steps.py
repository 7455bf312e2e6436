"""A job step in the container, run: its environment, its binds, and the image checks at submit.

Apptainer cannot run on the test machine, so `tests/fake_apptainer.py` stands
in for it on PATH: it applies `--cleanenv`, `APPTAINERENV_*`, `--env` and the
binds' existence as Apptainer documents them, records what it was given, and
then really runs the step's command, which reports what it sees.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_core.cluster.container import bind_sources, passed_env, recipe_paths, step_prefix
from relax_core.config import load_recipe
from relax_core.launch import container
from relax_core.launch.container import check_container
from relax_core.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
PRINT_ENV = "import json, os; print(json.dumps(dict(os.environ)))"


@pytest.fixture
def fake_apptainer(tmp_path, monkeypatch) -> Path:
    """`apptainer` on PATH is tests/fake_apptainer.py; Python and the usual tools follow it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = REPO / "tests" / "fake_apptainer.py"
    (bin_dir / "apptainer").write_text(f"#!/bin/sh\nexec {sys.executable} {fake} \"$@\"\n")
    (bin_dir / "apptainer").chmod(0o755)
    (bin_dir / "python3").symlink_to(sys.executable)
    monkeypatch.delenv("RELAX_APPTAINER", raising=False)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return bin_dir


@pytest.fixture
def image(tmp_path) -> Path:
    path = tmp_path / "relax.sif"
    path.write_text("SIF")
    return path


def _recipe(tmp_path: Path, image: Path, *overrides: str):
    return load_recipe(REPO / "recipes" / "quickstart.yaml", [f"cluster.container.image={image}", *overrides])


def _step(recipe, run: RunDir, code: str) -> list[str]:
    """What a job step's `srun` runs (entrypoints/slurm_steps.py: srun_command), with `python3 -c code`."""
    return [*step_prefix(recipe, run.path, gpus=False), "python3", "-c", code]


def _run_step(argv: list[str], env: dict[str, str]) -> dict[str, str]:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


# ------------------------------------------------------------------ environment
def test_step_sees_slurm_and_gpu_variables_but_not_the_hosts_python_or_nccl(tmp_path, fake_apptainer, image):
    """A module's PYTHONPATH/PYTHONHOME/LD_LIBRARY_PATH/NCCL_* stay out; what Slurm sets for the step (values
    with commas included) and the recipe's env come in."""
    recipe = _recipe(tmp_path, image, "cluster.container.env={NCCL_SOCKET_IFNAME: ib0}")
    run = RunDir(tmp_path / "runs" / "r1")
    run.path.mkdir(parents=True)
    host = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": "/host/site-packages",
            "PYTHONHOME": sys.base_prefix, "LD_LIBRARY_PATH": "/host/lib", "NCCL_IB_HCA": "mlx5_bond_0",
            "SLURM_JOB_ID": "77", "SLURMD_NODENAME": "node1", "SLURM_JOB_NODELIST": "node[1-2],gpu3",
            "CUDA_VISIBLE_DEVICES": "0,1", "HF_HUB_OFFLINE": "1", "RELAX_RAY_TMP": "/tmp/r"}
    # What the step command is built with (the batch step) is not what it runs with (srun's step environment);
    # the host's Python settings are valid for the host's Python, which starts apptainer.
    inside = _run_step(_step(recipe, run, PRINT_ENV), host)
    for absent in ("PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "NCCL_IB_HCA"):
        assert absent not in inside
    assert inside["SLURM_JOB_ID"] == "77"
    assert inside["SLURMD_NODENAME"] == "node1"
    assert inside["SLURM_JOB_NODELIST"] == "node[1-2],gpu3"
    assert inside["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert inside["HF_HUB_OFFLINE"] == "1"
    assert inside["RELAX_RAY_TMP"] == "/tmp/r"
    assert inside["NCCL_SOCKET_IFNAME"] == "ib0"
    assert inside["PYTHONNOUSERSITE"] == "1"


def test_recipe_env_wins_over_a_passed_variable(tmp_path, fake_apptainer, image):
    recipe = _recipe(tmp_path, image, "cluster.container.env={HF_ENDPOINT: 'https://mirror.example'}")
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    host = {"PATH": os.environ["PATH"], "HF_ENDPOINT": "https://huggingface.co"}
    assert _run_step(_step(recipe, run, PRINT_ENV), host)["HF_ENDPOINT"] == "https://mirror.example"


def test_singularity_gets_its_own_prefix():
    argv = ["/opt/bin/singularity", "exec", "--env", "A=1", "img.sif", "python3"]
    env = {"SLURM_JOB_ID": "5", "A": "host", "PYTHONPATH": "/x"}
    assert passed_env(env, argv) == {"SINGULARITYENV_SLURM_JOB_ID": "5"}
    assert passed_env(env, ["apptainer", *argv[1:]]) == {"APPTAINERENV_SLURM_JOB_ID": "5"}


# ------------------------------------------------------------------ binds
def _paths_recipe(tmp_path: Path, image: Path):
    model = tmp_path / "models" / "qwen"
    model.mkdir(parents=True)
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text('{"prompt": "a", "label": "a"}\n')
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (tmp_path / "scratch").mkdir()
    return _recipe(tmp_path, image, f"model={{source: hf, path: {model}}}",
                   f"data={{source: file, path: {data}}}", f"reward.plugin_dirs=[{plugins}, {model}]",
                   f"checkpoint.dir={tmp_path}/scratch/ckpt/r1", f"cluster.hub_cache={tmp_path}/hub")


def test_every_path_the_recipe_names_is_bound_once(tmp_path, image):
    recipe = _paths_recipe(tmp_path, image)
    fields = {field: path for field, path, _ in recipe_paths(recipe, tmp_path / "runs" / "r1")}
    assert set(fields) == {"model.path", "data.path", "reward.plugin_dirs[0]", "reward.plugin_dirs[1]",
                           "checkpoint.dir", "cluster.hub_cache"}
    # A file through its folder, a folder the run creates through the nearest one that exists, each once.
    assert bind_sources(recipe_paths(recipe, tmp_path / "runs" / "r1")) == [
        tmp_path, tmp_path / "data", tmp_path / "plugins", tmp_path / "scratch", tmp_path / "models" / "qwen"]


def test_step_binds_follow_the_recipe_and_skip_what_a_bind_covers(tmp_path, fake_apptainer, image):
    recipe = _paths_recipe(tmp_path, image)
    recipe.cluster.container.binds = [f"{tmp_path}/models"]
    recipe.cluster.hub_cache = None  # default: beside the run directory
    run = RunDir(tmp_path / "runs" / "r1")
    run.path.mkdir(parents=True)
    log = tmp_path / "apptainer.jsonl"
    argv = _step(recipe, run, PRINT_ENV)
    _run_step(argv, {"PATH": os.environ["PATH"], "FAKE_APPTAINER_LOG": str(log)})
    [call] = [json.loads(line) for line in log.read_text().splitlines()]
    binds = [call["argv"][i + 1] for i, a in enumerate(call["argv"]) if a == "--bind"]
    assert binds == [f"{tmp_path}/models", f"{tmp_path}/data", f"{tmp_path}/plugins", f"{tmp_path}/runs",
                     f"{tmp_path}/scratch", str(run.path)]


def test_a_path_that_does_not_exist_is_refused_naming_its_field(tmp_path, image):
    recipe = _paths_recipe(tmp_path, image)
    recipe.reward.plugin_dirs.append(str(tmp_path / "gone"))
    recipe.checkpoint.dir = "/no-such-top-folder/ckpt"
    problems = check_container(recipe.cluster.container, recipe=recipe)
    assert [p.split(":")[0] for p in problems] == ["reward.plugin_dirs[2]", "checkpoint.dir"]
    assert str(tmp_path / "gone") in problems[0]


def test_submit_refuses_a_missing_checkpoint_parent_with_exit_2(tmp_path, fake_apptainer, image):
    env = {**os.environ, "PATH": f"{fake_apptainer}:{os.environ['PATH']}"}
    for tool in ("sbatch", "squeue", "scontrol"):
        (fake_apptainer / tool).write_text("#!/bin/sh\nexit 0\n")
        (fake_apptainer / tool).chmod(0o755)
    proc = subprocess.run([sys.executable, "-m", "relax_cli.main", "submit", str(REPO / "recipes" / "quickstart.yaml"),
                           "--dry-run", "--executor", "slurm", f"cluster.container.image={image}",
                           "checkpoint.dir=/no-such-top-folder/ckpt", f"logging.run_root={tmp_path}/runs"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "checkpoint.dir" in proc.stdout + proc.stderr
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ image checks
def _image_with_python(tmp_path: Path, stdout: str) -> Path:
    """An image whose `python3` prints `stdout` (another Relax, no libibverbs...)."""
    bin_dir = tmp_path / "image-bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f"#!/bin/sh\nprintf '{stdout}'\n")
    (bin_dir / "python3").chmod(0o755)
    image = tmp_path / "other.sif"
    image.write_text(json.dumps({"path": [str(bin_dir)]}))
    return image


def test_an_image_with_another_relax_is_refused_naming_both(tmp_path, fake_apptainer):
    from importlib.metadata import version

    image = _image_with_python(tmp_path, "0.0.9\\nlibibverbs.so.1\\n")
    [problem] = container.image_match_problems(str(image), "cluster.container.image")
    assert problem.startswith("cluster.container.image:")
    assert "Relax 0.0.9" in problem and f"Relax {version('relax-rl')}" in problem and "rebuild the image" in problem


def test_the_same_relax_passes_through_a_real_probe(tmp_path, fake_apptainer, image, monkeypatch):
    monkeypatch.setattr(container, "INFINIBAND", tmp_path / "no-infiniband")
    assert container.image_match_problems(str(image), "cluster.container.image") == []


def test_infiniband_without_libibverbs_in_the_image_warns(tmp_path, fake_apptainer, monkeypatch, caplog):
    from importlib.metadata import version

    sysfs = tmp_path / "infiniband"
    (sysfs / "mlx5_0").mkdir(parents=True)
    monkeypatch.setattr(container, "INFINIBAND", sysfs)
    image = _image_with_python(tmp_path, f"{version('relax-rl')}\\n\\n")
    with caplog.at_level(logging.WARNING, logger=container.__name__):
        assert container.image_match_problems(str(image), "cluster.container.image") == []
    assert "mlx5_0" in caplog.text and "libibverbs" in caplog.text and "apptainer/relax.def" in caplog.text


def test_no_apptainer_on_the_login_node_warns(tmp_path, image, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("RELAX_APPTAINER", raising=False)
    with caplog.at_level(logging.WARNING, logger=container.__name__):
        assert container.image_match_problems(str(image), "cluster.container.image") == []
    assert "apptainer is not on PATH" in caplog.text and "not checked" in caplog.text


@pytest.mark.parametrize("has_verbs", [True, False])
def test_the_image_definition_installs_rdma_core_only_when_missing(tmp_path, has_verbs):
    """apptainer/relax.def's %post, run by bash with stand-ins for ldconfig and apt-get."""
    text = (REPO / "apptainer" / "relax.def").read_text()
    post = text.split("%post\n", 1)[1].split("\n%", 1)[0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    listing = "\tlibibverbs.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libibverbs.so.1" if has_verbs else ""
    stand_ins = {"ldconfig": f"printf '%s\\n' '{listing}'", "apt-get": f'echo "$@" >> {tmp_path}/apt',
                 "rm": f'echo "rm $@" >> {tmp_path}/apt'}  # the image's apt lists, not this machine's
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    subprocess.run(["bash", "-euo", "pipefail", "-c", post], check=True, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    calls = (tmp_path / "apt").read_text().splitlines() if (tmp_path / "apt").exists() else []
    install = ["update", "install -y --no-install-recommends rdma-core ibverbs-providers libibverbs1"]
    assert calls[:2] == ([] if has_verbs else install)
    assert len(calls) == (0 if has_verbs else 3) and all(c.startswith("rm -rf /var/lib/apt/lists/") for c in calls[2:])
