"""`relax submit --executor slurm` against a real Slurm cluster (4 node names on this host).

A heterogeneous job brings up Ray across both groups and runs the quick start
to completion, its steps in a container; with a third component (`cluster.reference`, het group 2) a
fully_async run places rollout, reference and trainer on three nodes;
preemption in the middle of a rollout checkpoints at once, requeues and
resumes; a node whose Ray worker cannot start fails the job with its name;
the Ray cluster refuses drivers without the run's token; and what Slurm can refuse is refused before
anything is submitted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import fake_apptainer
import httpx
import pytest
from relax_runs import relax, wait_for

# Steps made long by generation, and how to read a run's checkpoints: shared with the local test.
from test_preemption import CHECKPOINT_WITHIN_S, LONG_STEPS, PROMPTS_PER_STEP, latest_checkpoint, saved_progress

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
# One training node and one rollout node; the job's processes talk over loopback.
ON_TWO_NODES = ["cluster.rollout.nodes=1", "cluster.rollout.cpus_per_node=2", "cluster.network.interface=lo",
                "logging.backends=[]"]


def submit(cwd: Path, run: str, *overrides: str) -> str:
    proc = relax("submit", str(QUICKSTART), *ON_TWO_NODES, *overrides, "--executor", "slurm", "--run-dir", run,
                 cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((cwd / run / "run.json").read_text())["job_id"]


def status(cwd: Path, run: str) -> dict:
    proc = relax("status", run, "--json", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


FINAL = ("completed", "failed", "died", "cancelled")


def final_status(cwd: Path, run: str, timeout: float, what: str) -> dict:
    """`relax status` of the run once it ended. The wait reads the state in this process, as that command
    does (run.json and Slurm's view): a command started every second would take a core from the job."""
    from relax_core.launch.status import run_status
    from relax_core.rundir import RunDir

    wait_for(lambda: run_status(RunDir(cwd / run))["state"] in FINAL, timeout, what)
    return status(cwd, run)


def steps_done(run: Path, count: int):
    """True once `count` steps are logged; fails at once if the job already failed."""
    state = json.loads((run / "run.json").read_text())
    assert state.get("state") != "failed", f"the job failed: {state.get('error')}\n{logs_of(run)}"
    return len(metrics(run)) >= count


def nodes_joined(run: Path) -> bool:
    """True once the driver saw every node join; fails at once if the job already failed."""
    state = json.loads((run / "run.json").read_text())
    assert state.get("state") != "failed", f"the job failed: {state.get('error')}\n{logs_of(run)}"
    driver_log = run / "logs" / "driver.log"
    return driver_log.exists() and "nodes joined" in driver_log.read_text()


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def logs_of(run: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((run / "logs").glob("*"))
                     if p.is_file())  # logs/ray/ holds Ray's own logs, a folder per node


def container_on_path(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The stand-in `apptainer` first on PATH (Apptainer cannot run on the test machine) and an image whose
    Python imports this checkout's Relax: the environment for `relax submit`, and the image."""
    image = tmp_path / "relax.sif"
    image.write_text(json.dumps({"env": {"PYTHONPATH": str(REPO)}}))
    env = {"PATH": fake_apptainer.on_path(tmp_path), "FAKE_APPTAINER_LOG": str(tmp_path / "apptainer.jsonl"),
           "NCCL_IB_HCA": "mlx5_from_a_module"}
    return env, image


def test_quickstart_runs_to_completion_on_a_heterogeneous_job_in_a_container(slurm_cluster, tmp_path):
    """The quick start on a het job (n1 train, n2 rollout) whose steps run in a container, through a stand-in
    apptainer (tests/fake_apptainer.py) that applies `--cleanenv`, `APPTAINERENV_*`, `--env` and the binds'
    existence as Apptainer documents them, records each call, then runs the step's command for real: the Ray
    nodes and the driver run and train. The other Slurm runs here (preemption, scale-out) run without one."""
    env, image = container_on_path(tmp_path)
    plugins, scratch = tmp_path / "plugins", tmp_path / "scratch"
    plugins.mkdir()
    scratch.mkdir()
    proc = relax("submit", str(QUICKSTART), *ON_TWO_NODES, "train.steps=20", f"cluster.container.image={image}",
                 f"reward.plugin_dirs=[{plugins}]", f"checkpoint.dir={scratch}/ckpt/quick", "--executor", "slurm",
                 "--run-dir", "runs/het", cwd=tmp_path, env=env, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = json.loads((tmp_path / "runs" / "het" / "run.json").read_text())["job_id"]
    run = tmp_path / "runs" / "het"
    final = final_status(tmp_path, "runs/het", 300, "the job to finish")
    assert final["state"] == "completed", logs_of(run)
    assert final["job_id"] == job_id and final["step"] == 20 and final["latest_checkpoint"] == 20
    assert (scratch / "ckpt" / "quick" / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    driver_log = (run / "logs" / "driver.log").read_text()
    assert "all 2 nodes joined" in driver_log
    assert "'relax_train'" in driver_log and "'relax_rollout'" in driver_log  # both custom resources
    state = json.loads((run / "run.json").read_text())
    assert state["nodes"] == {"train": ["n1"], "rollout": ["n2"]}
    assert (run / "logs" / "ray-n2.log").is_file()
    for node in ("n1", "n2"):  # each node's Ray logs, saved as the job stopped its steps
        assert list((run / "logs" / "ray" / node).glob("session_*/raylet.out")), logs_of(run)
    token = run / "secrets" / "ray_token"
    assert oct(token.stat().st_mode & 0o777) == "0o600"

    calls = [json.loads(line) for line in Path(env["FAKE_APPTAINER_LOG"]).read_text().splitlines()]
    started = []
    for call in (call for call in calls if "-m" in call["argv"]):
        argv, caller = call["argv"], call["env"]
        assert argv[1:3] == ["exec", "--cleanenv"]
        binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
        # The plug-in folder, the checkpoint folder's nearest existing parent, the run directory, each once.
        assert {str(plugins), str(scratch), str(run)} <= set(binds) and len(binds) == len(set(binds)), binds
        assert caller["APPTAINERENV_SLURM_JOB_ID"] == str(job_id)  # what srun set for the step, passed in
        assert "APPTAINERENV_NCCL_IB_HCA" not in caller  # a module's NCCL setting stays out
        started.append((argv[argv.index("-m") + 1], caller["APPTAINERENV_SLURMD_NODENAME"]))
    assert sorted(started) == [("relax_core.cluster.node", "n1"), ("relax_core.cluster.node", "n2"),
                               ("relax_core.entrypoints.slurm_driver", "n1")]


@pytest.mark.full(covered_by="tests/integration/test_slurm_launch.py::test_quickstart_runs_to_completion_on_a_heterogeneous_job_in_a_container")
def test_fully_async_with_a_reference_group_runs_each_service_on_its_own_node(slurm_cluster, tmp_path):
    """A three-component job: training on n1, rollout on n2, the reference service on n3 (het group 2, which
    joins Ray with its resource); the run completes with the KL term fed by the reference service."""
    submit(tmp_path, "runs/ref", "mode=fully_async", "algorithm.kl.coef=0.01", "cluster.reference.nodes=1",
           "cluster.reference.cpus_per_node=1", "train.steps=6")
    run = tmp_path / "runs" / "ref"
    final = final_status(tmp_path, "runs/ref", 300, "the job to finish")
    assert final["state"] == "completed", logs_of(run)
    driver_log = (run / "logs" / "driver.log").read_text()
    assert "all 3 nodes joined" in driver_log and "'relax_reference': 1.0" in driver_log, logs_of(run)
    assert "services ready: rollout on n2, reference on n3, advantages on n2" in driver_log, driver_log[-3000:]
    assert json.loads((run / "run.json").read_text())["nodes"] == {"train": ["n1"], "rollout": ["n2"],
                                                                   "reference": ["n3"]}
    started = (run / "logs" / "ray-n3.log").read_text()  # the node step prints its `ray start` first
    assert "(reference, index 2," in started and '{"relax_node_n3": 1, "relax_reference": 1}' in started
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(r["kl_loss"] > 0 for r in rows[1:])
    assert all(r["staleness_max"] <= 1 for r in rows)


@pytest.mark.full(covered_by="tests/integration/test_listening_sockets.py::test_every_process_of_a_local_job_listens_on_loopback_only")
def test_ray_cluster_refuses_a_driver_without_the_token(slurm_cluster, tmp_path):
    """An outsider is turned away at once: the GCS answers UNAUTHENTICATED within milliseconds, and a
    `ray.init` without the token fails within seconds (each of Ray's connect retries is refused; a
    client allowed 3 of them, as here, gives up after about 3 s, one with Ray's default 20 after 20 s)."""
    submit(tmp_path, "runs/sec", "train.steps=400", "checkpoint.interval=1000")
    run = tmp_path / "runs" / "sec"
    wait_for(lambda: steps_done(run, 1), 240, "the first step")
    head = json.loads((run / "run.json").read_text())["ray_head"]
    token = (run / "secrets" / "ray_token").read_text().strip()
    for outsider in ("", "not-the-token"):
        code, seconds = gcs_answer(head, outsider)
        assert code == "UNAUTHENTICATED" and seconds < 5, (code, seconds)
    assert gcs_answer(head, token)[0] == "OK"  # the same request with the run's token is answered
    wrong = tmp_path / "wrong_token"
    wrong.write_text("not-the-token")
    wrong.chmod(0o600)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"RAY_NUM_REDIS_GET_RETRIES": "3"}
    for env in (clean, clean | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)}):
        proc, seconds = attach(head, env, tmp_path)
        assert "REFUSED" in proc.stdout and "ATTACHED" not in proc.stdout, proc.stdout + proc.stderr
        assert seconds < 30 and "Authentication token is missing or incorrect" in proc.stderr, (seconds, proc.stderr)
    right = clean | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(run / "secrets" / "ray_token")}
    proc, _ = attach(head, right, tmp_path)
    assert "ATTACHED" in proc.stdout, proc.stdout + proc.stderr  # the same check does pass with the token
    assert relax("cancel", "runs/sec", cwd=tmp_path).returncode == 0
    assert wait_for(lambda: status(tmp_path, "runs/sec")["state"] == "cancelled", 60, "the cancel")


