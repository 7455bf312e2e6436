"""A Slurm node's Ray temp dir is its user's alone.

Its name is predictable (`/tmp/rx<uid>-<job id>-<index>`), so another user of a shared node could make it
first and hold the cluster's sockets. `private_temp_dir` makes it mode 0700 (Ray's own temp dir, which Ray
opens to every user, is a folder inside it: `ray_compat.temp_dir_inside`), takes back the folder an earlier
attempt of the same job left, and refuses what is not a folder of this user's.
"""

from __future__ import annotations

import os
import stat

import pytest

from relax_core.cluster.node import PrivateDirError, private_temp_dir


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_new_temp_dir_is_this_users_alone(tmp_path):
    made = private_temp_dir(tmp_path / "rx0-7-0")
    assert made.is_dir() and mode(made) == 0o700


def test_an_earlier_attempts_folder_is_taken_back_private(tmp_path):
    left = tmp_path / "rx0-7-0"
    left.mkdir()
    os.chmod(left, 0o777)  # as Ray leaves it
    assert mode(private_temp_dir(left)) == 0o700


def test_a_link_someone_planted_is_refused(tmp_path):
    (tmp_path / "theirs").mkdir()
    (tmp_path / "rx0-7-0").symlink_to(tmp_path / "theirs")
    with pytest.raises(PrivateDirError, match="symbolic link"):
        private_temp_dir(tmp_path / "rx0-7-0")


def test_another_users_folder_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.fail("this test makes a folder owned by another user, which needs root (the test machine's user)")
    theirs = tmp_path / "rx0-7-0"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # nobody
    with pytest.raises(PrivateDirError, match="owned by uid 65534"):
        private_temp_dir(theirs)
    assert os.lstat(theirs).st_uid == 65534  # left as it was
