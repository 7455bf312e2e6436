"""`relax submit` on this machine, as a user runs it: the whole loop over real Ray,
real engine servers, real gloo weight sync and real checkpoints.

- the quick start learns (reward up by >= 0.6), leaves metrics, TensorBoard
  events, logs and checkpoints; status/logs/convert-ckpt work on the run;
- resuming is exact: 2K steps == K steps + K resumed steps, bit for bit, and the resumed run's
  offline W&B run continues (trackers);
- mistakes are caught before any process starts (exit 2, nothing written).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import psutil
import pytest
import torch
from relax_runs import relax as relax_cli
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
REQUIRED = ("step", "reward_mean", "response_len_mean", "rollout_s", "train_s", "sync_s", "policy_version")


relax = partial(relax_cli, timeout=600)  # whole runs: longer than a command's 120 s


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    """One full quick-start run, shared by the tests that inspect it."""
    cwd = tmp_path_factory.mktemp("quickstart")
    proc = relax("submit", str(QUICKSTART), "--executor", "local", "--run-dir", "runs/qs", cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return cwd, cwd / "runs" / "qs", proc


def test_quickstart_learns_the_task(quickstart_run):
    _, run, proc = quickstart_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = yaml_steps()
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(key in rows[0] for key in REQUIRED)
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-5:]) / 5
    print(f"quick start reward_mean first 5: {first:.3f}, last 5: {last:.3f}")
    assert last - first >= 0.6
    assert [r["policy_version"] for r in rows] == [r["step"] for r in rows]
    assert {r["prompt_len_mean"] for r in rows} == {2.0}  # data.apply_chat_template: false, "ab" is 2 tokens
    assert "step 1/" in proc.stdout and f"step {steps}/{steps}" in proc.stdout  # live progress lines


def yaml_steps() -> int:
    import yaml

    return yaml.safe_load(QUICKSTART.read_text())["train"]["steps"]


def test_run_directory_holds_everything(quickstart_run):
    _, run, _ = quickstart_run
    assert (run / "recipe.yaml").is_file()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert "step 1/" in (run / "logs" / "driver.log").read_text()
    assert (run / "logs" / "engine-0.log").is_file()
    ckpts = run / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == str(yaml_steps())
    assert (ckpts / f"iter_{yaml_steps():07d}" / ".metadata").is_file()
    assert len(list(ckpts.glob("iter_*"))) <= 2  # keep_last: 2 in the recipe
    secrets = run / "secrets"
    assert oct(secrets.stat().st_mode & 0o777) == "0o700"
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in secrets.iterdir())
    # Ray's own logs are kept with the run, as a Slurm node keeps them, and its folder under /tmp is gone.
    assert list((run / "logs" / "ray" / "local").glob("session_*/raylet.out"))
    ray_dir = re.search(r"Ray cluster up \(its sockets and logs in (\S+)\)", (run / "logs" / "driver.log").read_text())
    assert ray_dir and not Path(ray_dir[1]).exists()


def test_status_and_logs_of_the_finished_run(quickstart_run):
    cwd, run, _ = quickstart_run
    status = json.loads(relax("status", "qs", "--json", cwd=cwd).stdout)  # a run name under ./runs
    assert status["state"] == "completed" and status["step"] == yaml_steps()
    assert status["latest_checkpoint"] == yaml_steps()
    newest = json.loads(relax("status", "--json", cwd=cwd).stdout)  # default: the newest run under ./runs
    assert newest["run_dir"] == str(run.resolve())
    assert relax("status", "no-such-run", cwd=cwd).returncode == 2
    logs = relax("logs", str(run), "-f", cwd=cwd, timeout=60)  # a finished run: -f returns
    assert logs.returncode == 0 and f"step {yaml_steps()}/" in logs.stdout


def test_convert_ckpt_verify_and_load_with_transformers(quickstart_run, tmp_path):
    cwd, run, _ = quickstart_run
    out = tmp_path / "hf"
    proc = relax("convert-ckpt", str(run / "checkpoints"), "--out", str(out), "--verify", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    assert "verified" in proc.stdout
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "abc"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert model(torch.tensor([ids])).logits.shape[-1] == len(tokenizer)
    assert (out / "generation_config.json").is_file()


def test_convert_ckpt_refuses_damaged_or_missing_checkpoints(quickstart_run, tmp_path):
    import shutil

    cwd, run, _ = quickstart_run
    broken = tmp_path / "ckpt"
    shutil.copytree(run / "checkpoints", broken)
    data_file = next((broken / f"iter_{yaml_steps():07d}").glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])
    proc = relax("convert-ckpt", str(broken), "--out", str(tmp_path / "o1"), "--verify", cwd=cwd)
    assert proc.returncode == 2 and data_file.name in proc.stderr
    proc = relax("convert-ckpt", str(tmp_path / "nothing"), "--out", str(tmp_path / "o2"), cwd=cwd)
    assert proc.returncode == 2 and "nothing" in proc.stderr
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


SMALL = ["rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "checkpoint.interval=2",
         "checkpoint.keep_last=5", "logging.backends=[]"]
# The resumed run also logs to an offline W&B run and an offline ClearML task (the trackers' tests share it):
# trackers change no weight. A token in the recipe's environment and one in the driver's.
WANDB = ["logging.backends=[jsonl,wandb,clearml]", "logging.wandb.project=relax-test",
         "logging.clearml.project=relax-test", "cluster.train.env={RELAX_TEST_TOKEN: hunter2}"]
DRIVER_SECRET = {"RELAX_TEST_SECRET": "hunter3-of-the-driver"}


def final_weights(run: Path, tmp: Path, iteration: int) -> dict[str, torch.Tensor]:
    from relax_core.checkpoint import export_hf

    out = export_hf(run / "checkpoints", tmp / f"{run.name}-hf", iteration)
    return load_file(out / "model.safetensors")


def wandb_processes() -> set[int]:
    found = set()
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        if "wandb" in (proc.info["name"] or "") or any("wandb-core" in part for part in proc.info["cmdline"] or []):
            found.add(proc.info["pid"])
    return found


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory) -> dict:
    """4 steps straight, and 2 steps then resumed to 4 (logging to W&B offline), shared by the tests that
    inspect them."""
    cwd = tmp_path_factory.mktemp("resume")
    before = wandb_processes()
    straight = relax("submit", str(QUICKSTART), "train.steps=4", *SMALL, "--executor", "local",
                     "--run-dir", "straight", cwd=cwd)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = relax("submit", str(QUICKSTART), "train.steps=2", *SMALL, *WANDB, "--executor", "local",
                  "--run-dir", "resumed", cwd=cwd, env=DRIVER_SECRET)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_id = (cwd / "resumed" / "wandb_run_id").read_text().strip()
    second = relax("submit", str(QUICKSTART), "train.steps=4", *SMALL, *WANDB, "--executor", "local",
                   "--run-dir", "resumed", cwd=cwd, env=DRIVER_SECRET)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return {"cwd": cwd, "second": second, "run_id": run_id, "wandb_before": before}


@pytest.mark.full(covered_by="tests/integration/test_slurm_launch.py::test_preemption_mid_rollout_checkpoints_at_once_requeues_and_resumes")
def test_resume_is_exact(resumed_runs):
    cwd, second = resumed_runs["cwd"], resumed_runs["second"]
    assert "step 3/4" in second.stdout and "step 1/4" not in second.stdout  # it continued, not restarted

    a = final_weights(cwd / "straight", cwd, 4)
    b = final_weights(cwd / "resumed", cwd, 4)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    (cwd / "mid").mkdir()
    middle = final_weights(cwd / "straight", cwd / "mid", 2)
    assert any(not torch.equal(middle[n], a[n]) for n in a)  # the last two steps did change the weights
    rows_a = [json.loads(x) for x in (cwd / "straight" / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (cwd / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in rows_a] == [r["reward_mean"] for r in rows_b]


@pytest.mark.full(covered_by="tests/integration/test_local_run.py::"
                              "test_run_directory_holds_everything")
def test_an_offline_wandb_run_holds_every_step_and_a_resume_continues_it(resumed_runs):
    """Trackers as a user on a cluster without a network uses them (`logging.backends: [jsonl, wandb]`): an
    offline W&B run under RUN/wandb whose every step holds the metrics of metrics.jsonl, in the project the
    recipe names, with the recipe as its config but no environment variable's value, and no TensorBoard files
    (not listed); resumed, it continues the same W&B run id. The records are read from the file wandb wrote
    (tests/wandb_records.py), and no wandb process outlives the run."""
    from wandb_records import history, run_info

    run = resumed_runs["cwd"] / "resumed"
    assert not (run / "tensorboard").exists()  # not in logging.backends
    files = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and [run_info(f) for f in files] == [(resumed_runs["run_id"], "relax-test")] * 2
    logged = [row for f in files for row in history(f)]
    jsonl = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [row["step"] for row in jsonl] == [1, 2, 3, 4]
    for mine, theirs in zip(jsonl, logged):
        assert theirs["reward_mean"] == pytest.approx(mine["reward_mean"])
        assert theirs["train_s"] == pytest.approx(mine["train_s"])
    # The recipe is the run's config, without the values of environment variables (tokens, often).
    assert all(b"RELAX_TEST_TOKEN" in f.read_bytes() and b"hunter2" not in f.read_bytes() for f in files)
    assert wandb_processes() <= resumed_runs["wandb_before"]  # wandb's service ended with the run


@pytest.mark.full(covered_by="tests/integration/test_clearml_run.py::"
                              "test_an_offline_task_holds_each_step_a_resume_continues_it_and_no_token_is_recorded")
def test_an_offline_clearml_task_holds_every_step_and_a_resume_continues_it(resumed_runs):
    """`logging.backends: [clearml]` in a run without a network, interrupted and resumed: one offline ClearML task
    under RUN/clearml whose scalars are metrics.jsonl's, step by step, in the project the recipe names, continued
    by the resumed attempt; neither the recipe's token nor the driver's in any file ClearML wrote."""
    run = resumed_runs["cwd"] / "resumed"
    task_id = (run / "clearml_task_id").read_text().strip()
    session = run / "clearml" / "offline" / task_id
    assert sorted(p.name for p in session.parent.iterdir()) == [task_id, f"{task_id}.zip"]
    task = json.loads((session / "task.json").read_text())
    assert (task["project_name"], task["name"]) == ("relax-test", "resumed")
    events = [e for line in (session / "metrics.jsonl").read_text().splitlines() for e in json.loads(line)
              if e["type"] == "training_stats_scalar"]
    jsonl = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for name in ("reward_mean", "train_s"):
        logged = [(e["iter"], e["value"]) for e in events if e["metric"] == name]
        assert logged == [(row["step"], pytest.approx(row[name])) for row in jsonl], name
    print(f"ClearML task {task_id}: reward_mean by step "
          f"{[(e['iter'], round(e['value'], 3)) for e in events if e['metric'] == 'reward_mean']}")
    for path in (p for p in (run / "clearml").rglob("*") if p.is_file() and p.suffix != ".zip"):
        data = path.read_bytes()
        assert b"hunter2" not in data and DRIVER_SECRET["RELAX_TEST_SECRET"].encode() not in data, path
    assert b"RELAX_TEST_TOKEN" in (session / "task.json").read_bytes()  # the recipe, its env's names


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model={path: /nonexistent/model}"], ["model.path", "/nonexistent/model"]),
        (["reward.name=no_such_reward"], ["reward.name", "no_such_reward", "copy"]),
        (["rollout.max_new_tokens=600"], ["rollout.max_new_tokens", "context"]),
        (["rollout.prompts_per_step=3", "rollout.n_samples_per_prompt=1", "train.cpu_ranks_per_node=2"],
         ["rollout.prompts_per_step", "data-parallel"]),
    ],
)
def test_bad_input_fails_before_anything_starts(tmp_path, overrides, words):
    proc = relax("submit", str(QUICKSTART), *overrides, "--executor", "local", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for word in words:
        assert word in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory, nothing started


PLUGIN = '''from relax_core.rewards.registry import reward


@reward("first_letter")
def first_letter(response, label, metadata):
    """1.0 when the response starts with the label's first letter."""
    return float(bool(response) and response[0] == label[0])
