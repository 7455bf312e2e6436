"""The judge engines of `reward.genrm`, started by Relax on real Ray, asked by the reward hub over HTTP.

The judge model is `echo_judge_model`: it repeats the last character of its
prompt once per new token, so a template ending in `{response}` or `{label}`
gets that value's last digit back, and each field's effect shows in the score:

- `num_engines`: that many judge servers on `relax_judge` slots, each getting every other call
  (with one of two stopped, exactly half the calls fail to connect); stopping the service ends
  every server process and frees its slots;
- `template`, `max_new_tokens`, `max_score`: the prompt, the reply length and the scale the hub's
  `genrm` uses (reply "3" -> 0.3, "33" at max_score 1000 -> 0.033, ...);
- the judge answers only with the run's bearer key;
- `trust_remote_code`: a judge model that ships its own code starts with it;
- a failed set-up of a job (the trainer cannot load its teacher) stops the judge engines too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml
from model_dirs import custom_code_model, echo_judge_model

from relax_core.cluster.placement import JUDGE_RESOURCE
from relax_core.config import load_recipe
from relax_core.rewards.genrm import JudgeEndpoints
from relax_core.rewards.hub import RewardHub
from relax_core.rewards.judge_service import JudgeService
from relax_core.rollout.scoring import RewardItem
from relax_core.rundir import new_run_dir

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
GONE_WITHIN_S = 10


@pytest.fixture(scope="module")
def echo_judge(tmp_path_factory) -> Path:
    return echo_judge_model(tmp_path_factory.mktemp("echo_judge"))


def judge_recipe(tmp_path: Path, overrides: tuple[str, ...] = (), **genrm):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(QUICKSTART | {"reward": {"name": "genrm", "timeout_s": 60, "genrm": genrm}}))
    return load_recipe(path, overrides)


def start(local_ray, tmp_path: Path, **genrm) -> tuple[JudgeService, object]:
    import ray

    run = new_run_dir(tmp_path, "run").create()
    return JudgeService.start(ray, judge_recipe(tmp_path, **genrm), run, threads=1), run


@pytest.fixture(scope="module")
def one_judge(local_ray, echo_judge, tmp_path_factory):
    service, _ = start(local_ray, tmp_path_factory.mktemp("one"), model=str(echo_judge))
    try:
        yield service.endpoints()
    finally:
        service.stop()


def scores(tmp_path: Path, endpoints: JudgeEndpoints, items: list[RewardItem], **genrm) -> list:
    config = judge_recipe(tmp_path, model="unused", **genrm).reward
    with RewardHub.from_config(config, judge=endpoints) as hub:
        return [r.score if r.status == "ok" else r.error for r in hub.score_sync(items)]


ITEM = RewardItem("ab3", "6")


def test_the_template_is_the_judges_prompt(one_judge, tmp_path):
    assert scores(tmp_path, one_judge, [ITEM], template="grade {response}", max_new_tokens=1) == [0.3]
    assert scores(tmp_path, one_judge, [ITEM], template="{response} vs {label}", max_new_tokens=1) == [0.6]
    # the default ends in "Score:": the echo judge answers ":", which holds no score
    [error] = scores(tmp_path, one_judge, [ITEM], max_new_tokens=1)
    assert error.startswith("ValueError: judge reply has no score: ':'")


def test_max_new_tokens_is_the_replys_length(one_judge, tmp_path):
    for tokens, expected in ((1, 0.003), (2, 0.033), (3, 0.333)):  # "3", "33", "333" out of 1000
        got = scores(tmp_path, one_judge, [ITEM], template="{response}", max_new_tokens=tokens, max_score=1000)
        assert got == [pytest.approx(expected)]


def test_max_score_is_the_judges_scale(one_judge, tmp_path):
    for scale, expected in ((10, 0.6), (12, 0.5), (5, 1.0)):
        got = scores(tmp_path, one_judge, [ITEM], template="{response} {label}", max_new_tokens=1,
                     max_score=scale)
        assert got == [pytest.approx(expected)]


def test_the_judge_answers_only_with_the_runs_key(one_judge, tmp_path):
    stranger = JudgeEndpoints(one_judge.urls, api_key=None)
    [error] = scores(tmp_path, stranger, [ITEM], template="{response}")
    assert "401" in error
    assert one_judge.api_key and len(one_judge.api_key) >= 32


@pytest.mark.full(covered_by="tests/integration/test_genrm_run.py::"
                              "test_a_run_judged_by_the_judge_relax_starts_and_stops[colocate]")
def test_two_judge_engines_share_the_calls_and_stop_with_the_service(local_ray, one_judge, tmp_path):
    import ray

    echo_judge = echo_judge_model(tmp_path / "judge")  # a folder of its own: its servers are only these
    before = _free_judge_slots_settled()
    service, run = start(local_ray, tmp_path, model=str(echo_judge), num_engines=2)
    try:
        endpoints = service.endpoints()
        assert len(set(endpoints.urls)) == 2
        assert ray.available_resources().get(JUDGE_RESOURCE, 0) == before - 2
        assert sorted(p.name for p in run.logs.glob("judge-*.log")) == ["judge-0.log", "judge-1.log"]
        servers = _judge_servers(echo_judge)
        assert len(servers) == 2
        items = [RewardItem(f"x{i}", None) for i in range(8)]
        assert scores(tmp_path, endpoints, items, template="{response}", max_new_tokens=1) == \
            [i / 10 for i in range(8)]
        ray.get(service.actors[1].stop.remote())  # its server ends: its share of the calls now fails
        results = scores(tmp_path, endpoints, items, template="{response}", max_new_tokens=1)
        assert [r for r in results if isinstance(r, float)] == [i / 10 for i in range(8) if i % 2 == 0]
        assert sum("EngineUnreachable" in str(r) for r in results) == 4  # the engine client names the refusal
    finally:
        service.stop()
    assert not _eventually(lambda: _judge_servers(echo_judge)), "judge engine servers outlived stop()"
    # Ray gives a killed actor's slots back asynchronously: under load (CI) that took over 10 s once
    assert not _eventually(lambda: ray.available_resources().get(JUDGE_RESOURCE, 0) != before, timeout=60)


def test_a_judge_that_ships_its_own_code_starts_when_trusted(local_ray, tmp_path):
    service, _ = start(local_ray, tmp_path, model=str(custom_code_model(tmp_path / "custom")),
                       trust_remote_code=True)
    try:
        [url] = service.endpoints().urls
        assert url.startswith("http://127.0.0.1:")
    finally:
        service.stop()


def test_untrusted_code_stops_the_judge_engine_with_the_reason(local_ray, tmp_path):
    service, _ = start(local_ray, tmp_path, model=str(custom_code_model(tmp_path / "custom")))
    try:
        with pytest.raises(Exception, match="trust_remote_code"):
            service.endpoints()
    finally:
        service.stop()


@pytest.mark.full(covered_by="tests/integration/test_processes.py::test_a_failed_set_up_stops_what_it_started")
def test_a_failed_set_up_stops_the_judge_engines(local_ray, one_judge, tmp_path, one_torch_thread):
    import ray
    from test_processes import damaged_model

    from relax_core.controller.job import Job

    echo_judge = echo_judge_model(tmp_path / "judge")
    before = _free_judge_slots_settled()
    teacher = damaged_model(tmp_path / "teacher")  # only the trainer reads its weights: it fails after the judges start
    recipe = judge_recipe(tmp_path, ("algorithm.name=opd", f"algorithm.teacher.path={teacher}"),
                          model=str(echo_judge), num_engines=2)
    run = new_run_dir(tmp_path, "job").create()
    with pytest.raises(Exception, match="SafetensorError"):
        Job(recipe, run)
    assert (run.logs / "judge-1.log").exists()  # the judges had been started
    assert not _eventually(lambda: _judge_servers(echo_judge)), "judge engine servers outlived the failed set-up"
    # Ray gives a killed actor's slots back asynchronously: under load (CI) that took over 10 s once
    assert not _eventually(lambda: ray.available_resources().get(JUDGE_RESOURCE, 0) != before, timeout=60)


def _free_judge_slots_settled() -> float:
    """The free judge slots once every judge but the module's `one_judge` has given its slot back.

    The test asking for it holds `one_judge`, so exactly one slot is busy; earlier tests' judges
    may still be handing theirs back (Ray frees a killed actor's resources asynchronously).
    """
    import ray

    expected = ray.cluster_resources()[JUDGE_RESOURCE] - 1
    assert not _eventually(lambda: ray.available_resources().get(JUDGE_RESOURCE, 0) != expected, timeout=60), \
        "a judge slot of an earlier test was never given back"
    return expected


def _judge_servers(model: Path) -> set[int]:
    """Engine server processes serving `model` (their command line names it)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "relax_core.rollout.cpu_engine" in command and str(model) in command:
            found.add(int(pid))
    return found


def _eventually(problem, timeout: float = GONE_WITHIN_S):
    deadline = time.monotonic() + timeout
    while (found := problem()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found
