"""`fully_async` and `hybrid` on this machine: real Ray, real TransferQueue, real engines and gloo sync.

Each test runs a short job in this process and watches every step twice:
what the rollout service says it produced (its step record: sample ids) and
what the trainer ranks say they trained on (ids and policy versions, as each
rank read them from TransferQueue). From those two records alone the test
checks the promises of the asynchronous modes:

- no consumed sample is older than `rollout.max_staleness` versions, judged
  on each sample's own recorded policy version;
- `max_staleness: 0` trains on exactly the versions colocate would (step s
  on version s - 1);
- every generated sample is trained on exactly once, none lost or
  duplicated, also when an engine is added and later removed mid-run;
- the driver never reads a sample's tensors: they go from the rollout
  service through TransferQueue to the trainer ranks and the services.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from relax_core.config.loader import load_recipe
from relax_core.rundir import new_run_dir

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
SMALL = ["rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "logging.backends=[]",
         "checkpoint.interval=100"]


class Watched:
    """A Job whose produced and trained samples are recorded, step by step."""

    def __init__(self, tmp_path: Path, monkeypatch, *overrides: str, run=None):
        """`run`: the run directory of an earlier job, to resume it (else a fresh one under `tmp_path`)."""
        from relax_core.cluster.placement import local_cpu_sets
        from relax_core.controller import streaming
        from relax_core.controller.job import Job

        self.recipe = load_recipe(QUICKSTART, [*SMALL, *overrides])
        self.run = run or new_run_dir(tmp_path, "run").create()
        self.job = Job(self.recipe, self.run, cpu_sets=local_cpu_sets(self.recipe))
        self.generated: list[int] = []
        # (step, sample ids, each sample's version counts: how many of its tokens each policy version made)
        self.trained: list[tuple[int, list[int], list[dict[int, int]]]] = []
        self.on_train = lambda step: None
        check = streaming.check_trained

        def watched_check(step, record, ids, versions, max_staleness):
            self.generated += record.sample_ids
            self.trained.append((step, list(ids), list(versions)))
            self.on_train(step)
            return check(step, record, ids, versions, max_staleness)

        monkeypatch.setattr(streaming, "check_trained", watched_check)

    def run_loop(self) -> str:
        import importlib

        from relax_core.config.modes import mode_spec

        module, _, name = mode_spec(self.recipe.mode).loop.partition(":")
        try:
            return getattr(importlib.import_module(module), name)(self.job)
        finally:
            self.job.close()

    def staleness(self) -> list[int]:
        """Each trained sample's staleness, by its oldest token."""
        return [step - 1 - min(counts) for step, _, versions in self.trained for counts in versions]

    def token_staleness(self) -> list[int]:
        """The staleness of every version that made some token of a trained sample."""
        return [step - 1 - v for step, _, versions in self.trained for counts in versions for v in counts]

    def consumed_ids(self) -> list[int]:
        return [i for _, ids, _ in self.trained for i in ids]


STALENESS_FULL = pytest.mark.full(covered_by="tests/integration/test_async_modes.py::"
                                  "test_no_consumed_sample_is_older_than_max_staleness_and_logp_old_is_the_steps_start[fully_async-2]")


@pytest.mark.parametrize(("mode", "bound"), [
    pytest.param("fully_async", 1, marks=STALENESS_FULL), ("fully_async", 2),
    pytest.param("hybrid", 1, marks=STALENESS_FULL), pytest.param("hybrid", 2, marks=STALENESS_FULL),
])
def test_no_consumed_sample_is_older_than_max_staleness_and_logp_old_is_the_steps_start(
        local_ray, tmp_path, monkeypatch, mode, bound, one_torch_thread):
    """Two updates per step (global batch 8 of 16): the ratio's anchor, logp_old, is computed with the weights
    each step starts from, whatever the rows' age (the per-token hand computation: test_logp_old_anchor.py)."""
    watched = Watched(tmp_path, monkeypatch, f"mode={mode}", f"rollout.max_staleness={bound}", "train.steps=10",
                      "train.global_batch_size=8", "train.micro_batch_size=8")
    assert watched.run_loop() == "completed"
    staleness = watched.staleness()
    assert len(staleness) == 10 * 16
    assert min(staleness) >= 0 and max(staleness) <= bound
    assert max(staleness) > 0  # rollout did run ahead: the bound was exercised, not trivially met
    assert min(watched.token_staleness()) >= 0 and max(watched.token_staleness()) <= bound
    assert sorted(watched.consumed_ids()) == sorted(watched.generated)
    rows = watched.run.read_metrics()
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(r["staleness_max"] <= bound and r["queue_depth"] >= 0 for r in rows)
    assert all(r["token_staleness_max"] <= bound and 0 <= r["multi_version_frac"] <= 1 for r in rows)
    assert [r["logp_old_version"] for r in rows] == list(range(10))
    assert all(r["optimizer_steps"] == 2 for r in rows)
    assert any(r["tis_weight"] != 1.0 for r in rows)  # the importance weight compared it with older policies


