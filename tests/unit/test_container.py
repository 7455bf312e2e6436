"""The Apptainer wrapper of job steps, its pre-submission checks, and the image recipes.

Apptainer and a Docker engine cannot run on the test machine, so the argv is
rendered and checked (and passed through a real bash to a program that prints
what it receives), and docker/Dockerfile and apptainer/relax.def are parsed
with the rules Docker and Apptainer apply.
"""

from __future__ import annotations

import csv
import json
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from relax_core.cluster.container import apptainer_command, container_prefix, in_container
from relax_core.config.cluster import ContainerConfig
from relax_core.errors import RecipeError
from relax_core.launch.container import check_container

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def image(tmp_path) -> Path:
    path = tmp_path / "relax.sif"
    path.write_bytes(b"SIF")
    return path


@pytest.fixture(autouse=True)
def no_apptainer_override(monkeypatch):
    monkeypatch.delenv("RELAX_APPTAINER", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # neither apptainer nor singularity: falls back to apptainer


def _executable(folder: Path, name: str, body: str = "exit 0") -> Path:
    path = folder / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# ------------------------------------------------------------------ prefix
def test_no_image_means_no_prefix(tmp_path):
    config = ContainerConfig(binds=["/data"], env={"A": "1"})
    assert container_prefix(config, run_dir=tmp_path, gpus=True) == []
    assert in_container(["python3", "-m", "x"], config, run_dir=tmp_path, gpus=True) == ["python3", "-m", "x"]


def test_prefix_binds_env_gpu_and_run_dir(tmp_path, image):
    data = tmp_path / "data"
    data.mkdir()
    run = tmp_path / "runs" / "r1"
    config = ContainerConfig(image=str(image), binds=[f"{data}:/data:ro"], env={"HF_HOME": "/data/hf"})
    assert container_prefix(config, run_dir=run, gpus=True) == [
        sys.executable, "-m", "relax_core.cluster.container",  # passes the step's Slurm variables in
        "apptainer", "exec", "--cleanenv", "--nv",
        "--bind", f"{data}:/data:ro",
        "--bind", str(run),
        "--env", "PYTHONNOUSERSITE=1",
        "--env", "HF_HOME=/data/hf",
        str(image),
    ]


def test_nv_only_with_gpus(tmp_path, image):
    config = ContainerConfig(image=str(image))
    assert "--nv" in container_prefix(config, run_dir=tmp_path, gpus=True)
    assert "--nv" not in container_prefix(config, run_dir=tmp_path, gpus=False)


def test_run_dir_is_bound_once_and_last(tmp_path, image):
    run = tmp_path / "run"
    parent = ContainerConfig(image=str(image), binds=[str(tmp_path)])
    assert _binds(container_prefix(parent, run_dir=run, gpus=False)) == [str(tmp_path), str(run)]
    same = ContainerConfig(image=str(image), binds=[f"{run}:{run}"])
    assert _binds(container_prefix(same, run_dir=run, gpus=False)) == [f"{run}:{run}"]


def test_relative_and_home_sources_become_absolute(tmp_path, image, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/alice")
    monkeypatch.setenv("SCRATCH", "/scratch/alice")
    config = ContainerConfig(image="relax.sif", binds=["data:/data", "~/hf:/cache/huggingface:rw", "$SCRATCH"])
    argv = container_prefix(config, run_dir=Path("/runs/r"), gpus=False)
    assert _binds(argv) == [f"{tmp_path}/data:/data", "/home/alice/hf:/cache/huggingface:rw", "/scratch/alice",
                            "/runs/r"]
    assert argv[-1] == str(image)


def test_env_precedence_default_recipe_launcher(tmp_path, image):
    config = ContainerConfig(image=str(image), env={"PYTHONNOUSERSITE": "0", "RAY_DEDUP_LOGS": "0", "X": "recipe"})
    argv = container_prefix(config, run_dir=tmp_path, extra_env={"X": "launcher", "RELAX_RUN_DIR": "/r"}, gpus=False)
    assert _envs(argv) == ["PYTHONNOUSERSITE=0", "RAY_DEDUP_LOGS=0", "X=launcher", "RELAX_RUN_DIR=/r"]


def test_env_value_with_comma_survives_apptainers_csv_parsing(tmp_path, image):
    config = ContainerConfig(image=str(image), env={"NCCL_SOCKET_IFNAME": "ib0,ib1", "OPTS": "a=1,b=2"})
    flags = _envs(container_prefix(config, run_dir=tmp_path, gpus=False))[1:]
    # Apptainer reads each --env value as one CSV record (Go's encoding/csv, same dialect).
    assert [next(csv.reader([flag])) for flag in flags] == [["NCCL_SOCKET_IFNAME=ib0,ib1"], ["OPTS=a=1,b=2"]]


def test_uri_image_is_passed_as_is(tmp_path):
    config = ContainerConfig(image="docker://ghcr.io/org/relax:1.0")
    assert container_prefix(config, run_dir=tmp_path, gpus=False)[-1] == "docker://ghcr.io/org/relax:1.0"


def test_apptainer_command_choice(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    assert apptainer_command() == ["apptainer"]
    _executable(bin_dir, "singularity")
    assert apptainer_command() == ["singularity"]
    _executable(bin_dir, "apptainer")
    assert apptainer_command() == ["apptainer"]
    monkeypatch.setenv("RELAX_APPTAINER", "/opt/apptainer 1.4/bin/apptainer --debug".replace(" 1.4", "\\ 1.4"))
    assert apptainer_command() == ["/opt/apptainer 1.4/bin/apptainer", "--debug"]


def test_rendered_line_reaches_apptainer_intact(tmp_path, image, monkeypatch):
    """The template shlex.joins the argv into a bash script; bash must hand apptainer every argument as is."""
    printer = _executable(tmp_path, "print-argv", 'printf "%s\\n" "$@"')
    monkeypatch.setenv("RELAX_APPTAINER", str(printer))
    src = tmp_path / "my data"
    src.mkdir()
    config = ContainerConfig(image=str(image), binds=[f"{src}:/data"], env={"P": "$HOME/x y", "Q": "a,b"})
    argv = in_container(["python3", "-m", "relax_core.cluster.node", "/r"], config, run_dir=tmp_path, gpus=True)
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\nset -euo pipefail\nexec {shlex.join(argv)}\n")
    out = subprocess.run(["/bin/bash", str(script)], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == argv[argv.index(str(printer)) + 1:]
    assert "P=$HOME/x y" in out.splitlines()  # expanded inside the container, not by the batch shell


def _binds(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]


def _envs(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--env"]


# ------------------------------------------------------------------ checks
def test_valid_container_has_no_problems(tmp_path, image):
    (tmp_path / "hf").mkdir()
    config = ContainerConfig(image=str(image), binds=[f"{tmp_path}/hf:/cache/huggingface:ro", str(tmp_path)],
                             env={"HF_HOME": "/cache/huggingface", "NCCL_SOCKET_IFNAME": "ib0,ib1"})
    assert check_container(config) == []


def test_nothing_is_checked_without_image():
    assert check_container(ContainerConfig(binds=["/no/such:rel"], env={"1X": "y"})) == []


@pytest.mark.parametrize("uri", ["docker://lmsysorg/sglang:v0.5.23", "oras://ghcr.io/org/relax:1", "library://org/relax"])
def test_pulled_uris_are_accepted(uri):
    assert check_container(ContainerConfig(image=uri)) == []


@pytest.mark.parametrize("uri,expected", [("docker://", "names no image"), ("shub://org/relax", "not supported"),
                                          ("https://example.org/relax.sif", "not supported")])
def test_bad_uris(uri, expected):
    [problem] = check_container(ContainerConfig(image=uri))
    assert problem.startswith("cluster.container.image:") and expected in problem


def test_image_missing_directory_or_not_sif(tmp_path):
    folder = tmp_path / "sandbox"
    folder.mkdir()
    other = tmp_path / "relax.img"
    other.write_bytes(b"x")
    cases = {str(tmp_path / "nope.sif"): "does not exist", str(folder): "not a file", str(other): "not a .sif"}
    for path, expected in cases.items():
        [problem] = check_container(ContainerConfig(image=path))
        assert problem.startswith("cluster.container.image:") and expected in problem and path in problem


@pytest.mark.parametrize("spec,expected", [
    ("{ok}:/a:ro:extra", "not SRC[:DST[:OPTS]]"),
    ("{ok}::ro", "not SRC[:DST[:OPTS]]"),
    ("{ok}:data", "absolute path"),
    ("{ok}:/data:ro,nosuid", "unknown bind option"),
    ("{ok},{ok}:/data", "one bind per list entry"),
    ("{ok}/missing:/data", "does not exist"),
])
def test_bind_problems_name_the_entry(tmp_path, image, spec, expected):
    config = ContainerConfig(image=str(image), binds=[str(tmp_path), spec.format(ok=tmp_path)])
    problems = check_container(config)
    assert len(problems) == 1 and problems[0].startswith("cluster.container.binds[1]:") and expected in problems[0]


def test_image_bind_options_are_accepted(tmp_path, image):
    config = ContainerConfig(image=str(image), binds=[f"{image}:/data:image-src=/,ro"])
    assert check_container(config) == []


@pytest.mark.parametrize("env,field", [
    ({"1ABC": "x"}, "cluster.container.env:"),
    ({"A-B": "x"}, "cluster.container.env:"),
    ({"Q": 'say "hi"'}, "cluster.container.env.Q:"),
    ({"N": "a\nb"}, "cluster.container.env.N:"),
])
def test_env_problems(image, env, field):
    [problem] = check_container(ContainerConfig(image=str(image), env=env))
    assert problem.startswith(field)


def test_all_problems_are_reported_together(tmp_path):
    config = ContainerConfig(image=str(tmp_path / "x.sif"), binds=["/no/such/dir", "a:b:c:d"], env={"-": "1"})
    fields = [p.split(":")[0] for p in check_container(config)]
    assert fields == ["cluster.container.image", "cluster.container.binds[0]", "cluster.container.binds[1]",
                      "cluster.container.env"]


def test_run_dir_that_bind_cannot_express(tmp_path, image):
    run = tmp_path / "a:b"
    assert check_container(ContainerConfig(image=str(image)), run_dir=run)[0].startswith("logging.run_root:")
    with pytest.raises(RecipeError, match="logging.run_root"):
        container_prefix(ContainerConfig(image=str(image)), run_dir=run, gpus=False)


# ------------------------------------------------------------------ Dockerfile
DOCKER_INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
                       "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and `\\` continuations joined, as Docker reads them."""
    instructions, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction is dropped
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        word, _, rest = (pending + stripped).partition(" ")
        instructions.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return instructions


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return dockerfile_instructions((REPO / "docker" / "Dockerfile").read_text())


def test_dockerfile_instructions_are_known_and_from_comes_first(dockerfile):
    assert {name for name, _ in dockerfile} <= DOCKER_INSTRUCTIONS
    first_non_arg = next(name for name, _ in dockerfile if name != "ARG")
    assert first_non_arg == "FROM"
    assert sum(name == "FROM" for name, _ in dockerfile) == 1


def test_dockerfile_from_uses_only_declared_args(dockerfile):
    declared = {args.split("=")[0] for name, args in dockerfile[:[n for n, _ in dockerfile].index("FROM")]
                if name == "ARG"}
    base = next(args for name, args in dockerfile if name == "FROM")
    assert set(re.findall(r"\$\{?(\w+)", base)) <= declared


def test_dockerfile_copy_sources_exist_in_the_repository(dockerfile):
    copies = [shlex.split(args) for name, args in dockerfile if name in ("COPY", "ADD")]
    assert copies
    for words in copies:
        assert not any(w.startswith("--from") for w in words)
        sources = [w for w in words if not w.startswith("--")][:-1]
        for source in sources:
            assert (REPO / source).exists(), f"COPY source {source} is not in the build context (repository root)"


def test_dockerfile_pins_and_json_cmd(dockerfile):
    text = " ".join(args for _, args in dockerfile)
    args = dict(a.split("=", 1) for n, a in dockerfile if n == "ARG" and "=" in a)
    assert args["RAY_VERSION"] == "2.60.0" and "ray[default]==${RAY_VERSION}" in text
    assert re.fullmatch(r"lmsysorg/sglang:v\d+\.\d+\.\d+", args["SGLANG_IMAGE"])
    assert "megatron-core==${MEGATRON_CORE_VERSION}" in text and "transferqueue==${TRANSFERQUEUE_VERSION}" in text
    assert any(n == "RUN" and "/opt/relax" in a and "pip install" in a for n, a in dockerfile)
    cmd = next(a for n, a in dockerfile if n == "CMD")
    assert json.loads(cmd) == ["relax", "--help"]
    env = " ".join(a for n, a in dockerfile if n == "ENV")
    assert "HF_HOME=" in env and "PYTHONUNBUFFERED=1" in env
    assert not any(n == "USER" and a.split(":")[0] == "root" for n, a in dockerfile)


def _pinned_sglang() -> str:
    import tomllib

    from relax_core.rollout.sglang_server_args import SGLANG_VERSION

    gpu = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    (pin,) = [dep.split("==")[1] for dep in gpu if dep.startswith("sglang==")]
    assert pin == SGLANG_VERSION, f"pyproject's gpu extra pins SGLang {pin}, the server arguments: {SGLANG_VERSION}"
    return pin


def test_the_images_sglang_is_the_pinned_one(dockerfile):
    """The image's SGLang, the `gpu` extra's, the server arguments `relax validate` checks, and the one the
    docs install for the tests: one version."""
    pin = _pinned_sglang()
    args = dict(a.split("=", 1) for n, a in dockerfile if n == "ARG" and "=" in a)
    assert args["SGLANG_VERSION"] == pin and args["SGLANG_IMAGE"] == f"lmsysorg/sglang:v{pin}"
    for doc in ("README.md", "CONTRIBUTING.md", ".ci/run"):
        named = re.findall(r"sglang==([\w.]+)", (REPO / doc).read_text())
        assert named and set(named) == {pin}, f"{doc} installs SGLang {named}, Relax pins {pin}"


def test_the_image_build_stops_when_its_base_has_another_sglang(dockerfile):
    """The first RUN compares the base image's SGLang with SGLANG_VERSION (run here through a real bash, with
    the SGLang installed for the tests, which is the pinned one)."""
    pin = _pinned_sglang()
    check = next(a for n, a in dockerfile if n == "RUN").split(" && ")[0]
    assert "SGLANG_VERSION" in check
    ok = subprocess.run(["bash", "-c", check], env={"SGLANG_VERSION": pin, "PATH": _python_path()},
                        capture_output=True, text=True)
    other = subprocess.run(["bash", "-c", check], env={"SGLANG_VERSION": "0.5.21", "PATH": _python_path()},
                           capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert other.returncode == 1 and f"the base image has SGLang {pin}; Relax pins 0.5.21" in other.stderr


def _python_path() -> str:
    """A PATH whose python3 is this interpreter (the one with SGLang's metadata installed)."""
    import sys

    return f"{Path(sys.executable).parent}:/usr/bin:/bin"


# ------------------------------------------------------------------ Apptainer definition
DEF_HEADERS = {"bootstrap", "from", "includecmd", "mirrorurl", "updateurl", "osversion", "include", "library",
               "registry", "namespace", "stage", "product", "user", "regcode", "productpgp", "registerurl",
               "modules", "fingerprints", "confurl", "setopt"}
DEF_SECTIONS = {"help", "setup", "files", "labels", "environment", "pre", "post", "runscript", "test",
                "startscript", "arguments", "appinstall", "applabels", "appfiles", "appenv", "apptest",
                "apphelp", "apprun", "appstart"}
BOOTSTRAP_AGENTS = {"docker", "docker-daemon", "docker-archive", "oras", "localimage", "library", "scratch",
                    "oci", "oci-archive", "shub", "yum", "debootstrap", "zypper", "busybox", "arch"}


def parse_definition(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """Header keys and section bodies, split the way Apptainer's deffile parser splits them.

    A line whose first word starts with '%' opens a section (even inside %help);
    header lines are `key: value`, '#' starts a comment.
    """
    header, sections, current = {}, {}, None
    for line in text.splitlines():
        words = line.split()
        if words and words[0].startswith("%"):
            current = words[0][1:].lower()
            sections.setdefault(current, "")
        elif current is not None:
            sections[current] += line + "\n"
        elif words and not words[0].startswith("#"):
            key, sep, value = line.split("#")[0].partition(":")
            assert sep, f"header line without ':': {line!r}"
            header.setdefault("_first", key.strip().lower())
            header[key.strip().lower()] = value.strip()
    return header, sections


@pytest.fixture(scope="module")
def definition() -> tuple[dict[str, str], dict[str, str]]:
    return parse_definition((REPO / "apptainer" / "relax.def").read_text())


def test_definition_header(definition):
    header, _ = definition
    assert header.pop("_first") == "bootstrap"
    assert set(header) <= DEF_HEADERS and {"bootstrap", "from"} <= set(header)
    assert header["bootstrap"] in BOOTSTRAP_AGENTS
    text = (REPO / "apptainer" / "relax.def").read_text()
    # Apptainer splits a file into build stages at every line starting with "Bootstrap:".
    assert len(re.findall(r"(?mi)^bootstrap:", text)) == 1


def test_definition_sections(definition):
    _, sections = definition
    assert set(sections) <= DEF_SECTIONS
    assert {"environment", "runscript", "labels", "help"} <= set(sections)
    assert sections["runscript"].split() == ["exec", "relax", '"$@"']
    for line in sections["labels"].strip().splitlines():
        assert len(line.split(None, 1)) == 2, f"label without a value: {line!r}"


def test_definition_builds_from_the_docker_image_tag(definition):
    header, _ = definition
    dockerfile_text = (REPO / "docker" / "Dockerfile").read_text()
    assert header["bootstrap"] == "docker-daemon"
    assert f"-t {header['from']} " in dockerfile_text  # the build command documented at the top
