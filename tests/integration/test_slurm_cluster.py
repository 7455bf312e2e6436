"""The test Slurm cluster behaves the way the Slurm launcher relies on.

Each test drives the real daemons started by the `slurm_cluster` fixture
(tests/slurm_cluster.py, imported by conftest) with the client commands the
launcher uses (sbatch, srun, scancel, scontrol, squeue) and checks what a job
actually saw, from files the job wrote. The stderr texts checked here are the
ones the launcher maps to user-facing errors.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import time
from pathlib import Path

import pytest
from slurm_cluster import CGROUP_TASKS, SlurmCluster, slurm_version, wait_until

pytestmark = pytest.mark.slurm


def version_of(text: str) -> tuple[int, int]:
    """(major, minor) of a Slurm version such as "22.05.8"."""
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def read_vars(path: Path) -> dict[str, str]:
    """KEY=VALUE lines a job script echoed."""
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def wait_for_text(path: Path, text: str, timeout: float = 20.0) -> None:
    if not wait_until(lambda: path.exists() and text in path.read_text(), timeout):
        content = path.read_text() if path.exists() else "(no file)"
        raise TimeoutError(f"{text!r} not in {path} after {timeout} s: {content}")


def test_sinfo_shows_every_node_idle_and_clients_use_the_test_conf(slurm_cluster: SlurmCluster) -> None:
    assert os.environ["SLURM_CONF"] == str(slurm_cluster.conf_path)
    assert not str(slurm_cluster.conf_path).startswith("/etc/")
    # A node may still be completing an earlier test's job (longer on 20.11): ask once every node is idle.
    assert wait_until(slurm_cluster.all_idle, 30, 0.5), slurm_cluster.diagnostics()
    out = slurm_cluster.run(["sinfo", "-h", "-N", "-o", "%N %P %t %c %m %G"]).stdout
    assert sorted(out.split("\n")[:-1]) == [
        "d1 debian idle 2 4000 (null)",
        "g1 gpu idle 64 1000000 gpu:8",
        "g2 gpu idle 64 1000000 gpu:8",
        *[f"n{i} {p} idle 2 4000 gpu:tesla:2" for i in range(1, 5) for p in ("debug*", "scavenger", "urgent")],
    ]


def test_het_job_components_run_on_different_node_names(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "het.out"
    script = f"""#!/bin/bash