@pytest.mark.full(covered_by="tests/integration/test_async_modes.py::test_no_consumed_sample_is_older_than_max_staleness_and_logp_old_is_the_steps_start[fully_async-2]")
def test_max_staleness_zero_is_on_policy(local_ray, tmp_path, monkeypatch, one_torch_thread):
    watched = Watched(tmp_path, monkeypatch, "mode=fully_async", "rollout.max_staleness=0", "train.steps=6")
    assert watched.run_loop() == "completed"
    assert [step for step, _, _ in watched.trained] == list(range(1, 7))
    for step, _, versions in watched.trained:
        assert {v for counts in versions for v in counts} == {step - 1}, step


BOUNDED_QUEUE = ("tests/integration/test_async_modes.py::"
                 "test_max_queue_mb_keeps_the_rollout_from_queueing_more_than_its_bytes[0.0001]")


@pytest.mark.parametrize("budget", [pytest.param(None, marks=pytest.mark.full(covered_by=BOUNDED_QUEUE)), 0.0001])
def test_max_queue_mb_keeps_the_rollout_from_queueing_more_than_its_bytes(local_ray, tmp_path, monkeypatch, budget,
                                                                          one_torch_thread):
    """`rollout.max_queue_mb`: a step's rows (16 samples of 2 + 2 tokens) hold about 500 bytes of token
    columns, so a 105-byte budget lets TransferQueue hold one untrained step at a time (an empty queue takes a
    step larger than the budget), where `max_staleness` 3 alone lets the rollout run up to three steps ahead."""
    overrides = ("mode=fully_async", "rollout.max_staleness=3", "train.steps=8")
    limit = () if budget is None else (f"rollout.max_queue_mb={budget}",)
    watched = Watched(tmp_path, monkeypatch, *overrides, *limit)
    assert watched.run_loop() == "completed"
    assert Counter(watched.consumed_ids()) == Counter(watched.generated)
    rows = watched.run.read_metrics()
    depth = max(r["queue_depth"] for r in rows)  # rows put but not yet trained, as each step's records are written
    print(f"max_queue_mb={budget}: queue depth up to {depth:.0f} rows")
    if budget is None:
        assert depth > 16  # the rollout ran more than a step ahead
    else:
        assert depth <= 16  # the next step's rows at most
        assert sum(r["rollout_idle_s"] for r in rows[1:]) > 0  # the rollout waited for the queue to drain


def test_updates_land_mid_response_each_token_keeps_its_version_and_the_copy_task_still_learns(
        local_ray, tmp_path, monkeypatch, one_torch_thread):
    """The quick start with 6-character answers: the weight thread sends each version as soon as it is
    trained, while the engine generates, so updates land in the middle of some responses (the engine is
    paused with SGLang's retract and continues them under the new weights). The trainer ranks report, per
    sample, how many tokens each policy version made, as they read them from TransferQueue."""
    watched = Watched(tmp_path, monkeypatch, "mode=fully_async", "rollout.max_staleness=2", "train.steps=100",
                      "rollout.prompts_per_step=16", "rollout.n_samples_per_prompt=8", "data.min_len=6",
                      "data.max_len=6", "rollout.max_new_tokens=6")
    assert watched.run_loop() == "completed"
    assert Counter(watched.consumed_ids()) == Counter(watched.generated)  # every sample trained exactly once
    assert len(watched.generated) == 100 * 16 * 8
    samples = [counts for _, _, versions in watched.trained for counts in versions]
    assert all(1 <= sum(counts.values()) <= 6 for counts in samples)  # a version per token (EOS may end one early)
    mixed = [counts for counts in samples if len(counts) >= 2]
    assert mixed  # updates did land mid-response (measured: 140 to 4392 of the 12,800 samples, by the load)
    # Not always consecutive: two syncs may land while a retracted request waits for its turn (one CI run saw
    # it); the newest is at most max_staleness after the oldest, which is at most that before the step.
    assert all(max(counts) - min(counts) <= 2 for counts in mixed)
    staleness = watched.token_staleness()
    assert min(staleness) >= 0 and max(staleness) <= 2
    rows = watched.run.read_metrics()
    assert sum(r["multi_version_frac"] * r["samples"] for r in rows) == pytest.approx(len(mixed))
    first, last = (sum(r["reward_mean"] for r in part) / 10 for part in (rows[:10], rows[-10:]))
    print(f"mixed-version samples {len(mixed)} of {len(samples)}; reward first 10 {first:.3f}, last 10 {last:.3f}")
    assert last - first >= 0.5  # measured: about 0.06 -> 0.95


