"""A local job is closed to other users of the machine: everything it starts listens on loopback only.

The job runs in a network namespace of its own that has, besides loopback, an
interface with an ordinary address (10.77.0.2) and a default route through it:
a machine with a network interface, where Ray would otherwise bind its servers
to every interface and to that address. While the quick start trains (with a
router in front of two engines), the test lists the TCP sockets every process
of the job listens on and fails on any address that is not loopback, the
wildcards 0.0.0.0 and :: included; and no Ray dashboard process may run, nor
the autoscaler and log monitors.

The same job then shows that nothing it started outlives its driver killed
with SIGKILL (the module's last test, as it ends the job), so one start of the
quick start serves both checks.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

import pytest
from proc_table import (
    cmdline,
    describe,
    is_loopback,
    job_processes,
    listeners,
    mark_env,
    marked,
    start_quickstart,
    still_running,
    wait_for_first_step,
    wait_until_gone,
)

EXTERNAL = "10.77.0.2"
GONE_WITHIN_S = 10  # from the driver's SIGKILL to the last of the job's processes
WITH_AN_INTERFACE = ("ip link set lo up && ip link add relax0 type veth peer name relax1 && "
                     f"ip addr add {EXTERNAL}/24 dev relax0 && ip link set relax0 up && ip link set relax1 up && "
                     "ip route add default dev relax0")


@pytest.fixture(scope="module")
def running_job(tmp_path_factory):
    """The quick start with a router, training, on a machine with a network interface."""
    cwd = tmp_path_factory.mktemp("sockets")
    env = mark_env()
    prefix = ["unshare", "--net", "bash", "-c", f'{WITH_AN_INTERFACE} && exec "$@"', "_"]
    driver = start_quickstart(cwd, env, "rollout.num_engines=2", "train.steps=400", "logging.backends=[]",
                              prefix=prefix)
    processes: dict[int, str] = {}
    try:
        wait_for_first_step(cwd, driver)
        processes = job_processes(env, driver.pid)
        yield driver, env, processes, listeners(list(processes))
    finally:
        if driver.poll() is None:  # the killed-driver test ends it itself
            driver.kill()
            driver.wait()
        for pid in wait_until_gone(env, processes, 15):
            os.kill(pid, signal.SIGKILL)
        assert not marked(env) and not still_running(processes)


def test_every_process_of_a_local_job_listens_on_loopback_only(running_job):
    driver, _, processes, found = running_job
    assert EXTERNAL in open(f"/proc/{driver.pid}/net/fib_trie").read()  # the job does see the interface
    print("listening sockets of the job:\n" + "\n".join(f"  {item}" for item in found))
    listening = {item.pid for item in found}
    for kind in ("sglang::router", "relax_core.rollout.cpu_engine", "gcs_server", "raylet", "ray::DashboardAgent"):
        assert any(kind in cmdline(pid) for pid in listening), f"no {kind} among the listeners: {found}"
    outside = [str(item) for item in found if not is_loopback(item.address)]
    assert not outside, "listening beyond loopback:\n" + "\n".join(outside)


def test_no_dashboard_process_runs(running_job):
    _, _, processes, _ = running_job
    dashboards = [cmdline(pid) for pid in processes if "ray/dashboard/dashboard.py" in cmdline(pid)]
    assert not dashboards, dashboards
    assert any("ray::DashboardAgent" in cmdline(pid) for pid in processes)  # Ray's processes are in view


def test_no_monitor_process_runs(running_job):
    """A local cluster has a fixed size and its driver reads no worker output: neither the autoscaler's
    monitor nor the log monitor runs (they cost start-up and shutdown time; ray_compat.without_monitors)."""
    _, _, processes, _ = running_job
    scripts = ("autoscaler/_private/monitor.py", "_private/log_monitor.py")
    monitors = [cmdline(pid) for pid in processes if any(script in cmdline(pid) for script in scripts)]
    assert not monitors, monitors
    assert any("raylet" in cmdline(pid) for pid in processes)  # Ray's processes are in view


def test_the_jobs_ray_folder_is_this_users_alone(running_job):
    """Ray makes every folder it creates under its temp dir writable by everyone, the temp dir included
    (ray_compat.temp_dir_inside): another user could replace the object store's socket there. The folder
    that holds the job's Ray temp dir is this user's alone (mode 0700), so nobody else reaches below it."""
    _, _, processes, _ = running_job
    gcs = next(cmdline(pid) for pid in processes if "gcs_server" in cmdline(pid))
    log_dir = Path(next(arg.split("=", 1)[1] for arg in gcs.split() if arg.startswith("--log_dir=")))
    ray_temp = log_dir.parents[1]  # <Ray's temp dir>/session_<...>/logs
    private = ray_temp.parent
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and private.stat().st_uid == os.getuid(), \
        oct(private.stat().st_mode)
    assert (ray_temp / "session_latest" / "sockets" / "plasma_store").is_socket()  # the object store's, below it


def test_a_killed_driver_leaves_no_process_behind(running_job):
    """Nothing a run started outlives its driver: SIGKILL to the driver only, by its PID, once it trains, and
    within a few seconds none of its processes runs any more: router, engine servers, Ray's workers, raylet,
    GCS, agents. The last test of this module: it ends the job the others inspect."""
    driver, env, _, _ = running_job
    processes = job_processes(env, driver.pid)
    running = {pid: describe(pid) for pid in processes}
    kinds = " | ".join(running.values())
    for kind in ("sglang::router", "relax_core.rollout.cpu_engine", "raylet", "gcs_server",
                 "ray::EngineWorker", "ray::TrainerWorker", "ray::DashboardAgent", "ray::RuntimeEnvAgent"):
        assert kind in kinds, f"no {kind} among the job's processes: {running}"
    assert sum("relax_core.rollout.cpu_engine" in c for c in running.values()) == 2
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    killed_at = time.monotonic()
    left = wait_until_gone(env, processes, GONE_WITHIN_S)
    print(f"{len(running)} processes of the job; all gone {time.monotonic() - killed_at:.1f}s after SIGKILL")
    assert not left, f"still running {GONE_WITHIN_S}s after the driver was killed: " + \
        "; ".join(f"{pid} {describe(pid)}" for pid in left)
