"""A private Ray cluster on this machine, for the local executor.

The cluster belongs to one run: token authentication with the token in the
run's secrets folder (mode 0600), a short temp dir of its own (Unix socket
paths are limited to 107 bytes), and explicit CPU counts. It is closed to other
users of the machine: every process of it listens on loopback only (Ray binds
its servers to loopback when the node's address is loopback, which it makes it
here as it does on laptops) and no dashboard process runs, nor the autoscaler
and log monitors, which have nothing to do here (the workarounds are in
`ray_compat.py`). It dies with the driver, even a SIGKILLed one
(`lifetime.Reaper`), and is stopped with `ray.shutdown()`, which ends only
the processes this driver started, never with `ray stop`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from relax_core.cluster.lifetime import Reaper
from relax_core.rundir import RunDir

TOKEN_NAME = "ray_token"
LOCAL_NODE = "local"  # the local cluster's one node, as `logs/ray/<node>/` names it
OBJECT_STORE_BYTES = 512 * 1024**2  # samples and weights of small local runs; Ray would take 30 % of RAM
LOOPBACK = "127.0.0.1"
_reaper: Reaper | None = None


def token_env(run: RunDir) -> dict[str, str]:
    """Environment that makes Ray processes use the run's token."""
    token = run.secrets / TOKEN_NAME
    if not token.exists():
        run.write_secret(TOKEN_NAME)
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}


def short_temp_dir(run: RunDir) -> Path:
    """A short folder of this user's alone (mode 0700) that holds Ray's temp dir (`ray_compat.temp_dir_inside`
    says why Ray's is inside it) with its sockets and logs."""
    base = Path(os.environ.get("RELAX_RAY_TMP", tempfile.gettempdir()))
    path = Path(tempfile.mkdtemp(prefix=f"rx{os.getuid()}-", dir=base))
    os.chmod(path, 0o700)
    return path


def start_local_ray(run: RunDir, num_cpus: int, resources: dict[str, float] | None = None, *,
                    bus: bool = True) -> Path:
    """Start a private single-node Ray cluster and connect this process to it.

    `bus`: the job's processes import TransferQueue (the asynchronous modes), so each Ray worker runs
    `tq_import.install` as it starts (`WORKER_SETUP`). Workers Ray starts ahead of the job, which take
    the job's first actors at once (a worker process up and Ray imported: about 0.6 s of the start-up
    measured on 2 cores), are started without the job's runtime environment and never take an actor of a
    job that has one: without it (colocate) they take the engine and trainer actors.
    """
    global _reaper
    os.environ.update(token_env(run))  # before Ray reads its configuration
    os.environ["RELAX_NODE_IP"] = LOOPBACK  # engines and rendezvous bind to loopback only
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    from relax_core.cluster.ray_compat import (
        single_machine,
        temp_dir_inside,
        without_dashboard_process,
        without_monitors,
    )
    from relax_core.cluster.tq_import import WORKER_SETUP

    single_machine()  # the node's address is loopback: Ray binds loopback only
    without_dashboard_process()
    without_monitors()  # a cluster of fixed size whose driver reads no worker output
    temp_dir = short_temp_dir(run)
    _reaper = Reaper(str(temp_dir))  # before the first Ray process starts: each inherits the mark
    ray.init(
        num_cpus=num_cpus,
        resources=resources or {},
        include_dashboard=False,
        _temp_dir=str(temp_dir_inside(temp_dir)),
        log_to_driver=False,
        configure_logging=False,
        namespace=run.path.name,
        object_store_memory=OBJECT_STORE_BYTES,
        runtime_env=WORKER_SETUP if bus else None,
    )
    return temp_dir


def remove_ray_dir(temp_dir: Path, logs: Path) -> Path | None:
    """Once the cluster stopped: keep its Ray logs in `logs/<session>/` (bounded as a Slurm node keeps them,
    ray_logs.py), then remove its folder, which nothing uses any more. Returns where the logs went."""
    from relax_core.cluster.ray_compat import temp_dir_inside
    from relax_core.cluster.ray_logs import save_ray_logs

    kept = save_ray_logs(temp_dir_inside(temp_dir), logs)
    shutil.rmtree(temp_dir, ignore_errors=True)
    return kept


def stop_local_ray() -> None:
    global _reaper
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if _reaper is not None:
        _reaper.close()
        _reaper = None