# fully_async from `relax submit` in the default tier: the Slurm scale-out run (test_slurm_launch.py)
SLURM_FULLY_ASYNC = ("tests/integration/test_slurm_launch.py::"
                     "test_scale_rollout_grows_the_job_onto_a_second_slurm_job_and_back")


@pytest.mark.parametrize("mode", [pytest.param("fully_async", marks=pytest.mark.full(covered_by=SLURM_FULLY_ASYNC)),
                                  "hybrid"])
def test_quickstart_reaches_its_goal_in_each_async_mode(tmp_path, mode):
    """`relax submit recipes/quickstart.yaml mode=...`, as a user types it but shorter (colocate, all 150 steps:
    test_local_run.py)."""
    import json

    from test_local_run import relax

    # 80 of the recipe's 150 steps: the 5-step mean reward passes 0.6 by step 40 and is about 0.96 at step 80
    proc = relax("submit", str(QUICKSTART), f"mode={mode}", "train.steps=80", "--executor", "local",
                 "--run-dir", "qs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "qs" / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-5:]) / 5
    print(f"{mode}: reward_mean first 5 {first:.3f}, last 5 {last:.3f}")
    assert last - first >= 0.6  # the quick start's goal (test_local_run.py)
    assert all(r["staleness_max"] <= 1 for r in rows)  # the recipe's rollout.max_staleness default
    assert {r["prompt_len_mean"] for r in rows} == {2.0}  # the rollout service read data.apply_chat_template
    assert all(k in rows[-1] for k in ("queue_depth", "trainer_idle_s", "rollout_idle_s", "samples_per_s"))


@pytest.mark.full(covered_by="tests/integration/test_async_modes.py::test_no_consumed_sample_is_older_than_max_staleness_and_logp_old_is_the_steps_start[fully_async-2]")
def test_two_ranks_and_two_engines_read_their_rows_from_transferqueue_not_from_the_driver(
        local_ray, tmp_path, monkeypatch, one_torch_thread):
    """fully_async with the reference service on (a KL loss, a reference node group): 2 trainer ranks,
    2 engines, 10 steps, nothing
    killed. The driver (this process) may not read a single row: its TransferQueue client refuses to."""
    from transfer_queue.client import AsyncTransferQueueClient, TransferQueueClient

    read_here = []

    def refuse(self, *args, **kwargs):
        read_here.append(args)
        raise AssertionError("the driver read rows from TransferQueue")

    monkeypatch.setattr(TransferQueueClient, "get_data", refuse)
    monkeypatch.setattr(AsyncTransferQueueClient, "async_get_data", refuse)
    watched = Watched(tmp_path, monkeypatch, "mode=fully_async", "train.cpu_ranks_per_node=2",
                      "rollout.num_engines=2", "rollout.max_staleness=1", "algorithm.kl.coef=0.05",
                      "cluster.reference.nodes=1", "train.steps=10")
    names = [d.name for d in watched.job.services.downstream]
    assert names == ["reference", "advantages"]
    assert watched.job.services.fields == ("ref_logprobs", "advantages")
    assert watched.run_loop() == "completed"
    assert read_here == []
    ids = watched.consumed_ids()
    assert len(ids) == len(set(ids)) == 10 * 16 and Counter(ids) == Counter(watched.generated)
    staleness = watched.staleness()
    assert 0 <= min(staleness) and max(staleness) <= 1
    rows = watched.run.read_metrics()
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(r["kl_loss"] > 0 for r in rows[1:])  # the KL term saw the service's reference log-probs
    assert all(r["num_samples"] == 16 for r in rows)  # both ranks' shards: the step's advantages over all


PPO = ("algorithm.name=ppo", "algorithm.critic.lr=0.01", "algorithm.critic.warmup_steps=1",
       "algorithm.critic.value_clip=0.02",
       "rollout.max_staleness=0", "train.global_batch_size=8", "train.micro_batch_size=4", "train.lr=0.05")
POLICY_KEYS = ("pg_loss", "ratio_min", "ratio_max", "clipfrac", "grad_norm", "reward_mean", "optimizer_steps")
CRITIC_KEYS = ("value_loss", "vf_clipfrac")


def assert_same_steps(rows: list[dict], expected: list[dict], rel: float) -> None:
    """Every step's policy and critic metrics agree (those one of them has: no ratio without a policy update)."""
    for row, other in zip(rows, expected, strict=True):
        for key in (*POLICY_KEYS, *CRITIC_KEYS):
            assert (key in row) == (key in other), (row["step"], key)
            if key in other:
                assert row[key] == pytest.approx(other[key], rel=rel, abs=1e-7), (row["step"], key)


@pytest.mark.full(covered_by="tests/integration/test_async_modes.py::test_no_consumed_sample_is_older_than_max_staleness_and_logp_old_is_the_steps_start[fully_async-2]")
def test_fully_async_ppo_trains_as_hybrid_does_and_resumes(local_ray, tmp_path, monkeypatch, one_torch_thread):
    """PPO, two ranks, two optimizer steps per step (global batch 8 of 16 samples), one critic warmup step.

    In both modes the trainer ranks compute logp_old with the weights the step starts from (each step logs
    `logp_old_version` = step - 1) and hold the critic, whose values feed GAE and which takes one optimizer
    step per mini-batch. At max_staleness 0 both modes train on the same rows, so every step's numbers
    agree; the second update's ratio leaves 1, so logp_old of any other weights would show. The fully_async
    run is stopped after the checkpoint of step 2 and resumed: the critic comes back from the checkpoint
    with the policy, and step 3 still agrees."""
    common = ("train.cpu_ranks_per_node=2", "train.steps=3", "checkpoint.interval=2", *PPO)
    hybrid = Watched(tmp_path / "hybrid", monkeypatch, "mode=hybrid", *common)
    assert hybrid.job.services.downstream == []
    assert hybrid.run_loop() == "completed"
    hybrid.on_train = lambda step: None  # the next Watched calls this one's check too

    stopped = Watched(tmp_path / "fully_async", monkeypatch, "mode=fully_async", *common)
    assert stopped.job.services.downstream == [] and stopped.job.services.fields == ()  # gae: the trainer's
    stopped.on_train = lambda step: stopped.job.stop.set() if step == 2 else None
    assert stopped.run_loop() == "stopped"
    stopped.on_train = lambda step: None
    resumed = Watched(tmp_path / "fully_async", monkeypatch, "mode=fully_async", *common, run=stopped.run)
    assert resumed.run_loop() == "completed"
    assert [step for step, _, _ in resumed.trained] == [3]
    rows, expected = resumed.run.read_metrics(), hybrid.run.read_metrics()
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["logp_old_version"] for r in rows] == [r["logp_old_version"] for r in expected] == [0, 1, 2]
    assert_same_steps(rows, expected, rel=1e-5)
    assert [r["optimizer_steps"] for r in expected] == [0, 2, 2]  # warmup: step 1 trains the critic only
    assert expected[1]["value_loss"] != expected[2]["value_loss"] and expected[1]["vf_clipfrac"] > 0
    assert max(abs(r["ratio_max"] - 1) for r in expected[1:]) > 1e-3  # the second update moved the ratio


