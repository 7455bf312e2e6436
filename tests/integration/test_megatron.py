"""The Megatron backend on CPU over gloo, as its users rely on it.

- a tiny Qwen3 loaded from HF into megatron-core gives the HF model's logits with TP=2 and PP=2, a tiny
  Qwen3-MoE with EP=2 (and TP=2 x EP=2), and the weights gathered back are the HF file's, bit for bit;
- one training step on the same batch gives the torch backend's loss and updated HF tensors, whatever
  the layout (TP=1, TP=2, PP=2, EP=2, the distributed optimizer, activation recomputation);
- a Megatron checkpoint saved with one layout resumes with another (TP=2 -> DP=2 with the distributed
  optimizer) and continues as the uninterrupted trainer does;
- the weights broadcast from a TP=2 trainer make the CPU engine's log-probs the trainer's;
- `relax submit recipes/quickstart.yaml train.backend=megatron` (TP=2) learns, its checkpoint loads with
  `dist_checkpointing.load`, converts (`--verify`), and a resumed run is bit-identical.

The ranks run in `megatron_ranks.py` (subprocesses: one process per rank).
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from engine_fixtures import EngineServer, free_port, subprocess_env
from megatron_ranks import ranks, run_ranks
from model_dirs import tiny_qwen3_moe
from relax_runs import relax as relax_cli

from relax_core.models import tiny

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ALPHABET = "abcdefghijklmnop"  # 16 characters + 3 special tokens: the samples' ids 3..18 are all real


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return tiny.materialize_tiny_model(tmp_path_factory.mktemp("dense") / "m", alphabet=ALPHABET)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return tiny_qwen3_moe(tmp_path_factory.mktemp("moe") / "m")


# ----------------------------------------------------------------- HF -> Megatron
LOGITS_FULL = pytest.mark.full(
    covered_by="tests/integration/test_megatron.py::test_megatron_gives_the_hf_models_logits_and_weights[tp2]")


@pytest.mark.parametrize(("kind", "layout", "world"), [
    ("dense", {"tp": 2}, 2),
    pytest.param("dense", {"pp": 2}, 2, marks=LOGITS_FULL), pytest.param("moe", {"ep": 2}, 2, marks=LOGITS_FULL),
], ids=["tp2", "pp2", "moe-ep2"])
def test_megatron_gives_the_hf_models_logits_and_weights(request, tmp_path, kind, layout, world):
    model = request.getfixturevalue(kind)
    result = json.loads(ranks("logits", tmp_path, world, model=str(model), parallel=layout).read_text())
    assert result["max_diff"] <= 1e-5
    assert result["names_equal"] and result["weights_exact"]


# ------------------------------------------------------------- one step
def torch_step(model: Path, **config) -> dict:
    sys.path.insert(0, str(HERE))
    from megatron_ranks import samples, trainer_config

    from relax_core.train.torch_backend import TorchTrainer

    torch.manual_seed(0)
    trainer = TorchTrainer(model, trainer_config({k: v for k, v in config.items() if k != "max_tokens"}))  # padded
    metrics = [trainer.train_step(samples()) for _ in range(config.get("steps", 1))]
    return {"metrics": metrics, "weights": dict(trainer.named_parameters_for_sync())}


def fused(weights: dict, experts: int = 4) -> dict:
    """The Megatron side's per-expert tensors as transformers 5's Qwen3-MoE parameters (the torch backend's)."""
    from relax_core.train.megatron.hf_weights import transformers_named

    return dict(transformers_named({"num_experts": experts})(weights.items()))


STEP_FULL = pytest.mark.full(covered_by="tests/integration/test_megatron.py::test_one_step_gives_the_torch_backends_"
                                       "loss_and_weights[tp2-dapo-2-steps-of-2-minibatches]")


@pytest.mark.parametrize(("kind", "layout", "world", "extra"), [
    ("dense", {}, 1, {"recompute": True}),
    ("dense", {"tp": 2}, 2, {"steps": 2, "minis": 2, "algorithm": "dapo"}),
    ("dense", {"tp": 2}, 2, {"max_tokens": 16}),
    pytest.param("dense", {"pp": 2}, 2, {}, marks=STEP_FULL),
    pytest.param("dense", {"distopt": True}, 2, {}, marks=STEP_FULL),
    pytest.param("moe", {"ep": 2}, 2, {}, marks=STEP_FULL),
], ids=["tp1-recompute", "tp2-dapo-2-steps-of-2-minibatches", "tp2-packed-thd", "pp2", "dp2-distributed-optimizer",
        "moe-ep2"])
def test_one_step_gives_the_torch_backends_loss_and_weights(request, tmp_path, kind, layout, world, extra):
    model = request.getfixturevalue(kind)
    mine = torch.load(ranks("step", tmp_path, world, model=str(model), parallel=layout, **extra))
    ref = torch_step(model, **extra)
    for a, b in zip(mine["metrics"], ref["metrics"]):
        for key in ("loss", "pg_loss", "grad_norm", "num_tokens", "reward_mean", "clipfrac"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    weights = fused(mine["weights"]) if kind == "moe" else mine["weights"]
    assert weights.keys() == ref["weights"].keys()
    # Adam moves each element by up to lr = 1e-3; it turns float rounding in a near-zero gradient (another
    # summation order) into a few % of that on a few elements, and leaves the rest within 1e-6.
    for name, tensor in ref["weights"].items():
        diff = (weights[name] - tensor).abs()
        assert diff.max() <= 5e-5 and (diff > 1e-6).float().mean() <= 0.01, name
    if kind == "dense":  # and the step did move them
        from safetensors.torch import load_file

        start = load_file(model / "model.safetensors")
        assert max((weights[n] - start[n]).abs().max() for n in start) >= 5e-4
    if extra.get("recompute"):  # 8 samples in micro-batches of 3: 3 forwards, each run again in the backward
        assert mine["layer_calls"] == 2 * 3
    # packed: every attention call on a THD row (the reference above trained on padded micro-batches)
    assert (mine["thd_calls"] == mine["layer_calls"] > 0) if extra.get("max_tokens") else mine["thd_calls"] == 0


def test_ppo_trains_its_critic_beside_the_megatron_policy(dense, tmp_path):
    """The critic is a megatron-core model split over TP 2 like the policy (its value head on every TP rank): two
    steps (the second's values come from the critic the first trained) give the torch backend's numbers."""
    mine = torch.load(ranks("step", tmp_path, 2, model=str(dense), parallel={"tp": 2}, critic=True,
                            algorithm="ppo", steps=2))
    ref = torch_step(dense, critic=True, algorithm="ppo", steps=2)
    for step in range(2):
        for key in ("loss", "value_loss", "vf_clipfrac", "grad_norm"):
            # abs: a PPO loss near zero (-9e-8 against -6e-8 in one CI run) is float rounding in another
            # summation order, as in the test above
            assert mine["metrics"][step][key] == pytest.approx(ref["metrics"][step][key], rel=1e-5, abs=1e-7), (
                step, key)
    assert ref["metrics"][1]["value_loss"] != ref["metrics"][0]["value_loss"]


def test_a_megatron_trainer_that_hands_its_memory_back_trains_on_unchanged(dense, tmp_path):
    """Colocate on GPUs: the trainer empties every storage of its state between steps (megatron-core's
    buffers, the optimizers' fp32 master weights and moments, the critic and the reference: train/offload.py,
    exercised on the CPU, the trainer's device here); after reloading it trains on exactly as a trainer that
    never let go. "optimizer" first keeps only the policy (what the weight hand-over reads)."""
    out = torch.load(ranks("offload", tmp_path, 2, model=str(dense), parallel={"tp": 2}, critic=True,
                           algorithm="ppo", dtype="bfloat16", kl=0.01))
    assert all(out["before"].values()), out["before"]
    assert {k for k, v in out["after_optimizer"].items() if v} == {"policy"}, out["after_optimizer"]
    assert not any(out["after_model"].values()), out["after_model"]
    for got, want in zip(out["got"], out["expected"]):
        for key in ("loss", "value_loss", "grad_norm", "kl_loss"):
            assert got[key] == want[key], key
    assert out["weights_equal"]


# ------------------------------------------------------------- checkpoints
RESUME_FULL = pytest.mark.full(
    covered_by="tests/integration/test_megatron.py::test_a_checkpoint_resumes_with_another_layout_and_goes_on_as_before[optimizer]")


@pytest.mark.parametrize(("saved_as", "resumed_as", "extra"), [
    (({"tp": 2}, 2), [({"tp": 2}, 2), ({}, 2)], {}),  # the same layout; TP=2 -> DP=2
    pytest.param(({"distopt": True}, 2), [({"distopt": True}, 1)], {}, marks=RESUME_FULL),  # sharded Adam, DP=2 -> 1
    pytest.param(({"tp": 2}, 2), [({"tp": 2}, 2), ({}, 2)], {"critic": True, "algorithm": "ppo"},
                 marks=RESUME_FULL),  # PPO's critic too
], ids=["optimizer", "distributed-optimizer", "critic"])
def test_a_checkpoint_resumes_with_another_layout_and_goes_on_as_before(dense, tmp_path, saved_as, resumed_as,
                                                                         extra):
    ckpt = tmp_path / "ckpt"
    layout, world = saved_as
    saved = torch.load(ranks("save", tmp_path, world, model=str(dense), parallel=layout, ckpt=str(ckpt), **extra))
    names = {p.name for p in (ckpt / "iter_0000002").iterdir()}
    assert {"common.pt", "metadata.json", ".metadata"} <= names and any(n.endswith(".distcp") for n in names)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    for new_layout, new_world in resumed_as:
        resumed = torch.load(ranks("resume", tmp_path, new_world, model=str(dense), parallel=new_layout,
                                   ckpt=str(ckpt), **extra))
        assert resumed["step"] == 3 and resumed["progress"] == {"step": 2, "data": {"cursor": 16}}
        for key in ("loss", "value_loss") if extra else ("loss",):  # the critic came back with the policy
            assert resumed["then"][key] == pytest.approx(saved["then"][key], rel=1e-6, abs=1e-7), key
        same = (new_layout, new_world) == saved_as  # the same layout: bit for bit
        for name, tensor in saved["weights"].items():
            diff = (resumed["weights"][name] - tensor).abs().max()
            assert diff == 0 if same else diff <= 3e-5, (new_layout, name)
    if layout.get("distopt"):  # the optimizer state is stored another way: switching it is refused
        code, log = run_ranks("resume", {"world": 1, "out": str(tmp_path / "x"), "model": str(dense),
                                         "parallel": {}, "ckpt": str(ckpt)}, free_port(), subprocess_env())
        assert code != 0 and "train.distributed_optimizer=true" in log


# ------------------------------------------------------------- weight sync
def test_weights_from_a_tp2_trainer_make_the_engine_compute_the_trainers_logprobs(dense, tmp_path):
    key = "megatron-sync-key"
    with EngineServer(dense, tmp_path / "engine.log", key) as engine:
        result = json.loads(ranks("sync", tmp_path, 2, model=str(dense), parallel={"tp": 2}, engine=engine.base_url,
                                  key=key, weights_port=free_port(), lr=1e-2).read_text())
    assert result["version"] == "1" and result["buckets"] >= 2 and result["tokens"] == 12
    assert result["max_diff"] <= 1e-4


# ------------------------------------------------------------- relax submit
relax = partial(relax_cli, timeout=600, env={"PYTHONPATH": subprocess_env()["PYTHONPATH"]})  # whole runs


MEGATRON = ["train.backend=megatron", "train.tensor_parallel=2", "train.cpu_ranks_per_node=2"]
QUICKSTART = str(REPO / "recipes" / "quickstart.yaml")
MEGATRON_STEPS = 70


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("megatron-quickstart")
    # 70 of the quick start's 150 steps: the 10-step mean reward has risen by about 0.8 by then (0.81 measured)
    proc = relax("submit", QUICKSTART, *MEGATRON, f"train.steps={MEGATRON_STEPS}", "--executor", "local",
                 "--run-dir", "qs", cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return cwd / "qs"


def test_the_quick_start_learns_with_megatron(quickstart_run):
    rows = [json.loads(line) for line in (quickstart_run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows]
    assert len(rewards) == MEGATRON_STEPS
    assert sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.6


def test_its_checkpoint_loads_into_a_fresh_megatron_model_and_converts_verified(quickstart_run, tmp_path):
    script = f"""
import json, torch
from megatron.core import dist_checkpointing
from relax_core.train.megatron import compat
from relax_core.train.megatron.model import Parallel, build_model
from relax_core.train.megatron.parallel import initialize
from relax_core.train.megatron.trainer import ensure_world
ensure_world("cpu"); initialize(Parallel(), 0)
config = json.load(open("{quickstart_run}/model/config.json"))
model = build_model(config, Parallel())
before = {{k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}}
template = model.sharded_state_dict()
with compat.on_device():
    loaded = dist_checkpointing.load(template, "{quickstart_run}/checkpoints/iter_{MEGATRON_STEPS:07d}")
model.load_state_dict({{k: v for k, v in loaded.items() if k in template}})
changed = sum(not torch.equal(before[k], v) for k, v in model.state_dict().items() if k in before)
print(json.dumps({{"changed": changed, "tensors": len(before)}}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["changed"] >= counts["tensors"] - 2  # every trained weight replaced (norms may stay near 1)

    converted = relax("convert-ckpt", str(quickstart_run / "checkpoints"), "--out", str(tmp_path / "hf"),
                      "--verify", cwd=tmp_path)
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert "verified" in converted.stdout
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.num_hidden_layers == 2


SMALL = ["rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "checkpoint.interval=2",
         "checkpoint.keep_last=5", "logging.backends=[]"]


@pytest.mark.full(covered_by="tests/integration/test_megatron.py::test_a_checkpoint_resumes_with_another_layout_and_goes_on_as_before[optimizer]")
def test_a_resumed_megatron_run_is_bit_identical(tmp_path):
    from relax_core.checkpoint import export_hf

    assert relax("submit", QUICKSTART, "train.steps=4", *SMALL, *MEGATRON, "--executor", "local", "--run-dir",
                 "straight", cwd=tmp_path).returncode == 0
    assert relax("submit", QUICKSTART, "train.steps=2", *SMALL, *MEGATRON, "--executor", "local", "--run-dir",
                 "resumed", cwd=tmp_path).returncode == 0
    second = relax("submit", QUICKSTART, "train.steps=4", *SMALL, *MEGATRON, "--executor", "local", "--run-dir",
                   "resumed", cwd=tmp_path)
    assert second.returncode == 0 and "step 3/4" in second.stdout and "step 1/4" not in second.stdout
    from safetensors.torch import load_file

    a = load_file(export_hf(tmp_path / "straight" / "checkpoints", tmp_path / "a", 4) / "model.safetensors")
    b = load_file(export_hf(tmp_path / "resumed" / "checkpoints", tmp_path / "b", 4) / "model.safetensors")
    mid = load_file(export_hf(tmp_path / "straight" / "checkpoints", tmp_path / "m", 2) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(mid[n], a[n]) for n in a)  # the resumed steps did train