#SBATCH --nodes=1 --ntasks=1 --output={out}
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1
echo HET_SIZE=$SLURM_HET_SIZE
echo GROUP_0=$SLURM_JOB_NODELIST_HET_GROUP_0
echo GROUP_1=$SLURM_JOB_NODELIST_HET_GROUP_1
srun --het-group=1 --overlap bash -c 'echo STEP_NODE=$SLURMD_NODENAME'
"""
    job_id = slurm_cluster.submit(script)
    assert slurm_cluster.wait_for_state(job_id) == "COMPLETED"
    seen = read_vars(out)
    assert seen["HET_SIZE"] == "2"
    assert {seen["GROUP_0"], seen["GROUP_1"]} <= set(slurm_cluster.node_names)
    assert seen["GROUP_0"] != seen["GROUP_1"]
    assert seen["STEP_NODE"] == seen["GROUP_1"]
    # The controller's own record of component 1 agrees with what the job saw.
    records = slurm_cluster.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout.splitlines()
    component_1 = [r for r in records if "HetJobOffset=1 " in r]
    assert len(component_1) == 1 and f" NodeList={seen['GROUP_1']} " in component_1[0]


def test_only_accepts_a_request_that_fits(slurm_cluster: SlurmCluster) -> None:
    proc = slurm_cluster.run("sbatch --test-only --nodes=2 --wrap true")
    assert re.fullmatch(
        r"sbatch: Job \d+ to start at \S+ using 2 processors on nodes n\[1-2\] in partition debug\n", proc.stderr
    )


def test_only_rejects_more_nodes_than_exist(slurm_cluster: SlurmCluster) -> None:
    proc = slurm_cluster.run("sbatch --test-only --nodes=5 --wrap true", check=False)
    assert proc.returncode == 1
    assert proc.stderr == "allocation failure: Requested node configuration is not available\n"


def test_only_rejects_an_unknown_partition(slurm_cluster: SlurmCluster) -> None:
    proc = slurm_cluster.run("sbatch --test-only --partition=nope --wrap true", check=False)
    assert proc.returncode == 1
    assert proc.stderr == (
        "sbatch: error: invalid partition specified: nope\nallocation failure: Invalid partition name specified\n"
    )


def test_only_checks_each_het_component_on_its_own(slurm_cluster: SlurmCluster) -> None:
    """3 + 2 nodes cannot run at once on 4 node names, yet --test-only accepts it:
    the launcher has to check the total itself. A component that alone is too
    big is rejected."""
    accepted = slurm_cluster.run("sbatch --test-only --nodes=3 : --nodes=2 --wrap true")
    assert "to start at" in accepted.stderr
    rejected = slurm_cluster.run("sbatch --test-only --nodes=1 : --nodes=5 --wrap true", check=False)
    assert rejected.returncode == 1
    assert rejected.stderr == "allocation failure: Requested node configuration is not available\n"


FULL_SIZE_NODE = "--nodes=1 --cpus-per-task=64 --gpus-per-node=8 --mem=960G"


def test_only_accepts_a_full_size_gpu_het_job_on_the_gpu_partition(slurm_cluster: SlurmCluster) -> None:
    request = f"--partition=gpu {FULL_SIZE_NODE} : --partition=gpu {FULL_SIZE_NODE}"
    proc = slurm_cluster.run(f"sbatch --test-only {request} --wrap true")
    # For a het job Slurm adds up the processors but names only component 0's nodes.
    assert re.fullmatch(r"sbatch: Job \d+ to start at \S+ using 128 processors on g[12]\n", proc.stderr)


def test_only_rejects_gpus_where_there_are_none_or_too_few(slurm_cluster: SlurmCluster) -> None:
    for request in (f"--partition=debug {FULL_SIZE_NODE}", "--partition=gpu --nodes=1 --gpus-per-node=9"):
        proc = slurm_cluster.run(f"sbatch --test-only {request} --wrap true", check=False)
        assert proc.returncode == 1, request
        assert proc.stderr == "allocation failure: Requested node configuration is not available\n", request


def test_a_gpu_job_runs_on_a_fake_gpu_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "gpu.out"
    job_id = slurm_cluster.submit(
        "#!/bin/bash\necho NODE=$SLURMD_NODENAME\necho GPUS=$CUDA_VISIBLE_DEVICES\n",
        "--partition=gpu",
        "--gres=gpu:8",  # as Relax asks (SLURM_GPUS_ON_NODE is not set before 21.08)
        f"--output={out}",
    )
    assert slurm_cluster.wait_for_state(job_id) == "COMPLETED"
    seen = read_vars(out)
    assert seen["NODE"] in slurm_cluster.gpu_node_names and seen["GPUS"] == "0,1,2,3,4,5,6,7"


def test_a_job_sees_the_gpus_its_gres_gave_it_and_their_device_files(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    out = tmp_path / "gres.out"
    script = """#!/bin/bash
echo NODE=$SLURMD_NODENAME
echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES
srun --gres=gpu:tesla:1 bash -c 'echo STEP_CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES'
"""
    job_id = slurm_cluster.submit(script, "--gres=gpu:tesla:2", f"--output={out}")
    assert slurm_cluster.wait_for_state(job_id) == "COMPLETED"
    seen = read_vars(out)
    assert seen["CUDA_VISIBLE_DEVICES"] == "0,1" and seen["STEP_CUDA_VISIBLE_DEVICES"] == "0"
    devices = sorted(slurm_cluster.gpu_device_files(seen["NODE"]))
    assert [(os.major(d.stat().st_rdev), os.minor(d.stat().st_rdev)) for d in devices] == [(195, 0), (195, 1)]
    assert all(stat.S_ISCHR(d.stat().st_mode) for d in devices)


def test_a_gpu_type_the_nodes_lack_is_refused(slurm_cluster: SlurmCluster) -> None:
    accepted = slurm_cluster.run("sbatch --test-only --gres=gpu:tesla:2 --wrap true")
    assert "to start at" in accepted.stderr
    for request in ("--gres=gpu:a100:1", "--gres=gpu:tesla:3"):
        proc = slurm_cluster.run(f"sbatch --test-only {request} --wrap true", check=False)
        assert proc.returncode == 1, request
        assert proc.stderr == "allocation failure: Requested node configuration is not available\n", request


def test_tasks_are_bound_to_the_cpus_their_step_asked_for(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """task/affinity: a step's processes can run only on the CPUs it was given (`--exact`: before 21.08
    `--cpus-per-task` alone did not imply it, and a step got all of the job's CPUs on the node)."""
    out = tmp_path / "affinity.out"
    count = "python3 -c 'import os; print(len(os.sched_getaffinity(0)))'"
    script = f"""#!/bin/bash
echo BATCH=$({count})
echo ONE=$(srun --ntasks=1 --cpus-per-task=1 --exact {count})
echo TWO=$(srun --ntasks=1 --cpus-per-task=2 --exact {count})
"""
    job_id = slurm_cluster.submit(script, "--nodes=1", "--cpus-per-task=2", f"--output={out}")
    assert slurm_cluster.wait_for_state(job_id) == "COMPLETED"
    assert read_vars(out) == {"BATCH": "2", "ONE": "1", "TWO": "2"}


