"""The reward hub with real worker processes: time limits, error accounting, plugins, CLI.

Plugins are real files written into temporary folders; the worker pool runs
real processes that are killed when a call hangs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from engine_fixtures import ENGINE_API_KEY

from relax_core.config.data import FileData
from relax_core.config.loader import load_recipe
from relax_core.data.prompts import build_prompt_source
from relax_core.data.sample import Sample
from relax_core.rewards.failures import RewardFailureError
from relax_core.rewards.hub import RewardHub
from relax_core.rewards.registry import RewardPluginError, list_rewards
from relax_core.rollout.client import EngineClient
from relax_core.rollout.manager import RolloutManager, SamplingConfig
from relax_core.rollout.scoring import RewardItem

REPO = Path(__file__).resolve().parents[2]

SLOW_PLUGIN = '''
import asyncio, os, time
from relax_core.rewards.registry import reward

@reward("sometimes_hangs")
def sometimes_hangs(response, label, metadata):
    """Hangs when the metadata says so, else 1.0 (stands in for sympy on a nasty expression)."""
    if metadata.get("hang"):
        time.sleep(3600)
    if metadata.get("boom"):
        raise ZeroDivisionError("bad label")
    return 1.0

@reward("async_judge")
async def async_judge(response, label, metadata):
    """An async reward (like an LLM judge): awaited, with the same time limit."""
    await asyncio.sleep(3600 if metadata.get("hang") else 0.01)
    return {"score": 0.5, "verdict": 1.0}

@reward("worker_pid")
def worker_pid(response, label, metadata):
    return float(os.getpid())
'''


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "my_rewards"
    folder.mkdir()
    (folder / "slow.py").write_text(SLOW_PLUGIN)
    return folder


def test_a_hanging_call_costs_only_its_timeout_and_the_pool_recovers(plugin_dir):
    items = [RewardItem("r", None, {"hang": True})] + [RewardItem("r", None, {}) for _ in range(30)]
    with RewardHub("sometimes_hangs", plugin_dirs=[str(plugin_dir)], timeout_s=2.0, num_workers=3) as hub:
        hub.warm_up()
        start = time.perf_counter()
        results = hub.score_sync(items)
        elapsed = time.perf_counter() - start
        assert results[0].status == "timeout" and results[0].score == 0.0
        assert [r.score for r in results[1:]] == [1.0] * 30
        assert hub.last_stats["reward_timeouts"] == 1 and hub.last_stats["reward_errors"] == 0
        assert elapsed < 2.0 + 3.0  # the limit, plus restarting one worker and 30 quick calls
        # the hung worker was killed and replaced: the next batch runs on 3 live workers again
        again = hub.score_sync([RewardItem("r", None, {}) for _ in range(6)])
        assert [r.score for r in again] == [1.0] * 6
        assert sum(w.alive for w in hub._pool._workers) == 3 + 1  # plus the spare


def test_the_rest_of_a_step_is_not_held_up_by_a_hanging_sample(plugin_dir):
    async def run(hub):
        async def timed(item):
            await hub.score([item])
            return time.perf_counter()
        start = time.perf_counter()
        ends = await asyncio.gather(*(timed(RewardItem("r", None, {"hang": i == 0})) for i in range(8)))
        return [end - start for end in ends]

    with RewardHub("sometimes_hangs", plugin_dirs=[str(plugin_dir)], timeout_s=4.0, num_workers=2) as hub:
        hub.warm_up()
        times = asyncio.run(run(hub))
    assert 4.0 <= times[0] < 7.0
    assert max(times[1:]) < 2.5  # the 7 others finished on the other worker well before the limit


def test_errors_and_timeouts_are_counted_and_logged_once_per_kind(plugin_dir, caplog):
    items = ([RewardItem("r", None, {"boom": True}) for _ in range(3)]
             + [RewardItem("r", None, {"hang": True}, reward="async_judge") for _ in range(2)]
             + [RewardItem("r", None, {}, reward="no_such_reward")]
             + [RewardItem("r", None, {}), RewardItem("r", None, {}, reward="async_judge")])
    with caplog.at_level(logging.WARNING, logger="relax_core.rewards.hub"):
        with RewardHub("sometimes_hangs", plugin_dirs=[str(plugin_dir)], timeout_s=1.0, num_workers=2) as hub:
            results = hub.score_sync(items)
            stats = hub.last_stats
    assert [r.score for r in results] == [0.0] * 6 + [1.0, 0.5]
    assert "ZeroDivisionError: bad label (at slow.py:11 in sometimes_hangs)" == results[0].error
    assert "unknown reward 'no_such_reward'" in results[5].error
    assert stats["reward_errors"] == 4 and stats["reward_timeouts"] == 2
    assert stats["reward_verdict_mean"] == 1.0       # a named sub-score of the dict-valued reward
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3                         # one per (reward, kind), not one per sample
    assert sum("ZeroDivisionError" in w for w in warnings) == 1


def test_per_sample_routing_through_the_rollout_manager():
    hub = RewardHub("copy", timeout_s=10.0, num_workers=1)
    manager = RolloutManager([], None, SamplingConfig(1, 4, 16), hub)
    rows = [("abcd", "abcd", None), ("\\boxed{1/2}", "0.5", "math"),
            ("The answer is (B)", "B", "multiple_choice"), ("abxx", "abcd", None)]
    built = [(Sample([1], [2], [0.0], label=label, metadata={"reward": 0.0}), text, route)
             for text, label, route in rows]
    try:
        asyncio.run(manager._score(built))
    finally:
        hub.close()
    assert [s.reward for s, _, _ in built] == [1.0, 1.0, 1.0, 0.5]
    assert manager.last_reward_stats["reward_errors"] == 0


def test_cheap_rewards_start_no_worker_processes():
    with RewardHub("copy") as hub:
        hub.score_sync([RewardItem("ab", "ab")] * 100)
        assert hub._pool is None


# ----------------------------------------------------------- failure window
def _hub_for(tmp_path: Path, plugin_dir: Path, **reward) -> RewardHub:
    """A hub built from a recipe, as a run builds it (`reward.max_error_frac`, `reward.error_window`)."""
    raw = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    raw["reward"] = {"name": "sometimes_hangs", "plugin_dirs": [str(plugin_dir)], **reward}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    return RewardHub.from_config(load_recipe(tmp_path / "recipe.yaml").reward, num_workers=2)


def test_a_reward_that_keeps_raising_stops_the_run_naming_it_and_its_first_error(tmp_path, plugin_dir):
    boom = [RewardItem("r", None, {"boom": True})]
    with _hub_for(tmp_path, plugin_dir, max_error_frac=0.25, error_window=16) as hub:
        hub.score_sync([RewardItem("r")] * 6 + boom * 2)      # 2 failures of at most 4: the run goes on
        hub.score_sync([RewardItem("r")] * 6 + boom * 2)      # 4 in the last 16: still at the limit
        with pytest.raises(RewardFailureError) as caught:
            hub.score_sync(boom)                              # 5 of the last 16 (the oldest, scored, left)
    message = str(caught.value)
    assert message.startswith("reward 'sometimes_hangs': 5 of the last 16 samples failed")
    assert "first error: ZeroDivisionError: bad label (at slow.py:11 in sometimes_hangs)" in message


def test_below_the_threshold_failures_score_0_and_the_run_goes_on(tmp_path, plugin_dir):
    with _hub_for(tmp_path, plugin_dir) as hub:                # the defaults: 0.5 of 256
        for _ in range(4):
            results = hub.score_sync([RewardItem("r", None, {"boom": True})] * 30 + [RewardItem("r")] * 34)
        assert [r.score for r in results] == [0.0] * 30 + [1.0] * 34
    assert hub.total_errors == 120                             # 120 of 256 <= 128


# ------------------------------------------------------------------- routing
ROUTING_PLUGIN = '''
from relax_core.rewards.registry import reward

@reward("always_one", in_process=True)
def always_one(response, label, metadata):
    return 1.0

@reward("always_half", in_process=True)
def always_half(response, label, metadata):
    return 0.5
'''


@pytest.fixture
def engine_url(engine) -> str:
    """The session's engine server (conftest.py), on `tiny_model_dir`."""
    return engine.base_url


