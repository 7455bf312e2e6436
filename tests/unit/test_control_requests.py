"""Which request files in a run's `control/` folder the driver obeys (launch/control.py): only plain files
of its own user that no one else may write, and only while their sender still waits."""

from __future__ import annotations

import os
import re
import time

import pytest

from relax_core.run_requests import REQUEST_TTL_S, control_folder, read_trusted, write_private
from relax_core.rundir import RunDir

ASKED = {"method": "POST", "path": "/v1/scale", "json": {"delta": 1}}


@pytest.fixture
def folder(tmp_path):
    return control_folder(RunDir(tmp_path).create())


def test_a_request_of_the_runs_owner_is_obeyed_and_private(folder):
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    path = folder / "a.request.json"
    write_private(path, ASKED)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert read_trusted(path) == ASKED
    assert read_trusted(folder / "gone.request.json") is None
    assert [p.name for p in folder.iterdir()] == ["a.request.json"]  # no temporary file left


@pytest.mark.parametrize(("change", "why"), [
    (lambda p: p.chmod(0o620), "writable by others (mode 0o620)"),
    (lambda p: p.chmod(0o602), "writable by others (mode 0o602)"),
    (lambda p: os.chown(p, 65534, -1), "owned by uid 65534, not the run's owner"),  # tests/run runs as root
    (lambda p: os.utime(p, (time.time() - REQUEST_TTL_S - 5,) * 2), "its sender stopped waiting"),
])
def test_a_request_someone_else_could_have_written_is_refused(folder, change, why):
    path = folder / "a.request.json"
    write_private(path, ASKED)
    change(path)
    with pytest.raises(PermissionError, match=re.escape(why)):
        read_trusted(path)


def test_a_link_is_refused_even_to_the_owners_own_file(folder, tmp_path):
    target = tmp_path / "elsewhere.json"
    write_private(target, ASKED)
    (folder / "a.request.json").symlink_to(target)
    with pytest.raises(PermissionError, match="not a plain file"):
        read_trusted(folder / "a.request.json")