def gcs_answer(head: str, token: str) -> tuple[str, float]:
    """The GCS's answer to one request (its cluster id), sent with `token` (or none), and how long it took."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else []
    start = time.monotonic()
    with grpc.insecure_channel(head) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), metadata=metadata, timeout=10)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
    return code, time.monotonic() - start


def attach(head: str, env: dict[str, str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    """`ray.init(address=head)` in a fresh process; returns it and how long it took."""
    code = ("import ray, sys\n"
            "try:\n    ray.init(address=sys.argv[1]); print('ATTACHED', ray.cluster_resources())\n"
            "except Exception as exc:\n    print('REFUSED', type(exc).__name__, exc)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, head], env=env, capture_output=True, text=True, timeout=60,
                          cwd=cwd)
    return proc, time.monotonic() - start


def test_preemption_mid_rollout_checkpoints_at_once_requeues_and_resumes(slurm_cluster, tmp_path):
    """USR1 to the batch step in the middle of a long rollout, as Slurm sends it `signal_before_end_s`
    before the time limit: the last completed step is checkpointed within seconds, the job requeues
    itself, and the rerun regenerates the dropped step."""
    job_id = submit(tmp_path, "runs/pre", *LONG_STEPS)
    run = tmp_path / "runs" / "pre"
    wait_for(lambda: steps_done(run, 1), 400, "step 1", poll=0.1)
    time.sleep(0.5)
    assert latest_checkpoint(run) is None and len(metrics(run)) == 1  # step 2 is rolling out
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job_id])
    signalled = time.monotonic()
    wait_for(lambda: latest_checkpoint(run) == 1, 60, "the checkpoint of step 1", poll=0.05)
    took = time.monotonic() - signalled
    print(f"slurm: USR1 -> checkpoint of step 1 written {took:.2f}s later")
    assert took < CHECKPOINT_WITHIN_S
    rerun = wait_for(lambda: json.loads((run / "run.json").read_text()).get("restart_count", 0) >= 1
                     and json.loads((run / "run.json").read_text()), 300, "the requeued job to start")
    assert rerun["job_id"] == job_id and rerun["restart_count"] == 1 and rerun["checkpoint_step"] == 1
    final = final_status(tmp_path, "runs/pre", 400, "the resumed job to finish")
    assert final["state"] == "completed", logs_of(run)
    assert [row["step"] for row in metrics(run)] == [1, 2]
    assert saved_progress(run) == {"step": 2, "data": {"cursor": 2 * PROMPTS_PER_STEP}, "policy_version": 2,
                                   "engines_added": 0}
    assert "at step 1" in (run / "logs" / "driver.log").read_text()  # "resumed from ... at step 1"


def test_scale_rollout_grows_the_job_onto_a_second_slurm_job_and_back(slurm_cluster, tmp_path):
    """`relax scale-rollout +1` on a running fully_async job: a rollout-only job starts, its node joins the
    run's Ray cluster, its engine gets the weights and serves (the router routes to it, its own counter
    counts); `-1` drains it and that job ends; the run goes on with one engine, every step within the
    staleness bound and every sample trained on once (the driver checks both every step), until the user
    cancels it. The run has more steps than it could reach, whatever the machine's pace: a run that ends
    before `-1` fails the test, and the quick start's steps behind a router take 0.1 to 0.5 s here."""
    from test_elastic import Api, engine_stats

    job_id = submit(tmp_path, "runs/el", "mode=fully_async", "rollout.router=true", "rollout.max_staleness=1",
                    "train.steps=100000")
    run = tmp_path / "runs" / "el"
    wait_for(lambda: steps_done(run, 1), 400, "step 1", poll=0.2)
    api, key = Api(run), (run / "secrets" / "engine_api_key").read_text().strip()
    asked = time.monotonic()
    grow = relax("scale-rollout", "+1", "runs/el", cwd=tmp_path, timeout=300)
    assert grow.returncode == 0, grow.stdout + grow.stderr + logs_of(run)
    op = api.get("/v1/scale").json()["operations"][-1]
    extra = op["slurm_job_id"]
    assert extra and extra != job_id and "Slurm job" in grow.stdout
    assert slurm_cluster.run(["squeue", "-h", "-j", extra, "-o", "%T"]).stdout.strip() == "RUNNING"
    added = api.engine(op["engines"][0])
    assert added["state"] == "active" and added["node"] in ("n3", "n4"), added
    wait_for(lambda: engine_stats(added["url"], key)["finished_requests"] > 0, 60, "its first request", poll=0.2)
    print(f"slurm: relax scale-rollout +1 -> the new engine's first request: {time.monotonic() - asked:.1f}s")
    router = api.get("/v1/status").json()["router"]
    workers = httpx.get(f"{router}/workers", headers={"Authorization": f"Bearer {key}"}).json()["workers"]
    assert added["url"] in [w["url"] for w in workers]
    assert f"ray-{added['node']}-{op['id']}.log" in [p.name for p in (run / "logs").iterdir()]

    shrink = relax("scale-rollout", "-1", "runs/el", cwd=tmp_path, timeout=300)
    assert shrink.returncode == 0, shrink.stdout + shrink.stderr
    wait_for(lambda: slurm_cluster.run(["squeue", "-h", "-j", extra, "-o", "%T"], check=False).stdout.strip()
             in ("", "COMPLETED", "CANCELLED"), 60, "the scale-out job to end")
    shrunk = len(metrics(run))
    wait_for(lambda: steps_done(run, shrunk + 3), 120, "three steps after the shrink", poll=0.2)
    cancelled = relax("cancel", "runs/el", cwd=tmp_path)
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    final = final_status(tmp_path, "runs/el", 120, "the job to end")
    assert final["state"] == "cancelled", logs_of(run)
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and max(r["staleness_max"] for r in rows) <= 1
    # The step that ran as the engine left may count it; every later one has the run's own engine only.
    assert 2.0 in [r["engines"] for r in rows] and {r["engines"] for r in rows[shrunk + 1:]} == {1.0}


