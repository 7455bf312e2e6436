"""The sharded trainer (FSDP2 over 2 gloo ranks) against the unsharded one, on a real tiny Qwen3.

What a user moving to FSDP relies on: the same step gives the same loss and
the same weights as one unsharded process; the checkpoint it writes exports to
the same HF tensors; a run resumed from that checkpoint continues exactly as
the uninterrupted one; a rank with fewer (or no) samples than the other still
takes part. Also here, on one process: token-budget micro-batches (packed
rows) and activation recomputation change how a step is computed, not what it
computes.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_exit import leave_group

from relax_core.data.sample import Sample
from relax_core.train.batching import shard
from relax_core.train.config import TorchTrainerConfig
from relax_core.train.torch_backend import TorchTrainer

TOL = 1e-6

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from relax_core.models.tiny import materialize_tiny_model

    return materialize_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=5, alphabet="abcdefgh")


def make_samples(seed: int = 0) -> list[Sample]:
    """8 samples of mixed lengths in groups of 4 (each group spans both ranks' shards)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = [5, 3, 7, 4, 6, 2, 5, 3]
    response_lens = [3, 1, 4, 2, 6, 5, 2, 3]
    rewards = torch.rand(8, generator=g).tolist()
    samples = []
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        ids = torch.randint(3, 19, (p + r,), generator=g).tolist()
        samples.append(Sample(ids[:p], ids[p:], [-1.0] * r, reward=rewards[i], group_id=i // 4))
    return samples


def config(**kw) -> TorchTrainerConfig:
    # Two updates per step (two epochs), so logp_old is a forward of its own and the ratio leaves 1.
    return TorchTrainerConfig(**{"lr": 1e-3, "grad_clip": 1.0, "micro_batch_size": 2, "num_epochs": 2,
                                 "lr_schedule": "cosine", "warmup_steps": 1, "total_steps": 4, **kw})


def params(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in trainer.named_parameters_for_sync()}


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = TOL) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= tol, worst


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """Steps 1-2 sharded (a checkpoint after step 1, exported to HF), step 2 again resumed from it;
    step 3 with all samples on rank 0 and none on rank 1."""
    import os

    from relax_core.checkpoint import load_checkpoint, save_checkpoint

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        trainer = TorchTrainer(model_dir, config(fsdp=True))
        m1 = trainer.train_step(shard(make_samples(0), rank, world))
        after1 = params(trainer)
        save_checkpoint(f"{out}/ckpt", 1, trainer.state_dict(), hf_dir=model_dir)
        m2 = trainer.train_step(shard(make_samples(1), rank, world))
        after2 = params(trainer)
        m3 = trainer.train_step(make_samples(2) if rank == 0 else [])
        after3 = params(trainer)

        resumed = TorchTrainer(model_dir, config(fsdp=True))
        state = resumed.state_dict()
        load_checkpoint(f"{out}/ckpt", state)
        resumed.load_state_dict(state)
        r2 = resumed.train_step(shard(make_samples(1), rank, world))
        resumed2 = params(resumed)
        if rank == 0:
            torch.save({"m1": m1, "m2": m2, "m3": m3, "r2": r2, "after1": after1, "after2": after2,
                        "after3": after3, "resumed2": resumed2}, f"{out}/rank0.pt")
    finally:
        leave_group()


@pytest.fixture(scope="module")
def sharded_run(model_dir, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_fsdp_rank, args=(2, _free_port(), str(model_dir), str(out)), nprocs=2, join=True)
    return torch.load(out / "rank0.pt"), out


@pytest.fixture(scope="module")
def unsharded(model_dir) -> dict:
    trainer = TorchTrainer(model_dir, config())
    result = {"m1": trainer.train_step(make_samples(0)), "after1": params(trainer)}
    result |= {"m2": trainer.train_step(make_samples(1)), "after2": params(trainer)}
    result |= {"m3": trainer.train_step(make_samples(2)), "after3": params(trainer)}
    return result


def test_a_sharded_step_gives_the_unsharded_loss_and_weights(sharded_run, unsharded):
    run, _ = sharded_run
    for step in ("m1", "m2", "m3"):  # m3: rank 1 has no samples and only joins the collectives
        for key in ("loss", "pg_loss", "grad_norm", "clipfrac", "ratio_mean"):
            assert run[step][key] == pytest.approx(unsharded[step][key], abs=TOL), (step, key)
        assert run[step]["optimizer_steps"] == 2.0
    assert run["m2"]["clipfrac"] > 0 or run["m2"]["ratio_mean"] != 1.0  # the second update is off-policy
    for after in ("after1", "after2", "after3"):
        assert_close(run[after], unsharded[after])


def test_the_sharded_checkpoint_exports_the_unsharded_weights(sharded_run, unsharded, tmp_path):
    from safetensors.torch import load_file

    from relax_core.checkpoint.convert import convert

    _, out = sharded_run
    convert(out / "ckpt", tmp_path / "hf")
    exported = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        exported |= load_file(f)
    assert_close(exported, unsharded["after1"])


def test_a_resumed_sharded_run_continues_exactly(sharded_run):
    run, _ = sharded_run
    assert run["r2"]["loss"] == run["m2"]["loss"] and run["r2"]["lr"] == run["m2"]["lr"]
    assert_close(run["resumed2"], run["after2"], tol=0.0)


# adam_eps: the body's first gradients (once the zero-initialised head has moved) are tiny, and Adam divides
# each by its own size: at eps 1e-8 the last bits of a sum taken in another order would decide the update.
PPO = {"algorithm": "ppo", "critic_lr": 1e-2, "critic_value_clip": 0.05, "recompute_activations": True,
       "adam_eps": 1e-3}


def critic_params(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    from relax_core.train.sharding import full

    return {name: full(p.detach()).clone() for name, p in trainer.critic.model.named_parameters()}


def _fsdp_ppo_rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """PPO sharded: two steps (a checkpoint after the first), then the second again from the checkpoint.
    Rank 1 never reads the model directory's weights: rank 0's reach its shards."""
    import os

    import transformers

    from relax_core.checkpoint import load_checkpoint, save_checkpoint

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    if rank == 1:
        def refuse(cls, *args, **kwargs):
            raise AssertionError(f"rank 1 read the checkpoint of {cls.__name__}")

        transformers.PreTrainedModel.from_pretrained = classmethod(refuse)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        trainer = TorchTrainer(model_dir, config(fsdp=True, **PPO))
        m1 = trainer.train_step(shard(make_samples(0), rank, world))
        save_checkpoint(f"{out}/ckpt", 1, trainer.state_dict(), hf_dir=model_dir)
        m2 = trainer.train_step(shard(make_samples(1), rank, world))
        after2 = critic_params(trainer)
        resumed = TorchTrainer(model_dir, config(fsdp=True, **PPO))
        state = resumed.state_dict()
        load_checkpoint(f"{out}/ckpt", state)
        resumed.load_state_dict(state)
        r2 = resumed.train_step(shard(make_samples(1), rank, world))
        resumed2 = critic_params(resumed)  # every rank: gathering a shard is a collective
        if rank == 0:
            torch.save({"m1": m1, "m2": m2, "r2": r2, "critic2": after2, "resumed2": resumed2,
                        "sharded": type(next(trainer.critic.model.parameters())).__name__}, f"{out}/ppo.pt")
    finally:
        leave_group()


def test_a_sharded_critic_trains_as_the_unsharded_one_and_resumes(model_dir, tmp_path):
    """PPO's critic is sharded with FSDP2 like the policy (float32 master weights, recomputation): over 2 ranks
    its values, loss and updated weights are the unsharded critic's, and it resumes from its checkpoint."""
    mp.spawn(_fsdp_ppo_rank, args=(2, _free_port(), str(model_dir), str(tmp_path)), nprocs=2, join=True)
    run = torch.load(tmp_path / "ppo.pt")
    plain = TorchTrainer(model_dir, config(**PPO))
    expected = [plain.train_step(make_samples(0)), plain.train_step(make_samples(1))]
    assert run["sharded"] == "DTensor"
    for got, want in zip((run["m1"], run["m2"]), expected):
        for key in ("value_loss", "vf_clipfrac", "loss"):
            assert got[key] == pytest.approx(want[key], abs=TOL), key
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)  # summed in another order
    assert expected[1]["value_loss"] != expected[0]["value_loss"]  # the critic learned between the steps
    assert_close(run["critic2"], critic_params(plain))
    assert run["r2"]["value_loss"] == run["m2"]["value_loss"]
    assert_close(run["resumed2"], run["critic2"], tol=0.0)


def test_token_budget_micro_batches_pack_rows_and_compute_the_same_step(model_dir):
    samples = make_samples(0)
    padded = TorchTrainer(model_dir, config(micro_batch_size=2))
    packed = TorchTrainer(model_dir, config(micro_batch_size=8, max_tokens_per_micro_batch=16))
    bounds = packed._micro_bounds(samples[:4])  # 8, 4, 11, 6 tokens
    assert bounds == [0, 2, 3, 4]
    mb = packed._pack(samples[:2])
    assert mb.input_ids.shape == (1, 12) and mb.attention_mask is None  # no padding in a packed row
    a, b = padded.train_step(samples), packed.train_step(samples)
    assert a["loss"] == pytest.approx(b["loss"], abs=TOL)
    assert_close(params(padded), params(packed), tol=1e-5)


def test_recomputed_activations_save_less_for_backward_and_give_the_same_gradient(model_dir):
    from relax_core.train.batching import forward_logprobs, pack

    samples = make_samples(0)

    def saved_bytes_and_grads(recompute: bool):
        trainer = TorchTrainer(model_dir, config(recompute_activations=recompute))
        saved = []

        def keep(t):
            saved.append(t.numel() * t.element_size())
            return t

        mb = pack(samples, trainer.pad_id)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            logp, _ = forward_logprobs(trainer.model, mb)
        (logp * mb.loss_mask).sum().backward()
        return sum(saved), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    full_bytes, full_grads = saved_bytes_and_grads(False)
    recomputed_bytes, recomputed_grads = saved_bytes_and_grads(True)
    assert recomputed_bytes < full_bytes / 2
    assert_close(recomputed_grads, full_grads)


def test_the_recipe_fields_reach_the_trainer():
    from relax_core.config.loader import load_recipe
    from relax_core.train.settings import trainer_config

    quickstart = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
    plain = trainer_config(load_recipe(quickstart))
    assert (plain.fsdp, plain.recompute_activations, plain.max_tokens_per_micro_batch, plain.device) == (
        False, False, None, "cpu")
    chosen = trainer_config(load_recipe(quickstart, ["train.fsdp=true", "train.recompute_activations=true",
                                                     "train.max_tokens_per_gpu=64"]))
    assert (chosen.fsdp, chosen.recompute_activations, chosen.max_tokens_per_micro_batch) == (True, True, 64)


def test_the_quick_start_trains_sharded_over_two_ranks_and_exports(tmp_path):
    """`relax submit` with FSDP over 2 CPU ranks, recomputation and packed micro-batches, in fully_async with
    two optimizer steps per step (so weights are snapshot, logp_old recomputed by the ranks and weights broadcast
    from the gathered copy): it runs to the end and its checkpoint converts to an HF model that loads."""
    import json
    import os
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    quickstart = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
    env = os.environ | {"COLUMNS": "200", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
    args = ["submit", str(quickstart), "--executor", "local", "--run-dir", "run", "mode=fully_async",
            "train.steps=3", "train.fsdp=true", "train.cpu_ranks_per_node=2", "train.recompute_activations=true",
            "train.max_tokens_per_gpu=96", "train.global_batch_size=64", "train.micro_batch_size=16"]
    proc = subprocess.run([sys.executable, "-m", "relax_cli.main", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "optimizer_steps" in r]
    assert [r["optimizer_steps"] for r in steps] == [2.0, 2.0, 2.0]
    convert = subprocess.run([sys.executable, "-m", "relax_cli.main", "convert-ckpt", "run", "--out", "hf"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert convert.returncode == 0, convert.stdout[-2000:] + convert.stderr[-2000:]
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
