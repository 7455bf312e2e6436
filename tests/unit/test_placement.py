"""The trainers' step code keeps every tensor on the trainer's device (the class of defect CUDA shows first).

A CPU tensor that meets a CUDA tensor in one op fails on the first GPU run and never on CPU, where
every tensor is on one device. tests/sim_device.py gives this machine a second device: the trainer
is built with `device="meta"`, its model and batches hold real CPU data that report that device,
and an op that mixes them with CPU tensors raises `DeviceMismatch`, as CUDA would. Each algorithm's
whole step runs so (two updates per step, so logp_old, the ratio's range and every metric path run),
with the recipe's own trainer settings, plus the reference (KL loss), TIS, and the critic.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from sim_device import DEVICE, DeviceMismatch, SimDevice

from relax_core.config.algorithm_specs import algorithm_names
from relax_core.config.loader import load_recipe
from relax_core.data.sample import Sample
from relax_core.train.settings import trainer_config
from relax_core.train.torch_backend import TorchTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from relax_core.models.tiny import materialize_tiny_model

    root = tmp_path_factory.mktemp("placement")
    return (materialize_tiny_model(root / "policy", seed=0, alphabet="abcd"),
            materialize_tiny_model(root / "teacher", seed=1, alphabet="abcd"))


def batch(n: int = 8) -> list[Sample]:
    """Two groups of 4, rewards that differ within each group (advantages not 0), engine log-probs off by a bit."""
    rng = random.Random(0)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 12) for _ in range(rng.randrange(2, 5))]
        response = [rng.randrange(3, 12) for _ in range(rng.randrange(1, 6))]
        out.append(Sample(prompt_ids=prompt, response_ids=response, loss_mask=[1] * len(response),
                          rollout_logprobs=[-2.0 - 0.1 * j for j in range(len(response))],
                          reward=float(i % 3 == 0), group_id=i // 4))
    return out


def overrides(name: str, teacher_dir) -> list[str]:
    """The quick start switched to `name`, with two updates per step."""
    extra = {"opd": [f"algorithm.teacher.path={teacher_dir}", "algorithm.teacher.dtype=float32"],
             "ppo": ["algorithm.critic.lr=1e-3"]}.get(name, [])
    return [f"algorithm.name={name}", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4",
            "train.global_batch_size=4", "train.micro_batch_size=3", *extra]


def step_on_sim_device(model_dir, recipe_overrides: list[str]) -> dict[str, float]:
    recipe = load_recipe("recipes/quickstart.yaml", recipe_overrides)
    config = dataclasses.replace(trainer_config(recipe), device=DEVICE.type)
    with SimDevice():
        trainer = TorchTrainer(model_dir, config)
        assert next(trainer.model.parameters()).device == DEVICE
        return trainer.train_step(batch())


@pytest.mark.parametrize("name", algorithm_names())
def test_every_algorithms_step_keeps_its_tensors_on_the_trainers_device(model_dirs, name):
    metrics = step_on_sim_device(model_dirs[0], overrides(name, model_dirs[1]))
    assert metrics["optimizer_steps"] == 2
    assert all(math.isfinite(v) for v in metrics.values()), metrics


@pytest.mark.parametrize("extra", [["algorithm.kl.coef=0.01", "algorithm.kl.placement=loss"],
                                   ["algorithm.tis_cap=2.0"]], ids=["kl_loss", "tis"])
def test_the_reference_and_tis_paths_keep_their_tensors_on_the_trainers_device(model_dirs, extra):
    metrics = step_on_sim_device(model_dirs[0], overrides("grpo", model_dirs[1]) + extra)
    assert metrics["optimizer_steps"] == 2


def test_the_simulated_device_refuses_what_cuda_refuses():
    """The check itself: the CPU-meets-device case of finding 2 raises, what CUDA allows does not."""
    with SimDevice():
        on_device = torch.ones(2, device=DEVICE)
        with pytest.raises(DeviceMismatch):
            torch.maximum(torch.zeros(2), on_device, out=torch.zeros(2))
        with pytest.raises(DeviceMismatch):
            _ = on_device + torch.ones(2)
        assert float((on_device * torch.tensor(3.0)).sum()) == 6.0  # a 0-dim CPU tensor is a scalar
        assert on_device[torch.tensor([1])].device == DEVICE  # CPU indices into a device tensor
        assert on_device.cpu().device.type == "cpu" and on_device.tolist() == [1.0, 1.0]


def held(trainer) -> dict[str, int]:
    """Bytes of each part of the trainer's state whose storage is not empty (what it holds on its device)."""
    from relax_core.train.offload import module_tensors, optimizer_tensors

    def nbytes(tensors) -> int:
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    parts = {"policy": module_tensors(trainer.model), "reference": module_tensors(trainer.ref_model),
             "optimizer": optimizer_tensors(trainer.optimizer)}
    if trainer.critic is not None:
        parts |= {"critic": module_tensors(trainer.critic.model),
                  "critic optimizer": optimizer_tensors(trainer.critic.optimizer)}
    return {name: nbytes(tensors) for name, tensors in parts.items()}


@pytest.fixture(scope="module")
def bf16_dir(model_dirs, tmp_path_factory):
    """The policy saved in bfloat16: loaded as float32 master weights its tensors are the allocator's, as on a
    GPU (a float32 file's would be mapped from the file on the CPU, and such storages cannot be resized)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("bf16") / "policy"
    shutil.copytree(model_dirs[0], out)
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(out / "model.safetensors").items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_trainer_that_hands_the_device_back_keeps_nothing_there_and_trains_on_unchanged(bf16_dir, model_dirs):
    """Colocate on GPUs: between steps the trainer empties every storage of its state (the engines resume into
    the memory it freed; train/offload.py, exercised here on the CPU, the trainer's device); after `reload`
    its next steps are exactly those of a trainer that never let go."""
    recipe = load_recipe("recipes/quickstart.yaml", overrides("ppo", model_dirs[1]) + ["algorithm.kl.coef=0.01",
                                                                                       "algorithm.kl.placement=loss"])
    config = trainer_config(recipe)
    kept, moved = TorchTrainer(bf16_dir, config), TorchTrainer(bf16_dir, config)
    expected = [kept.train_step(batch()), kept.train_step(batch())]
    got = [moved.train_step(batch())]
    before = held(moved)
    assert all(before.values()), before  # a training trainer holds all of it
    moved.offload(["optimizer"])
    assert {k for k, v in held(moved).items() if v} == {"policy"}  # what the weight hand-over reads
    moved.offload(["model"])
    assert held(moved) == dict.fromkeys(before, 0)
    assert all(p.grad is None for p in moved.model.parameters())
    moved.reload()
    assert held(moved) == before
    got.append(moved.train_step(batch()))
    for a, b in zip(got, expected):
        for key in ("loss", "grad_norm", "value_loss", "kl_loss"):
            assert a[key] == b[key], key
