"""A stop signal during a long step loses only that step, as a user of a local run sees it.

The driver (`relax submit --executor local`) gets USR1 or TERM in the middle of
a rollout: the engines abort their requests, the checkpoint of the last
completed step is written within seconds (not after the step), the driver
exits with state `preempted`, and submitting the run again regenerates the
dropped step from the right prompt cursor. Generation is made long on purpose:
greedy decoding of a random 4-layer model over 26 letters rarely meets its
end-of-sequence token, so each answer decodes up to `max_new_tokens`, and with
two requests at a time a step's 16 answers take about 4 s here (all 16 at once
took 1.5 s, short enough for the signal to miss the rollout on a slower
machine), while a checkpoint of this model takes well under a second.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_fixtures import ENGINE_API_KEY
from relax_runs import cli_env, wait_for

from relax_core.rewards.hub import RewardHub
from relax_core.rollout.client import EngineClient, GenerationAborted

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
PROMPTS_PER_STEP = 4
LONG_STEPS = ["train.steps=2", "checkpoint.interval=1000", f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
              "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=440", "rollout.temperature=0.0",
              "rollout.max_concurrency=2",
              "model.hidden_size=128", "model.num_layers=4", "model.alphabet=abcdefghijklmnopqrstuvwxyz",
              "logging.backends=[]"]
CHECKPOINT_WITHIN_S = 5.0  # from the signal to the checkpoint of the last completed step on disk
EXIT_WITHIN_S = 120.0  # then everything the run started is stopped (engines, trainers, Ray)


def submit_args(mode: str) -> list[str]:
    # max_staleness 0: step 2's rollout starts once step 1 is trained, so the signal (1 s after step 1 is
    # logged) finds it generating; with 1 it could start during step 1's training and be over by then.
    return [sys.executable, "-m", "relax_cli.main", "submit", str(QUICKSTART), *LONG_STEPS, f"mode={mode}",
            "rollout.max_staleness=0", "--executor", "local", "--run-dir", "run"]


def logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def latest_checkpoint(run: Path) -> int | None:
    marker = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    text = marker.read_text().strip() if marker.exists() else ""
    return int(text) if text.isdigit() else None


def saved_progress(run: Path) -> dict:
    """What the latest checkpoint says about the run's progress (step, prompt cursor)."""
    from relax_core.checkpoint import load_checkpoint

    state: dict = {"progress": {}}
    load_checkpoint(run / "checkpoints", state, restore_rng=False)
    return state["progress"]


