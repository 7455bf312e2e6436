"""Workarounds of Ray 2.60 behaviour, in one place: each says why and when it can go.

`python -m relax_core.cluster.ray_compat start ...` is `ray start ...` with
them applied (what a Slurm node runs); `start_local_ray` applies them in the
driver before `ray.init`.
"""

from __future__ import annotations

import sys
from pathlib import Path


def without_dashboard_process() -> None:
    """Start no dashboard process when no dashboard is asked for.

    With `include_dashboard=False` Ray still starts `dashboard/dashboard.py`
    (`Node.start_head_processes` always calls `start_api_server`, which then
    loads only the usage-stats module), and that process listens: a gRPC
    server on every interface of a node whose address is not loopback, and
    Prometheus metrics on the fixed port 44227. Nothing of Relax talks to it
    (usage stats are off). Can go once Ray skips that process without a dashboard.
    """
    from ray._private.node import Node

    original = Node.start_api_server
    if getattr(original, "relax_patched", False):
        return

    def start_api_server(self, *, include_dashboard, raise_on_failure):
        if include_dashboard:
            return original(self, include_dashboard=include_dashboard, raise_on_failure=raise_on_failure)
        self._webui_url = ""  # what Ray records when the dashboard is off

    start_api_server.relax_patched = True
    Node.start_api_server = start_api_server


def without_monitors() -> None:
    """Start neither the autoscaler monitor nor the log monitor with `ray.init`.

    `ray.init` always starts both (`Node.start_head_processes`, `Node.start_ray_processes`) and
    takes no option against either, where `ray start --no-monitor` (a Slurm head) skips the first.
    A local cluster has a fixed size, so the autoscaler has nothing to do, and its driver reads
    no worker output (`log_to_driver=False`), the log monitor's one use. The two Python processes
    take about 2 s of CPU at start-up and 1 s at `ray.shutdown`, which gives each a second to
    exit. Can go once `ray.init` takes `no_monitor` and `include_log_monitor`.
    """
    from ray._private.node import Node

    if getattr(Node.start_monitor, "relax_patched", False):
        return

    def skip(self) -> None:
        pass

    skip.relax_patched = True
    Node.start_monitor = Node.start_log_monitor = skip


RAY_SUBDIR = "r"  # short: Unix socket paths are limited to 107 bytes


def temp_dir_inside(private: Path) -> Path:
    """The temp dir to give Ray: a folder inside `private`, a folder of this user's alone (mode 0700).

    Ray makes every folder it creates under its temp dir, the temp dir itself included, writable by every
    user of the machine (`ray._common.utils.try_to_create_directory`: `chmod 0777`, so that users can share
    one temp dir), in the process that starts the node and again in every worker process as it starts. On a
    shared node another user could then replace the cluster's files there: the object store's socket (and
    with it read the weights and samples that pass through it) or a `*_port_*` file that tells Ray's
    processes where to connect; and read every log. Ray never changes the folder above its temp dir, and
    with that folder at mode 0700 no other user reaches anything below it. Can go once Ray leaves the modes
    of its folders alone.
    """
    return private / RAY_SUBDIR


def single_machine() -> None:
    """Make this process's Ray take the machine for a single node with a loopback address.

    Ray gives a node started by `ray.init` the address of the machine's route
    to the internet, and its servers then listen on every interface (or on that
    address); only for a loopback address do they all bind loopback. That is
    what Ray does where it supports no multi-node clusters (macOS, Windows:
    `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`); set here in this process only, so
    no other program inherits it. Can go once `ray.init` can bind loopback itself
    (`_node_ip_address="127.0.0.1"` is replaced by the routed address).
    """
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def main() -> None:
    """`ray start` (its own command line) with the workarounds applied."""
    without_dashboard_process()
    from ray.scripts.scripts import main as ray_main

    sys.argv[0] = "ray"
    ray_main()


if __name__ == "__main__":
    main()
