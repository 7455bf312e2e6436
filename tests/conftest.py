"""Shared test set-up: no test may reach the network or a model hub."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import shutil  # noqa: E402

import pytest  # noqa: E402

pytest_plugins = ["pytester"]  # tests/unit/test_tiers.py runs pytest on small suites of its own


@pytest.fixture
def one_torch_thread():
    """Intra-op threads only slow a tiny model down on a shared 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def local_ray(tmp_path_factory):
    """One private Ray cluster for every test that needs Ray in this process.

    Ray reads its auth token once per process, so a second cluster with a
    token of its own could not be joined from here; tests share this one.
    CPUs: 2 for TransferQueue's controller and storage unit; the project's
    actors hold none, only the train, rollout, judge and reference slots.
    """
    from multiprocessing import resource_tracker

    from relax_core.cluster.local_ray import start_local_ray, stop_local_ray
    from relax_core.cluster.placement import JUDGE_RESOURCE, REFERENCE_RESOURCE, ROLLOUT_RESOURCE, TRAIN_RESOURCE
    from relax_core.rundir import new_run_dir

    # The multiprocessing resource tracker this process may start later (torch's tensor sharing does) lives as
    # long as pytest: started now, it does not carry the cluster's mark and is not taken for a leaked child.
    resource_tracker.ensure_running()
    saved_env = dict(os.environ)
    run = new_run_dir(tmp_path_factory.mktemp("ray"), "ray").create()
    temp_dir = start_local_ray(run, num_cpus=4, resources={TRAIN_RESOURCE: 2, ROLLOUT_RESOURCE: 4,
                                                              JUDGE_RESOURCE: 3, REFERENCE_RESOURCE: 1})
    yield run
    stop_local_ray()
    os.environ.clear()
    os.environ.update(saved_env)
    shutil.rmtree(temp_dir, ignore_errors=True)
    left = processes_left(str(temp_dir))
    assert not left, f"processes the tests started outlived them (killed now): {left}"


def processes_left(mark: str, grace_s: float = 10) -> dict[int, str]:
    """Processes started under the session's Ray cluster (they carry its mark) still alive once it
    stopped: whatever a test starts must end with it. They are killed, and named."""
    import time

    from relax_core.cluster.lifetime import marked, reap

    def still_running() -> dict[int, str]:
        # torch_shm_manager, torch's shared-memory daemon, serves this test process (its client) and
        # ends when its last client does: it is this process's, not a test's leftover
        return {pid: started for pid, started in marked(mark).items() if command(pid) != "torch_shm_manager"}

    deadline = time.monotonic() + grace_s
    while (left := still_running()) and time.monotonic() < deadline:
        time.sleep(0.2)
    named = {pid: command(pid)[:200] for pid in left}
    reap(left)
    return named


def command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


from slurm_cluster import (  # noqa: E402,F401  (fixtures)
    mark_slurm_tests,
    slurm_cluster,
    slurm_jobs_end_with_their_test,
    slurm_version,
)
from tiers import pytest_terminal_summary, select_tier  # noqa: E402,F401  (a hook)


def pytest_report_header(config):
    return f"slurm version: {slurm_version()}"


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="run the full tier too: the tests marked `full` (see tests/tiers.py)")


def pytest_collection_modifyitems(config, items):
    mark_slurm_tests(items)
    select_tier(config, items)