@pytest.mark.full(covered_by=SLURM_FULLY_ASYNC)  # the Slurm scale-out joins engines at the rollout's safe points
def test_an_engine_change_waits_when_the_rollout_is_not_held_in_time(local_ray, tmp_path, monkeypatch,
                                                                     one_torch_thread):
    """A scale-out is ready to join, but the rollout service's production thread is not at a safe point
    within the pause's time (here: not generating yet): the engines stay as they are, the scale-out stays
    requested, and the rollout is let go (it generates step 1 with nobody resuming it). At the next safe
    point the engine joins."""
    import time

    from relax_core.controller.streaming import apply_engine_changes

    watched = Watched(tmp_path, monkeypatch, "mode=fully_async", "rollout.max_staleness=1", "train.steps=3")
    job = watched.job
    try:
        code, op = job.elastic.request(delta=1)
        assert code == 202
        deadline = time.monotonic() + 180
        while not job.elastic.needs_safe_point and time.monotonic() < deadline:
            time.sleep(0.2)
        assert job.elastic.op(op["id"]).state == "healthy"

        assert apply_engine_changes(job, pause_timeout_s=1.0) == {"engines": 1.0}
        assert job.elastic.op(op["id"]).state == "healthy" and job.elastic.needs_safe_point
        assert len(job.engines.urls) == 1

        rollout, ray = job.services.rollout, job._ray
        ray.get(rollout.start.remote(1, 3, job.engines.endpoints(), job.prompts.state_dict(), 0,
                                     job.services.downstream, job.judge))
        assert ray.get(rollout.record.remote(1, 120)) is not None  # not held: the failed pause resumed it
        # step 3 waits for version 1 (max_staleness 1) at its safe point: the pause holds it there
        stats = apply_engine_changes(job)
        assert stats["engines"] == 2.0 and stats["engines_added"] == 1.0
        assert job.elastic.op(op["id"]).state == "active" and not job.elastic.needs_safe_point
    finally:
        job.close()