PROBE = """import errno, os, sys
what = sys.argv[1]
if what == "hold":  # touch every page of N MB
    block = bytearray(int(sys.argv[2]) * 2**20)
    block[::4096] = b"x" * len(block[::4096])
    print("HELD", flush=True)
else:  # open each device file: ENXIO (no driver behind it) means the cgroup let it through
    for path in sys.argv[2:]:
        try:
            os.close(os.open(path, os.O_RDONLY))
            print(path, "opened")
        except OSError as e:
            print(path, errno.errorcode[e.errno])
"""


@pytest.mark.skipif(not CGROUP_TASKS, reason="no writable cgroup v1 controllers here: the cluster runs uncontained")
def test_cgroups_hold_a_step_to_its_memory_and_its_gpus(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """As at sites with task/cgroup (ConstrainRAMSpace, ConstrainDevices): a step that uses more than its
    --mem is killed, and a step may open only the GPU device files of its own gres."""
    probe, out = tmp_path / "probe.py", tmp_path / "cgroup.out"
    probe.write_text(PROBE)
    node = "n1"
    devices = " ".join(str(d) for d in sorted(slurm_cluster.gpu_device_files(node)))
    script = f"""#!/bin/bash
srun --mem=100M python3 {probe} hold 400; echo OVER=$?
srun --mem=600M python3 {probe} hold 200; echo UNDER=$?
srun --mem=100M --gres=gpu:tesla:1 python3 {probe} open {devices}
srun --mem=100M --gres=none python3 {probe} open {devices}
"""
    job_id = slurm_cluster.submit(script, f"--nodelist={node}", "--mem=1000M", "--gres=gpu:tesla:2",
                                  f"--output={out}")
    slurm_cluster.wait_for_state(job_id, ("COMPLETED", "OUT_OF_MEMORY", "FAILED"), timeout=60)
    lines = out.read_text().splitlines()
    seen = read_vars(out)
    assert seen["OVER"] != "0" and seen["UNDER"] == "0", lines
    assert lines.count("HELD") == 1, lines  # only the step within its --mem got there
    first, second = sorted(slurm_cluster.gpu_device_files(node))
    opened = [line.split() for line in lines if line.startswith(str(first.parent))]
    assert opened == [[str(first), "ENXIO"], [str(second), "EPERM"], [str(first), "EPERM"], [str(second), "EPERM"]]


def test_scancel_delivers_usr1_to_the_batch_script(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "usr1.out"
    script = f"""#!/bin/bash
#SBATCH --output={out}
trap 'echo GOT_USR1; kill %1; exit 0' USR1
sleep 60 &
echo READY
wait
echo NO_SIGNAL
"""
    job_id = slurm_cluster.submit(script)
    wait_for_text(out, "READY")
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", str(job_id)])
    assert slurm_cluster.wait_for_state(job_id) == "COMPLETED"
    assert out.read_text().split() == ["READY", "GOT_USR1"]


def test_requeue_reruns_the_job_with_restart_count_1(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "requeue.out"
    script = f"""#!/bin/bash
#SBATCH --requeue --open-mode=append --output={out}
echo "RUN restart=${{SLURM_RESTART_COUNT:-unset}}"
if [ -z "$SLURM_RESTART_COUNT" ]; then sleep 60 & wait; fi
"""
    job_id = slurm_cluster.submit(script)
    wait_for_text(out, "RUN restart=unset")
    requeued_at = time.monotonic()
    slurm_cluster.run(["scontrol", "requeue", str(job_id)])
    wait_for_text(out, "RUN restart=1", timeout=30)
    delay = time.monotonic() - requeued_at
    assert slurm_cluster.wait_for_state(job_id) == "COMPLETED"
    assert slurm_cluster.job_info(job_id)["Restarts"] == "1"
    # cred_expire=5 holds it for 6 s; sched_interval=1 starts it right after.
    assert 5.0 < delay < 12.0, f"requeued job restarted after {delay:.1f} s"


def write_step_script(path: Path, events: Path) -> Path:
    """A step that logs its SIGTERM (and exits) into `events`."""
    path.write_text(f"""#!/bin/bash
trap 'echo "STEP_TERM $(date +%s.%N)" >> {events}; exit 0' TERM
echo "STEP_READY $(date +%s.%N)" >> {events}
while true; do sleep 0.1; done
""")
    path.chmod(0o755)
    return path


def read_events(path: Path) -> list[tuple[str, float]]:
    return [(name, float(at)) for name, at in (line.split() for line in path.read_text().splitlines())]


@pytest.mark.full(covered_by="tests/integration/test_slurm_steps.py::test_a_preempted_job_is_requeued_at_once")
def test_a_preempted_job_gets_sigterm_in_its_steps_then_in_its_batch_script_and_is_requeued(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    events = tmp_path / "events"
    step = write_step_script(tmp_path / "step.sh", events)
    script = f"""#!/bin/bash
#SBATCH --requeue --output=/dev/null
echo "START_${{SLURM_RESTART_COUNT:-0}} $(date +%s.%N)" >> {events}
[ -n "$SLURM_RESTART_COUNT" ] && exit 0
trap 'echo "BATCH_TERM $(date +%s.%N)" >> {events}; exit 0' TERM
srun --ntasks=1 --overlap {step} &
while true; do sleep 0.1; done
"""
    job_id = slurm_cluster.submit(script, f"--partition={slurm_cluster.preemptible_partition}", "--nodelist=n1")
    wait_for_text(events, "STEP_READY")
    urgent = slurm_cluster.preempt("n1")
    wait_for_text(events, "START_1", timeout=60)
    assert slurm_cluster.wait_for_state(job_id) == "COMPLETED"
    assert slurm_cluster.wait_for_state(urgent) == "COMPLETED"
    seen = read_events(events)
    # Slurm 24.11.5 requeues the job once more when its restart ends (START_2: measured in both of two runs;
    # 20.11.4 and 22.05.8 do not). Relax leaves a run that completed alone (test_slurm_steps.py).
    names = [name for name, _ in seen]
    assert names[:5] == ["START_0", "STEP_READY", "STEP_TERM", "BATCH_TERM", "START_1"], seen
    assert names[5:] in ([[]] if version_of(slurm_version()) < (24, 11) else [[], ["START_2"]]), seen
    at = dict(seen)
    # The steps hear of it at once; the batch script only when the grace time is over, before Slurm 24.11
    # (measured on 20.11.4 and 22.05.8); on 24.11.5 it heard it once with its steps and once after the grace.
    assert at["STEP_TERM"] - at["STEP_READY"] < 5
    if version_of(slurm_version()) < (24, 11):
        assert at["BATCH_TERM"] - at["STEP_TERM"] >= slurm_cluster.preempt_grace_s - 1


@pytest.mark.full(covered_by="tests/integration/test_slurm_steps.py::test_a_preempted_job_is_requeued_at_once")
def test_a_preempted_job_that_may_not_be_requeued_ends_preempted(slurm_cluster: SlurmCluster) -> None:
    job_id = slurm_cluster.submit(
        "#!/bin/bash\nsleep 120\n", f"--partition={slurm_cluster.preemptible_partition}", "--nodelist=n2",
        "--no-requeue", "--output=/dev/null",
    )
    slurm_cluster.wait_for_state(job_id, ("RUNNING",))
    urgent = slurm_cluster.preempt("n2")
    assert slurm_cluster.wait_for_state(job_id, timeout=slurm_cluster.preempt_grace_s + 30) == "PREEMPTED"
    assert slurm_cluster.wait_for_state(urgent) == "COMPLETED"


def test_an_urgent_job_waits_for_a_debug_job_instead_of_preempting_it(slurm_cluster: SlurmCluster) -> None:
    job_id = slurm_cluster.submit("#!/bin/bash\nsleep 120\n", "--nodelist=n3", "--output=/dev/null")
    slurm_cluster.wait_for_state(job_id, ("RUNNING",))
    urgent = slurm_cluster.preempt("n3")
    time.sleep(3)
    assert slurm_cluster.job_state(job_id) == "RUNNING" and slurm_cluster.job_state(urgent) == "PENDING"
    slurm_cluster.run(["scancel", str(job_id)])
    assert slurm_cluster.wait_for_state(urgent) == "COMPLETED"


def test_a_second_user_runs_a_job_on_a_node_where_a_root_job_runs(slurm_cluster: SlurmCluster) -> None:
    user = slurm_cluster.second_user
    root_job = slurm_cluster.submit("#!/bin/bash\nsleep 120\n", "--nodelist=n4", "--cpus-per-task=1",
                                    "--output=/dev/null")
    slurm_cluster.wait_for_state(root_job, ("RUNNING",))
    out = slurm_cluster.user_dir(user) / "whoami.out"
    script = "#!/bin/bash\necho USER=$(id -un)\necho NODE=$SLURMD_NODENAME\n"
    job_id = slurm_cluster.submit_as(user, script, "--nodelist=n4", "--cpus-per-task=1", f"--output={out}")
    assert slurm_cluster.wait_for_state(job_id) == "COMPLETED"
    assert slurm_cluster.job_state(root_job) == "RUNNING"
    slurm_cluster.run(["scancel", str(root_job)])
    assert read_vars(out) == {"USER": user, "NODE": "n4"}
    assert out.owner() == user and slurm_cluster.job_info(job_id)["UserId"].startswith(f"{user}(")


def test_another_users_file_in_a_sticky_directory_is_refused_to_o_creat(slurm_cluster: SlurmCluster) -> None:
    """fs.protected_regular=1 (systemd's default) holds while the cluster runs: even root gets EACCES."""
    assert slurm_cluster.protected_regular
    assert Path("/proc/sys/fs/protected_regular").read_text() == "1\n"
    sticky = slurm_cluster.root / "sticky"  # like /tmp: world-writable, sticky, root's
    sticky.mkdir()
    sticky.chmod(0o1777)
    theirs = sticky / "lock"
    slurm_cluster.run(["touch", str(theirs)], user=slurm_cluster.second_user)
    with pytest.raises(PermissionError):
        os.open(theirs, os.O_RDWR | os.O_CREAT)
    os.close(os.open(theirs, os.O_RDWR))  # without O_CREAT it opens


NODE_VIEW = """#!/bin/bash
echo HOSTNAME=$(hostname)
echo RESOLVED=$(python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')
echo ADDRESSES=$(ip -o -4 addr show | awk '{print $2 "=" $4}' | sort | paste -sd ' ')
"""


def test_the_debian_node_resolves_its_hostname_to_127_0_1_1_and_has_a_routable_address(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    seen = {}
    for partition in (slurm_cluster.debian_partition, slurm_cluster.partition):
        out = tmp_path / f"{partition}.out"
        job_id = slurm_cluster.submit(NODE_VIEW, f"--partition={partition}", f"--output={out}")
        assert slurm_cluster.wait_for_state(job_id) == "COMPLETED"
        seen[partition] = read_vars(out)
    addresses = "lo=127.0.0.1/8 lo=127.0.0.2/8 relax0=10.77.0.1/24"
    assert seen[slurm_cluster.debian_partition] == {"HOSTNAME": "d1", "RESOLVED": "127.0.1.1", "ADDRESSES": addresses}
    # The other nodes keep this host's name and /etc/hosts.
    assert seen[slurm_cluster.partition]["HOSTNAME"] == socket.gethostname() != "d1"
    assert seen[slurm_cluster.partition]["RESOLVED"] == socket.gethostbyname(socket.gethostname())


def test_squeue_names_a_pending_jobs_state_in_the_plain_format_relax_asks_for(slurm_cluster: SlurmCluster) -> None:
    job_id = slurm_cluster.submit("#!/bin/bash\ntrue\n", "--hold", "--job-name=held")
    try:
        out = slurm_cluster.run(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%i|%T|%j|%r"]).stdout
    finally:
        slurm_cluster.run(["scancel", str(job_id)])
    assert out.split() == [f"{job_id}|PENDING|held|JobHeldUser"]
