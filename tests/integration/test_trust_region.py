"""The trust region acts: `train.global_batch_size` and `train.ppo_epochs` on a real tiny Qwen3.

What a user relies on: with several optimizer steps per rollout step the
ratio pi/pi_old leaves 1, so every clip parameter of the recipe (PPO's eps,
DAPO's clip-higher, the dual clip, GSPO's eps, SAPO's tau, CISPO's eps, the
critic's value clip) changes the trained weights, and the step reports how
often the clip was active (`clipfrac`) and the ratio's range. With one
optimizer step (the default) the ratio is exactly 1 and the same parameters
change nothing, bit for bit: that is why the recipe needs the two fields.
Every run goes through the recipe (`trainer_config`), so a field that
stopped reaching the trainer fails here. The recipe refuses a batch size
that does not cut the step into whole optimizer steps (exit 2).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from gloo_exit import leave_group

from relax_core.config import RecipeError, load_recipe
from relax_core.config.schema import Recipe
from relax_core.data.sample import Sample
from relax_core.train.batching import shard
from relax_core.train.settings import trainer_config
from relax_core.train.torch_backend import TorchTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[2]
PROMPTS, N = 4, 4  # 16 samples per step
LR = 1e-2  # a few updates spread the ratios over ~[0.3, 3]: across every clip boundary, not all past them


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from relax_core.models.tiny import materialize_tiny_model

    return materialize_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3, alphabet="abcdefgh")


def rollout_step(vocab: int = 19) -> list[Sample]:
    """One step's samples: 4 groups of 4, rewards spread inside each group (no zero-variance group)."""
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(PROMPTS * N):
        p, r = 3 + i % 4, 3 + (i * 5) % 4
        ids = torch.randint(3, vocab, (p + r,), generator=g).tolist()
        reward = [1.0, 0.0, 0.5, 0.2][(i + i // N) % N]
        samples.append(Sample(ids[:p], ids[p:], [-1.0] * r, reward=reward, group_id=i // N, loss_mask=[1] * r))
    return samples


def recipe(algorithm: dict, **train) -> Recipe:
    return Recipe.model_validate({
        "name": "t", "model": {"source": "tiny"}, "data": {"source": "synthetic"},
        "rollout": {"engine": "cpu", "gpus_per_engine": 0, "prompts_per_step": PROMPTS, "n_samples_per_prompt": N},
        "train": {"lr": LR, "micro_batch_size": 2, **train}, "algorithm": algorithm,
    })


def train_once(model_dir: Path, r: Recipe) -> tuple[dict, dict[str, torch.Tensor]]:
    """One rollout step through the recipe's trainer settings: its metrics and the weights it leaves."""
    trainer = TorchTrainer(model_dir, trainer_config(r))
    metrics = trainer.train_step(rollout_step())
    model = trainer.critic.model if trainer.critic is not None else trainer.model
    return metrics, {n: p.detach().clone() for n, p in model.named_parameters()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


SEVERAL = {"global_batch_size": 4, "ppo_epochs": 2}  # 16 / 4 = 4 mini-batches x 2 epochs = 8 optimizer steps
CRITIC = {"lr": 1e-2}
# (algorithm section, the parameter changed, its two values (tighter first), the metric counting active clips)
KNOBS = {
    "ppo_clip eps": ({"name": "grpo"}, ("eps_low", "eps_high"), (1e-3, 0.2), "clipfrac"),
    "dapo clip-higher": ({"name": "dapo"}, ("eps_high",), (0.2, 0.28), "clipfrac"),
    "dual clip c": ({"name": "grpo"}, ("dual_clip_c",), (1.5, None), "clipfrac"),
    "gspo eps": ({"name": "gspo"}, ("eps_low", "eps_high"), (3e-4, 0.2), "clipfrac"),
    "sapo tau": ({"name": "sapo"}, ("tau_pos", "tau_neg"), (1.0, 4.0), None),
    "cispo eps": ({"name": "cispo"}, ("eps_high",), (1e-3, 0.28), "clipfrac"),
    "critic value_clip": ({"name": "ppo"}, ("critic.value_clip",), (1e-3, 0.2), "vf_clipfrac"),
}


def algorithm_with(base: dict, fields: tuple[str, ...], value) -> dict:
    algo = dict(base, critic=dict(CRITIC)) if base["name"] == "ppo" else dict(base)
    for field in fields:
        section, _, name = field.rpartition(".")
        (algo[section] if section else algo)[name] = value
    return algo


def knob_runs(model_dir: Path, knob: str, train: dict) -> tuple[list[dict], float]:
    """Train the knob's two values from the same start; their metrics and the largest weight difference."""
    base, fields, values, _ = KNOBS[knob]
    runs = [train_once(model_dir, recipe(algorithm_with(base, fields, v), **train)) for v in values]
    return [m for m, _ in runs], max_difference(runs[0][1], runs[1][1])


@pytest.mark.parametrize("knob", KNOBS)
def test_each_clip_parameter_changes_the_weights_with_several_optimizer_steps(model_dir, knob):
    (low, high), diff = knob_runs(model_dir, knob, SEVERAL)
    counter = KNOBS[knob][3]
    print(f"\n{knob}: optimizer_steps {low['optimizer_steps']:.0f}, max |dw| {diff:.3e}, "
          f"ratio [{low['ratio_min']:.3f}, {low['ratio_max']:.3f}] mean {low['ratio_mean']:.3f}, "
          + (f"{counter} {low[counter]:.3f} / {high[counter]:.3f}" if counter else "no hard clip"))
    assert low["optimizer_steps"] == high["optimizer_steps"] == 8
    assert diff > 1e-4
    assert low["ratio_min"] < low["ratio_mean"] < low["ratio_max"] and low["ratio_max"] > 1.2
    if counter:  # the first value is the tighter trust region: it clips more of the tokens
        assert 1.0 >= low[counter] > high[counter] > 0.0


@pytest.mark.parametrize("knob", KNOBS)
def test_with_one_optimizer_step_the_clip_parameters_change_nothing(model_dir, knob):
    """The control: the ratio is exactly 1 at the step's only update, so no clip can act.

    (SAPO's gate has slope `tau * 0.25 * 4/tau` at r = 1, exactly 1 for the
    taus used here; a tau like 0.3 moves the last bits, ~3e-6.)
    """
    (low, high), diff = knob_runs(model_dir, knob, {})
    counter = KNOBS[knob][3]
    print(f"\n{knob}: optimizer_steps {low['optimizer_steps']:.0f}, max |dw| {diff}")
    assert low["optimizer_steps"] == 1
    assert diff == 0.0
    assert low["ratio_min"] == low["ratio_max"] == 1.0
    if counter:
        assert low[counter] == high[counter] == 0.0


@pytest.mark.parametrize(("train", "steps"), [({}, 1), ({"ppo_epochs": 3}, 3), ({"global_batch_size": 8}, 2),
                                              ({"global_batch_size": 4, "ppo_epochs": 2}, 8)])
def test_the_recipe_fields_set_the_optimizer_steps(model_dir, train, steps):
    metrics, _ = train_once(model_dir, recipe({"name": "grpo"}, **train))
    assert metrics["optimizer_steps"] == steps
    assert metrics["num_samples"] == PROMPTS * N
    assert metrics["num_tokens"] == sum(s.response_len for s in rollout_step())


@pytest.mark.parametrize(("size", "epochs"), [(4, 1), (8, 2)])
def test_every_update_is_measured_against_the_policy_before_the_first(model_dir, size, epochs):
    """logp_old is computed once, with the step's initial weights: the ratio of optimizer step j is
    pi_{weights before step j} / pi_{initial}, recomputed here from snapshots with a fresh forward."""
    cfg = trainer_config(recipe({"name": "grpo"}, global_batch_size=size, ppo_epochs=epochs))
    trainer, samples = TorchTrainer(model_dir, cfg), rollout_step()
    snapshots = []  # the weights each optimizer step's loss was computed with
    trainer.optimizer.register_step_pre_hook(lambda *_: snapshots.append(copy.deepcopy(trainer.model.state_dict())))
    metrics = trainer.train_step(samples)
    probe = TorchTrainer(model_dir, cfg)
    initial = probe.compute_logprobs(samples)
    ratios = []
    for j, weights in enumerate(snapshots):
        probe.load_state_dict({"model": weights})
        k = j % (len(samples) // size)  # the mini-batch optimizer step j trains on
        part = slice(k * size, (k + 1) * size)
        for now, old in zip(probe.compute_logprobs(samples[part]), initial[part]):
            ratios += torch.tensor(now, dtype=torch.float64).sub(torch.tensor(old, dtype=torch.float64)).exp().tolist()
    print(f"\n{size} per optimizer step x {epochs} epochs: ratio [{min(ratios):.4f}, {max(ratios):.4f}] "
          f"mean {sum(ratios) / len(ratios):.4f}; reported [{metrics['ratio_min']:.4f}, {metrics['ratio_max']:.4f}] "
          f"mean {metrics['ratio_mean']:.4f}, clipfrac {metrics['clipfrac']:.3f}")
    assert len(snapshots) == metrics["optimizer_steps"] == len(samples) // size * epochs
    assert metrics["ratio_min"] == pytest.approx(min(ratios), rel=1e-4)
    assert metrics["ratio_max"] == pytest.approx(max(ratios), rel=1e-4)
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-4)
    assert max(ratios) > 1.2 and metrics["clipfrac"] > 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """One data-parallel rank with its contiguous shard of the step, as `Job.train` cuts it."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        r = recipe({"name": "grpo"}, global_batch_size=8, ppo_epochs=2)
        trainer = TorchTrainer(model_dir, trainer_config(r))
        metrics = trainer.train_step(shard(rollout_step(), rank, world))
        torch.save({"metrics": metrics, "params": dict(trainer.named_parameters_for_sync())}, f"{out_dir}/{rank}.pt")
    finally:
        leave_group()


def test_an_optimizer_step_takes_its_share_of_every_rank(model_dir, tmp_path):
    """2 ranks x 2 mini-batches: optimizer step k sees the k-th quarter of each rank's half (8 samples).

    One process given the samples in that order (mini-batch 1 = rank 0's
    first quarter + rank 1's first quarter, ...) takes the same optimizer
    steps; the ratio's range, all-reduced with min/max, is the same too.
    """
    mp.spawn(_rank, args=(2, _free_port(), str(model_dir), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    s = rollout_step()
    order = s[0:4] + s[8:12] + s[4:8] + s[12:16]
    single = TorchTrainer(model_dir, trainer_config(recipe({"name": "grpo"}, global_batch_size=8, ppo_epochs=2)))
    expected = single.train_step(order)
    for got in ranks:
        for key in ("optimizer_steps", "ratio_min", "ratio_max", "ratio_mean", "clipfrac", "num_tokens"):
            assert got["metrics"][key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    print(f"\n2 ranks: ratio [{expected['ratio_min']:.4f}, {expected['ratio_max']:.4f}], "
          f"clipfrac {expected['clipfrac']:.3f}, optimizer_steps {expected['optimizer_steps']:.0f}")
    params = dict(single.named_parameters_for_sync())
    assert max_difference(ranks[0]["params"], ranks[1]["params"]) == 0.0
    assert max_difference(ranks[0]["params"], params) < 1e-4


def test_a_short_step_keeps_its_optimizer_steps_and_skips_empty_mini_batches(model_dir):
    """DAPO's dynamic sampling may hand the trainer fewer samples than the recipe's: the number of optimizer
    steps stays, each mini-batch gets fewer samples; with fewer samples than mini-batches the empty ones are
    skipped (no optimizer step on zero gradients, whose momentum would still move the weights)."""
    r = recipe({"name": "grpo"}, global_batch_size=4)  # 4 mini-batches
    for count, steps in ((12, 4), (3, 3)):
        trainer = TorchTrainer(model_dir, trainer_config(r))
        assert trainer.train_step(rollout_step()[:count])["optimizer_steps"] == steps


# ----------------------------------------------------------------- recipe checks
def _problem(tmp_path: Path, **train) -> str:
    data = {"name": "t", "model": {"source": "tiny"}, "data": {"source": "synthetic"},
            "rollout": {"engine": "cpu", "gpus_per_engine": 0, "prompts_per_step": 4, "n_samples_per_prompt": 6},
            "train": {"cpu_ranks_per_node": 2, "micro_batch_size": 2, **train}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    return str(info.value)


@pytest.mark.parametrize(("train", "field", "words"), [
    ({"global_batch_size": 16}, "train.global_batch_size", "4 prompts x 6 samples = 24 samples per step is not a "
                                                           "multiple of 16"),
    ({"global_batch_size": 48}, "train.global_batch_size", "not a multiple of 48"),
    ({"global_batch_size": 3}, "train.global_batch_size", "3 samples per optimizer step cannot be split evenly "
                                                          "over 2 data-parallel ranks"),
    ({"global_batch_size": 4, "micro_batch_size": 4}, "train.micro_batch_size", "4 // 2 = 2"),
    ({"ppo_epochs": 0}, "train.ppo_epochs", "greater than or equal to 1"),
])
def test_a_batch_size_that_does_not_cut_the_step_is_refused(tmp_path, train, field, words):
    message = _problem(tmp_path, **train)
    assert field in message and words in message, message


def test_the_command_line_refuses_it_with_exit_2_and_writes_nothing(tmp_path):
    path = tmp_path / "recipe.yaml"
    text = (REPO / "recipes" / "quickstart.yaml").read_text()
    path.write_text(text)
    before = sorted(tmp_path.rglob("*"))
    env = os.environ | {"COLUMNS": "200", "NO_COLOR": "1"}
    proc = subprocess.run([sys.executable, "-m", "relax_cli.main", "validate", str(path), "train.global_batch_size=48"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "train.global_batch_size" in proc.stderr and "= 128 samples per step is not a multiple of 48" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "" and sorted(tmp_path.rglob("*")) == before


@pytest.mark.full(covered_by="tests/integration/test_fsdp.py::test_the_quick_start_trains_sharded_over_two_ranks_and_exports")
def test_a_local_run_takes_the_recipes_optimizer_steps_on_every_rank(tmp_path):
    """The real driver (Ray, 2 gloo trainer ranks, the engine): 128 samples per step in 4 optimizer steps of 32
    (16 per rank), 2 epochs; the metrics file shows 8 optimizer steps per step and a ratio that left 1."""
    proc = subprocess.run(
        [sys.executable, "-m", "relax_cli.main", "submit", str(REPO / "recipes" / "quickstart.yaml"),
         "--executor", "local", "--run-dir", "run", "train.steps=2", "train.cpu_ranks_per_node=2",
         "train.global_batch_size=32", "train.ppo_epochs=2", "train.micro_batch_size=16"],
        cwd=tmp_path, env=os.environ | {"HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    print("\nlocal run:", [{k: round(r[k], 4) for k in ("optimizer_steps", "clipfrac", "ratio_min", "ratio_max")}
                            for r in rows])
    assert [r["optimizer_steps"] for r in rows] == [8, 8]
    assert all(r["ratio_min"] < 1.0 < r["ratio_max"] for r in rows)


def test_the_math_recipe_takes_two_optimizer_steps_of_128_per_step_of_256():
    r = load_recipe(REPO / "recipes" / "math_dapo_qwen3_4b.yaml")
    assert r.samples_per_step == 256 and r.train.global_batch_size == 128
    assert trainer_config(r).num_mini_batches == 2