@pytest.mark.full(covered_by="tests/integration/test_slurm_steps.py::test_a_step_slurm_does_not_start_fails_the_job_within_the_startup_timeout_naming_it[driver]")
def test_a_rollout_node_whose_ray_worker_cannot_start_fails_the_job_naming_it(slurm_cluster, tmp_path):
    start = time.monotonic()
    submit(tmp_path, "runs/bad", "cluster.rollout.env={RAY_AUTH_TOKEN_PATH: /nonexistent/token}",
           "cluster.slurm.startup_timeout_s=60")
    run = tmp_path / "runs" / "bad"
    final = final_status(tmp_path, "runs/bad", 150, "the job to fail")
    assert final["state"] == "failed"
    nodes = json.loads((run / "run.json").read_text())["nodes"]  # where Slurm put each group
    (rollout,), (train,) = nodes["rollout"], nodes["train"]
    assert rollout in final["error"] and train not in final["error"].split("see")[0], (nodes, final["error"])
    assert time.monotonic() - start < 60 + 60  # within the readiness timeout (plus job start and teardown)
    assert not metrics(run)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["cluster.train.nodes=8"], ["cluster.train", "node"]),
        (["cluster.slurm.partition=nosuchpartition"], ["cluster.slurm.partition", "nosuchpartition"]),
        (["cluster.container.image=/nonexistent/relax.sif"], ["cluster.container.image", "/nonexistent/relax.sif"]),
    ],
)
def test_impossible_requests_are_refused_before_submission(slurm_cluster, tmp_path, overrides, words):
    before = slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()
    proc = relax("submit", str(QUICKSTART), *overrides, "--executor", "slurm", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for word in words:
        assert word in proc.stderr
    assert list(tmp_path.iterdir()) == []
    assert slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split() == before


def test_dry_run_prints_the_script_and_submits_nothing(slurm_cluster, tmp_path):
    proc = relax("submit", str(QUICKSTART), *ON_TWO_NODES, "--executor", "slurm", "--dry-run", "--run-dir", "r",
                 cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH hetjob" in proc.stdout and str(tmp_path / "r") in proc.stdout
    assert (tmp_path / "r" / "job.sbatch").read_text() in proc.stdout
    assert "plan: colocate on the slurm executor (het group 0: train, 1: rollout)" in proc.stdout
    assert "rollout[0]" in next(line for line in proc.stdout.splitlines() if line.endswith("engine 0 (cpu)"))
    assert "job_id" not in json.loads((tmp_path / "r" / "run.json").read_text())


def test_convert_ckpt_runs_as_a_slurm_job_through_submitit(slurm_cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    from relax_core.checkpoint import save_checkpoint
    from relax_core.models.tiny import materialize_tiny_model

    model_dir = materialize_tiny_model(tmp_path / "model", seed=3)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    save_checkpoint(tmp_path / "ckpt", 7, {"model": model.state_dict()}, hf_dir=model_dir)
    proc = relax("convert-ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--verify", "--slurm",
                 "--partition", slurm_cluster.partition, "--cpus", "1", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "submitted Slurm job" in proc.stdout and "verified" in proc.stdout
    assert list((tmp_path / "hf.submitit").glob("*_log.out"))  # it really ran as a job
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for name, tensor in model.state_dict().items():
        assert (converted.state_dict()[name] == tensor).all(), name


SHIPPED = sorted((REPO / "recipes").rglob("*.yaml"))


@pytest.mark.parametrize("container", [False, True], ids=["plain", "container"])
@pytest.mark.parametrize("recipe_path", SHIPPED, ids=lambda p: p.stem)
def test_sbatch_test_only_accepts_the_script_of_every_shipped_recipe(slurm_cluster, tmp_path, recipe_path,
                                                                     container):
    from relax_core.config import load_recipe
    from relax_core.launch.slurm import render_job_script, test_only
    from relax_core.rundir import RunDir

    overrides = [f"cluster.slurm.partition={slurm_cluster.gpu_partition}"]  # g1, g2: 64 CPUs, 8 GPUs
    if container:
        image = tmp_path / "relax.sif"
        image.write_bytes(b"")
        overrides += [f"cluster.container.image={image}", f"cluster.container.binds=[{tmp_path}:/data:ro]"]
    script = tmp_path / "job.sbatch"
    script.write_text(render_job_script(load_recipe(recipe_path, overrides), RunDir(tmp_path / "run")))
    test_only(script)  # raises RecipeError with Slurm's reason if Slurm refuses