def _scored_rows(tiny_model_dir, engine_url, tmp_path, lines, **data) -> list[tuple[float, dict]]:
    """(reward, metadata) of each sample of one real rollout over a JSONL data set with these lines."""
    from transformers import AutoTokenizer

    (tmp_path / "rewards").mkdir(exist_ok=True)
    (tmp_path / "rewards" / "routing.py").write_text(ROUTING_PLUGIN)
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    rows = build_prompt_source(FileData(path=str(tmp_path / "data.jsonl"), shuffle=False, **data))
    hub = RewardHub("always_one", plugin_dirs=[str(tmp_path / "rewards")], max_error_frac=0.5, error_window=8)
    client = EngineClient(engine_url, api_key=ENGINE_API_KEY, timeout=120)
    manager = RolloutManager([client], AutoTokenizer.from_pretrained(tiny_model_dir), SamplingConfig(2, 3, 64), hub)
    try:
        samples = asyncio.run(manager.generate(rows.next_batch(len(lines)), step=1))
    finally:
        hub.close()
    assert manager.last_reward_stats["reward_errors"] == 0
    return [(sample.reward, sample.metadata) for sample in samples]


def test_a_data_column_called_reward_does_not_route(tiny_model_dir, engine_url, tmp_path):
    lines = [{"prompt": "ab", "label": "ab", "reward": value} for value in (0.0, 1, 0.75, "math")]
    scored = _scored_rows(tiny_model_dir, engine_url, tmp_path, lines)
    assert [reward for reward, _ in scored] == [1.0] * 8          # all by the recipe's reward, 2 per prompt
    assert [meta["reward"] for _, meta in scored] == [0.0, 0.0, 1, 1, 0.75, 0.75, "math", "math"]


