"""`bash tests/run` on a machine without Slurm: it installs what the tests need, or says how, before any test runs.

The machine here has Slurm, so each test runs the script with a PATH that holds only the few tools it needs
(sbatch, in /usr/bin next to bash, is then missing) and a stand-in `apt-get` that logs its arguments: installing
for real needs the network, which no test has.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SLURM_TOOLS = ("slurmctld", "slurmd", "sbatch", "munged")
INSTALL = "install -y -qq --no-install-recommends slurm-wlm munge iproute2"


def _bin(tmp_path: Path, uid: int, apt_installs: bool | None = True) -> Path:
    """A PATH folder: the tools the script uses, an `id` that says `uid`, and an apt-get (None: none) that logs
    its arguments and, if `apt_installs`, puts stand-ins for the Slurm tools into the folder."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in ("bash", "dirname", "paste", "unshare", "chmod"):
        (folder / tool).symlink_to(shutil.which(tool))
    (folder / "python3").symlink_to(sys.executable)
    if apt_installs is not None:
        fakes = " ".join(str(folder / t) for t in SLURM_TOOLS) if apt_installs else ""
        _script(folder / "apt-get", f'echo "$*" >> {tmp_path}/apt.log\n'
                f'[ "$1" = install ] && for f in {fakes}; do echo : > "$f"; chmod +x "$f"; done; true')
    _script(folder / "id", f"echo {uid}")
    return folder


def _script(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def _run(folder: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("RELAX_IN_TEST_NETNS", "RELAX_TEST_NO_PROVISION")}
    return subprocess.run(["bash", str(REPO / "tests" / "run"), "--version"], env=environ | {"PATH": str(folder)} | env,
                          capture_output=True, text=True, timeout=120)


def _apt_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "apt.log"
    return log.read_text().splitlines() if log.exists() else []


def test_as_root_it_installs_slurm_and_munge_then_runs_pytest(tmp_path):
    result = _run(_bin(tmp_path, uid=0))
    assert result.returncode == 0, result.stderr
    assert _apt_calls(tmp_path) == ["update -qq", INSTALL]
    assert "sbatch" in result.stderr and "not found: installing slurm-wlm munge iproute2" in result.stderr
    assert "pytest" in result.stdout  # `pytest --version` ran in the namespace after the install


def test_without_root_it_exits_2_with_the_command_to_run(tmp_path):
    result = _run(_bin(tmp_path, uid=1000))
    assert result.returncode == 2
    assert _apt_calls(tmp_path) == []
    assert "sudo apt-get update && sudo apt-get install -y --no-install-recommends slurm-wlm munge iproute2" \
        in result.stderr
    assert "RELAX_TEST_NO_PROVISION=1 bash tests/run" in result.stderr


def test_without_apt_get_it_exits_2_with_the_command_to_run(tmp_path):
    result = _run(_bin(tmp_path, uid=0, apt_installs=None))
    assert result.returncode == 2
    assert "the tests need sbatch" in result.stderr and "apt-get install" in result.stderr


def test_an_install_that_leaves_a_tool_missing_fails_before_the_tests(tmp_path):
    result = _run(_bin(tmp_path, uid=0, apt_installs=False))
    assert result.returncode == 2
    assert _apt_calls(tmp_path) == ["update -qq", INSTALL]
    assert "still missing after installing slurm-wlm munge iproute2:" in result.stderr and "sbatch" in result.stderr
    assert "pytest" not in result.stdout


def test_the_opt_out_installs_nothing_and_runs_the_tests(tmp_path):
    result = _run(_bin(tmp_path, uid=0), RELAX_TEST_NO_PROVISION="1")
    assert result.returncode == 0, result.stderr
    assert _apt_calls(tmp_path) == []
    assert "pytest" in result.stdout
