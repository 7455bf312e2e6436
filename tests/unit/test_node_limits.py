"""The limits a Ray node starts with: the open-file limit raised for Ray and everything it starts, and a
warning naming the fix where InfiniBand needs more locked memory than the node allows.

Each case runs the node entrypoint's `raise_limits` in a process of its own, started with low limits as a
login shell's may be (`setrlimit` before exec), and reads the limits of a program that process then execs, as
`ray start` is. This machine has no InfiniBand: the device folder is a stand-in with a device's name in it.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

RAISE_THEN_EXEC = """
import json, os, resource, sys
from pathlib import Path
from relax_core.cluster import node
if len(sys.argv) > 1:
    node.INFINIBAND = Path(sys.argv[1])
warnings = node.raise_limits()
child = "import json, resource; print(json.dumps([resource.getrlimit(resource.RLIMIT_NOFILE), " \\
        "resource.getrlimit(resource.RLIMIT_MEMLOCK), %r]))" % warnings
os.execv(sys.executable, [sys.executable, "-c", child])
"""


def started_with(nofile: tuple[int, int], memlock: tuple[int, int], *args: str) -> tuple[list, list, list]:
    def low_limits():
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
        resource.setrlimit(resource.RLIMIT_MEMLOCK, memlock)

    proc = subprocess.run([sys.executable, "-c", RAISE_THEN_EXEC, *args], preexec_fn=low_limits,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_open_file_limit_is_raised_to_the_hard_limit_ray_inherits():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    nofile, _, warnings = started_with((1024, hard), memlock)
    expected = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    assert nofile == [expected, hard]
    assert any("open-file limit's hard limit" in w for w in warnings) == (expected < 65536)


def test_a_hard_open_file_limit_below_what_ray_recommends_is_a_warning():
    nofile, _, warnings = started_with((1024, 4096), resource.getrlimit(resource.RLIMIT_MEMLOCK))
    assert nofile == [4096, 4096]
    assert len(warnings) == 1 and "hard limit is 4096, below the 65536 Ray recommends" in warnings[0]


def test_infiniband_with_a_locked_memory_limit_warns_naming_the_fix(tmp_path):
    (tmp_path / "mlx5_0").mkdir()
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    _, memlock, warnings = started_with(nofile, (65536, 8 * 1024**2), str(tmp_path))
    assert memlock == [8 * 1024**2, 8 * 1024**2]  # the soft limit raised to the hard one
    [warning] = [w for w in warnings if "RLIMIT_MEMLOCK" in w]
    assert "(mlx5_0)" in warning and "PropagateResourceLimits" in warning and "memlock unlimited" in warning


def test_without_infiniband_the_locked_memory_limit_is_left_alone(tmp_path):
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    _, memlock, warnings = started_with(nofile, (65536, 8 * 1024**2), str(tmp_path / "none"))
    assert memlock == [65536, 8 * 1024**2] and not [w for w in warnings if "RLIMIT_MEMLOCK" in w]