def test_the_reward_key_column_routes_rows_to_their_rewards(tiny_model_dir, engine_url, tmp_path):
    tasks = ("always_half", None, "always_half")
    lines = [{"prompt": "ab", "label": "ab", "reward": 9, "task": task} for task in tasks]
    scored = _scored_rows(tiny_model_dir, engine_url, tmp_path, lines, reward_key="task")
    assert [reward for reward, _ in scored] == [0.5, 0.5, 1.0, 1.0, 0.5, 0.5]


# ------------------------------------------------------------------- plugins
def _recipe_with_plugin(tmp_path: Path, plugin_dir: Path, name: str) -> Path:
    raw = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    raw["reward"] = {"name": name, "plugin_dirs": [str(plugin_dir)], "timeout_s": 2.0}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_plugin_dropped_into_a_recipe_folder_is_used_with_no_other_change(tmp_path):
    folder = tmp_path / "team_rewards"
    folder.mkdir()
    (folder / "shout.py").write_text(textwrap.dedent('''
        from relax_core.rewards.registry import reward

        @reward("shouting")
        def shouting(response, label, metadata):
            """Fraction of upper-case letters."""
            letters = [c for c in response if c.isalpha()]
            return sum(c.isupper() for c in letters) / max(1, len(letters))
    '''))
    recipe = load_recipe(_recipe_with_plugin(tmp_path, folder, "shouting"))
    assert "shouting" in list_rewards(recipe.reward.plugin_dirs)
    with RewardHub.from_config(recipe.reward, num_workers=1) as hub:
        results = hub.score_sync([RewardItem("HELLO"), RewardItem("HeLLo"), RewardItem("hello")])
    assert [r.score for r in results] == [1.0, 0.6, 0.0]


def test_a_broken_plugin_stops_the_start_and_names_its_file(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "typo.py").write_text("from relax_core.rewards.registry import reward\n\nimport not_a_module\n")
    recipe = load_recipe(_recipe_with_plugin(tmp_path, folder, "anything"))
    with pytest.raises(RewardPluginError, match=r"typo\.py:3 failed to import: ModuleNotFoundError"):
        RewardHub.from_config(recipe.reward)


def test_a_missing_plugin_folder_is_a_user_error(tmp_path):
    with pytest.raises(RewardPluginError, match="is not a folder"):
        RewardHub("copy", plugin_dirs=[str(tmp_path / "nope")])


# ----------------------------------------------------------------------- CLI
RELAX = ("import sys\nfrom relax_cli import main, reward\n"
         "if 'reward' not in [g.name for g in main.app.registered_groups]:\n"
         "    main.app.add_typer(reward.app, name='reward')\n"
         "sys.exit(main.main())\n")


def relax(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RELAX, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_cli_scores_one_response():
    done = relax("reward", "score", "math", "--response", "so x = \\boxed{\\frac{3}{4}}", "--label", "0.75")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"score": 1.0, "reward": "math"}


def test_cli_scores_a_jsonl_file_with_a_plugin_and_reports_failures(tmp_path, plugin_dir):
    lines = [{"response": "a", "label": None, "metadata": {}},
             {"response": "b", "label": None, "metadata": {"boom": True}},
             {"response": "c", "label": None, "metadata": {"hang": True}},
             {"response": "The answer is (A)", "label": "A", "metadata": {}, "reward": "multiple_choice"}]
    path = tmp_path / "outputs.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    done = relax("reward", "score", "sometimes_hangs", "--jsonl", str(path), "--plugin-dir", str(plugin_dir),
                 "--timeout", "1")
    assert done.returncode == 0, done.stderr
    out = [json.loads(line) for line in done.stdout.splitlines()]
    assert [o["score"] for o in out] == [1.0, 0.0, 0.0, 1.0]
    assert "error" not in out[0] and "ZeroDivisionError" in out[1]["error"]
    assert out[2]["status"] == "timeout"


def test_cli_reports_a_broken_plugin_with_exit_code_2(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "bad.py").write_text("def oops(:\n")
    done = relax("reward", "score", "math", "--response", "x", "--label", "1", "--plugin-dir", str(folder))
    assert done.returncode == 2
    assert "bad.py:1 failed to import: SyntaxError" in done.stderr


def test_cli_unknown_reward_lists_the_available_ones():
    done = relax("reward", "score", "maths", "--response", "x", "--label", "1")
    assert done.returncode == 2 and "no reward called 'maths'" in done.stderr and "math" in done.stderr
