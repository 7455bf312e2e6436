"""The plan `relax validate` and `relax submit --dry-run` print, and the GPU arithmetic behind it.

Golden files (tests/golden/*.plan) were read line by line when written: for
each GPU recipe, every trainer rank on its own GPU of the train group, every
engine on `gpus_per_engine` GPUs of one node (in colocate those of the trainer
ranks it shares them with), the router beside the driver, the services of the
asynchronous modes where services/launch.py starts them, and the engines'
command lines. A change shows up as a diff to review; regenerate them with
RELAX_UPDATE_GOLDEN=1 after checking the new output by eye.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from relax_runs import relax

from relax_core.cluster.placement import engine_slot_gpus, trainer_gpu
from relax_core.config import load_recipe
from relax_core.launch.plan import plan_lines, resource_problems

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
FSDP = REPO / "recipes" / "math_dapo_qwen3_4b_fsdp.yaml"
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
ASYNC = ["mode=fully_async", "cluster.rollout.nodes=1"]  # what the fsdp recipe's comment says to override
# An LLM judge Relax serves on two SGLang engines beside two policy engines
GENRM = ["rollout.num_engines=2", "reward.name=genrm", "reward.genrm.model=Qwen/Qwen3-8B", "reward.genrm.num_engines=2"]
CASES = {
    "math_dapo_qwen3_4b": ("math_dapo_qwen3_4b.yaml", []),
    "math_dapo_qwen3_4b_fsdp": ("math_dapo_qwen3_4b_fsdp.yaml", []),
    "math_dapo_qwen3_4b_fsdp_fully_async": ("math_dapo_qwen3_4b_fsdp.yaml", ASYNC),
    "vlm_openr1_qwen3vl_4b": ("vlm_openr1_qwen3vl_4b.yaml", []),
    "omni_avqa": ("omni_avqa.yaml", []),
    "math_dapo_qwen3_4b_fsdp_fully_async_genrm": ("math_dapo_qwen3_4b_fsdp.yaml", [*ASYNC, *GENRM]),
}


def recipe(name: str, overrides: list[str] = ()):
    return load_recipe(REPO / "recipes" / name, list(overrides))


@pytest.mark.parametrize("case", CASES)
def test_plan_of_each_gpu_recipe_matches_its_golden_file(case):
    golden = GOLDEN / f"{case}.plan"
    text = "\n".join(plan_lines(recipe(*CASES[case]), "slurm", python="python3")) + "\n"
    if os.environ.get("RELAX_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


@pytest.mark.parametrize("case", CASES)
def test_every_shipped_gpu_recipe_fits_its_groups(case):
    assert resource_problems(recipe(*CASES[case])) == []


def test_colocated_engines_sit_on_the_gpus_of_the_trainer_ranks():
    r = recipe("math_dapo_qwen3_4b_fsdp.yaml")
    trainers = {trainer_gpu(r, rank) for rank in range(r.train_ranks)}
    assert trainers == {(0, gpu) for gpu in range(8)}  # one rank per GPU of the one node
    engines = [engine_slot_gpus(r, i) for i in range(r.rollout.num_engines)]
    held = [(node, gpu) for node, gpus in engines for gpu in gpus]
    assert sorted(held) == sorted(trainers)  # 4 x TP 2: every GPU once, each a trainer rank's too
    lines = plan_lines(r, "slurm", python="python3")
    assert "GPUs 2-3" in next(line for line in lines if "engine 1 (sglang, TP 2)" in line)
    assert "trainer ranks 2-3" in next(line for line in lines if "engine 1 (sglang, TP 2)" in line)


def test_asynchronous_engines_get_the_rollout_groups_gpus():
    r = recipe("math_dapo_qwen3_4b_fsdp.yaml", ASYNC)
    lines = plan_lines(r, "slurm", python="python3")
    engine_lines = [line for line in lines if "(sglang, TP 2)" in line]
    assert len(engine_lines) == 4 and all(line.split()[0] == "rollout[0]" for line in engine_lines)
    assert not any("trainer rank" in line for line in engine_lines)  # nothing shared
    assert "cluster.rollout: 1 node x 8 GPUs = 8 GPUs: 4 engines x 2 GPUs = 8 GPUs" in "\n".join(lines)


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("math_dapo_qwen3_4b_fsdp.yaml", [*ASYNC, "cluster.rollout.gpus_per_node=4"],
         "cluster.rollout: 4 engines x 2 GPUs = 8 GPUs, but the rollout group has 1 node x 4 GPUs = 4; "
         "raise cluster.rollout.nodes to 2 or lower rollout.num_engines to 2"),
        ("math_dapo_qwen3_4b_fsdp.yaml", ["rollout.num_engines=8"],
         "cluster.train: 8 engines x 2 GPUs = 16 GPUs, but the train group has 1 node x 8 GPUs = 8 (colocate: "
         "the engines share the trainer ranks' GPUs); raise cluster.train.nodes to 2 or lower rollout.num_engines "
         "to 4"),
        ("math_dapo_qwen3_4b_fsdp.yaml", ["rollout.gpus_per_engine=3", "rollout.num_engines=3"],
         "cluster.train: 3 engines x 3 GPUs = 9 GPUs, but the train group has 1 node x 8 GPUs = 8 (colocate: "
         "the engines share the trainer ranks' GPUs), and a node's 8 GPUs hold 2 engines of 3; raise "
         "cluster.train.nodes to 2 or lower rollout.num_engines to 2"),
        ("math_dapo_qwen3_4b_fsdp.yaml", [*ASYNC, "rollout.gpus_per_engine=16", "rollout.num_engines=1"],
         "rollout.gpus_per_engine: an engine's 16 GPUs (its tensor-parallel ranks) must be on one node, but a "
         "node of the rollout group has 8; lower rollout.gpus_per_engine to 8 or raise "
         "cluster.rollout.gpus_per_node to 16"),
        ("math_dapo_qwen3_4b_fsdp.yaml", [*ASYNC, "cluster.rollout.gpus_per_node=0"],
         "cluster.rollout.gpus_per_node: 4 engines x 2 GPUs = 8 GPUs, but the rollout group has no GPUs; "
         "set cluster.rollout.gpus_per_node"),
        ("math_dapo_qwen3_4b_fsdp.yaml", [*ASYNC, *GENRM, "rollout.num_engines=3"],
         "cluster.rollout: 3 engines x 2 GPUs = 6 GPUs, and 2 judge engines (reward.genrm) x 2 GPUs = 4 GPUs, but "
         "the rollout group has 1 node x 8 GPUs = 8; raise cluster.rollout.nodes to 2 or lower rollout.num_engines "
         "to 2"),
        ("math_dapo_qwen3_4b_fsdp.yaml", GENRM,
         "reward.genrm: judge engines on GPUs need GPUs of their own, and here the engines share the trainer ranks' "
         "GPUs (colocate); give the rollout a node group of its own (cluster.rollout with GPUs, mode hybrid or "
         "fully_async), or serve the judge yourself at $RELAX_GENRM_URL and drop reward.genrm"),
    ],
    ids=["async-over", "colocate-over", "uneven-tp", "tp-over-a-node", "no-gpus", "judges-over", "judges-colocate"],
)
def test_engines_that_do_not_fit_are_refused_with_the_arithmetic(name, overrides, message):
    assert resource_problems(recipe(name, overrides)) == [message]


def test_a_judge_on_sglang_runs_on_sglang_engines_in_the_last_gpu_slots_of_the_engines_group():
    """`reward.genrm` with SGLang engines: the judge model is served by SGLang servers of the engines' size
    (TP 2) on the engines' group's GPUs after the policy engines', with their own command lines."""
    from relax_core.cluster.placement import judge_slots, local_engine_capacity, policy_engine_slots

    r = recipe("math_dapo_qwen3_4b_fsdp.yaml", [*ASYNC, *GENRM])
    assert (judge_slots(r), policy_engine_slots(r), local_engine_capacity(r)) == ([2, 3], 2, 2)
    lines = plan_lines(r, "slurm", python="python3")
    print("\n".join(line for line in lines if "judge" in line or "engine" in line))
    judges = [line.split(maxsplit=2) for line in lines if "(sglang, TP 2, reward.genrm.model)" in line]
    assert [(where, gpus) for where, gpus, _ in judges] == [("rollout[0]", "GPUs"), ("rollout[0]", "GPUs")]
    assert ["GPUs 4-5" in line for line in lines if "judge engine 0 (" in line] == [True]
    assert ["GPUs 6-7" in line for line in lines if "judge engine 1 (" in line] == [True]
    commands = [line for line in lines if line.lstrip().startswith("judge engine")]
    assert len(commands) == 2 and all("relax_core.rollout.sglang_launch --model-path <judge-model-dir>" in line
                                      and "--tp-size 2" in line for line in commands)
    assert "2 engines x 2 GPUs = 4 GPUs, 2 judge engines x 2 GPUs (reward.genrm)" in "\n".join(lines)