def stop_mid_rollout(mode: str, signum: int, cwd: Path) -> tuple[float, int, str]:
    """Run until step 1 is logged, signal the driver half a second later, inside step 2's rollout; returns
    (seconds from the signal to step 1's checkpoint on disk, the driver's exit code, its output)."""
    run, out_path = cwd / "run", cwd / "driver.out"
    with out_path.open("w") as out:
        driver = subprocess.Popen(submit_args(mode), cwd=cwd, env=cli_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        def step_one_logged() -> bool:
            assert driver.poll() is None, f"the driver ended early:\n{out_path.read_text()[-3000:]}"
            return logged_steps(run) == [1]

        wait_for(step_one_logged, 600, "step 1", poll=0.1)
        time.sleep(0.5)
        assert latest_checkpoint(run) is None and logged_steps(run) == [1]  # step 2 is rolling out
        driver.send_signal(signum)
        signalled = time.monotonic()
        wait_for(lambda: latest_checkpoint(run) == 1, 60, "the checkpoint of step 1", poll=0.05)
        took = time.monotonic() - signalled
        driver.wait(timeout=EXIT_WITHIN_S)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    return took, driver.returncode, out_path.read_text()


def test_abort_all_ends_a_rollout_batch_at_once_and_the_batch_is_not_scored(tiny_model_dir, engine):
    """What the stop signal does to the engines (controller/preemption.py), on a real engine server
    (the session's, conftest.py)."""
    from transformers import AutoTokenizer

    from relax_core.rollout.manager import RolloutManager, SamplingConfig

    scored: list[str] = []
    # Greedy answers to these two prompts run the full 480 tokens on the seed-0 tiny model (others end within
    # 200), so the abort lands in the middle of every answer.
    rows = [{"prompt": "ag", "label": "ag"}, {"prompt": "gd", "label": "gd"}]

    async def scenario(url: str) -> float:
        client = EngineClient(url, api_key=ENGINE_API_KEY, timeout=120)
        sampling = SamplingConfig(n_samples_per_prompt=4, max_new_tokens=480, max_prompt_len=64, temperature=0.0)
        manager = RolloutManager([client], AutoTokenizer.from_pretrained(tiny_model_dir), sampling,
                                 RewardHub.from_function(lambda text, *_: scored.append(text) or 1.0))
        batch = asyncio.ensure_future(manager.generate(rows, step=1))
        await until_decoding(client)
        async with EngineClient(url, api_key=ENGINE_API_KEY) as other:  # another client, as the abort thread's
            asked = time.monotonic()
            await other.abort_request(abort_all=True)  # sends rid "", which SGLang's AbortReq requires
        with pytest.raises(GenerationAborted, match=r"[1-4] of 4 responses were aborted"):
            await asyncio.wait_for(batch, 10)
        took = time.monotonic() - asked
        await manager.aclose()
        return took

    took = asyncio.run(scenario(engine.base_url))
    assert took < 1.0  # not the seconds the rest of 480 tokens would take
    assert scored == []  # an aborted batch is neither scored nor trained on


async def until_decoding(client: EngineClient, timeout: float = 20) -> None:
    """Until the engine took 3 decode steps more than when called (its counters count every test's requests)."""
    start = (await client.get_model_info())["engine_stats"]["decode_steps"]
    deadline = time.monotonic() + timeout
    while (await client.get_model_info())["engine_stats"]["decode_steps"] < start + 3:
        assert time.monotonic() < deadline, "generation did not start"
        await asyncio.sleep(0.02)


# The default tier's preemption test is the Slurm one (the same stop mid-rollout, then Slurm's requeue).
@pytest.mark.full(covered_by="tests/integration/test_slurm_launch.py::test_preemption_mid_rollout_checkpoints_at_once_requeues_and_resumes")
@pytest.mark.parametrize(("mode", "signum"), [("colocate", signal.SIGUSR1), ("fully_async", signal.SIGTERM)])
def test_a_stop_signal_mid_rollout_checkpoints_the_last_step_at_once_and_the_run_resumes(tmp_path, mode, signum):
    took, code, output = stop_mid_rollout(mode, signum, tmp_path)
    print(f"{mode}: {signal.Signals(signum).name} -> checkpoint of step 1 written {took:.2f}s later")
    assert took < CHECKPOINT_WITHIN_S
    assert code == 3 and "stopped" in output, output[-3000:]
    run = tmp_path / "run"
    state = json.loads((run / "run.json").read_text())
    assert state["state"] == "preempted" and state["checkpoint_step"] == 1
    assert logged_steps(run) == [1]  # the aborted step's samples were dropped, not trained on
    # The cursor of step 1's end, although step 2's rollout had already taken its prompts.
    assert saved_progress(run) == {"step": 1, "data": {"cursor": PROMPTS_PER_STEP}, "policy_version": 1,
                                   "engines_added": 0}
    assert "aborting the engines' requests" in (run / "logs" / "driver.log").read_text()

    resumed = subprocess.run(submit_args(mode), cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "step 2/2" in resumed.stdout and "step 1/2" not in resumed.stdout  # continued at the dropped step
    assert logged_steps(run) == [1, 2]
    assert saved_progress(run) == {"step": 2, "data": {"cursor": 2 * PROMPTS_PER_STEP}, "policy_version": 2,
                                   "engines_added": 0}
    assert json.loads((run / "run.json").read_text())["state"] == "completed"