'''


def test_a_reward_plugin_next_to_the_recipe_trains_with_no_other_change(tmp_path):
    import yaml

    (tmp_path / "my_rewards").mkdir()
    (tmp_path / "my_rewards" / "letters.py").write_text(PLUGIN)
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["reward"] = {"name": "first_letter", "plugin_dirs": ["my_rewards"]}  # relative to the recipe file
    raw["train"]["steps"] = 2
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = relax("submit", str(tmp_path / "recipe.yaml"), "--executor", "local", "--run-dir", "run", cwd=elsewhere)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(x) for x in (elsewhere / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    assert rows[0]["reward_errors"] == 0

    (tmp_path / "my_rewards" / "broken.py").write_text("import no_such_module\n")
    proc = relax("submit", str(tmp_path / "recipe.yaml"), "--executor", "local", cwd=tmp_path)
    assert proc.returncode == 2 and "broken.py" in proc.stderr and "no_such_module" in proc.stderr


@pytest.mark.full(covered_by="tests/integration/test_local_run.py::test_quickstart_learns_the_task")
def test_on_a_terminal_submit_shows_one_live_line_and_the_log_keeps_every_step(tmp_path):
    """`relax submit` on a terminal (a pseudo-terminal here) redraws one progress line with the bar, ETA
    and latest figures instead of printing a line per step; the driver log has every step."""
    import pty
    import re

    main, child = pty.openpty()
    env = os.environ | {"COLUMNS": "200", "TERM": "xterm-256color", "HF_HUB_OFFLINE": "1"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "relax_cli.main", "submit", str(QUICKSTART), "train.steps=12",
                             *SMALL, "--executor", "local", "--run-dir", "run"],
                            cwd=tmp_path, env=env, stdin=child, stdout=child, stderr=child, close_fds=True)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # the terminal closed: the command ended
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    assert proc.wait(timeout=300) == 0
    shown = b"".join(chunks).decode(errors="replace")
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown)
    assert "\x1b[2K" in shown or "\x1b[1A" in shown, shown[-2000:]  # redrawn in place
    assert re.search(r"step\s+12/12 .*eta .*reward \d\.\d{3} \| len", plain), plain[-2000:]
    assert not re.search(r"step \d+/12 \| reward", plain)  # no line per step on the terminal
    logged = (tmp_path / "run" / "logs" / "driver.log").read_text()
    assert [int(n) for n in re.findall(r"step (\d+)/12 \| reward", logged)] == list(range(1, 13))