def test_colocated_engines_may_use_fewer_gpus_than_the_trainer_ranks():
    assert resource_problems(recipe("math_dapo_qwen3_4b_fsdp.yaml", ["rollout.num_engines=3"])) == []


def test_validate_refuses_engines_that_do_not_fit_naming_the_arithmetic(tmp_path):
    proc = relax("validate", str(FSDP), *ASYNC, "cluster.rollout.gpus_per_node=4", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "cluster.rollout: 4 engines x 2 GPUs = 8 GPUs, but the rollout group has 1 node x 4 GPUs = 4" in proc.stderr
    assert proc.stdout == "" and "plan:" not in proc.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", ["math_dapo_qwen3_4b_fsdp", "math_dapo_qwen3_4b_fsdp_fully_async"])
def test_validate_prints_the_golden_plan_of_the_fsdp_recipe(case):
    proc = relax("validate", str(FSDP), *CASES[case][1], "cluster.executor=slurm")
    assert proc.returncode == 0, proc.stderr
    plan = proc.stderr.replace(f"{sys.executable} -m ", "python3 -m ")
    assert plan.startswith((GOLDEN / f"{case}.plan").read_text())  # then the "ok" line


def test_validate_prints_the_plan_after_the_resolved_recipe():
    proc = relax("validate", str(QUICKSTART), "cluster.executor=local")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["name"] == "quickstart"  # stdout stays the recipe alone
    plan = proc.stderr.splitlines()
    assert plan[0] == "plan: colocate on the local executor (every node group on this machine)"
    assert any(line.split()[:2] == ["train[0]", "CPU"] and line.endswith("trainer rank 0 (torch)") for line in plan)
    command = next(line for line in plan if line.strip().startswith("engine 0: "))
    assert "-m relax_core.rollout.cpu_engine --model-path <run-dir>/model --host <node-ip> --port <port>" in command


def test_dry_run_prints_the_plan_with_the_run_directory(tmp_path):
    proc = relax("submit", str(QUICKSTART), "mode=fully_async", "--executor", "local", "--dry-run", "--run-dir", "r",
                 cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "plan: fully_async on the local executor" in proc.stdout
    assert "rollout service (beside engine 0)" in proc.stdout and "TransferQueue controller" in proc.stdout
    assert f"--model-path {tmp_path / 'r' / 'model'} " in proc.stdout  # the run directory is known here


def test_colocate_on_gpus_without_the_memory_saver_is_refused(tmp_path):
    """SGLang answers a memory release without `--enable-memory-saver` with 200 and frees nothing."""
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "math_dapo_qwen3_4b_fsdp.yaml"
    proc = subprocess.run([sys.executable, "-m", "relax_cli.main", "validate", str(recipe),
                           "rollout.engine_args={mem_fraction_static: 0.6}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "rollout.engine_args.enable_memory_saver" in proc.stderr
