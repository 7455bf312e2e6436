"""The torch trainer on samples with images and audio (tiny Qwen3-VL and Qwen3-Omni thinker, one process).

What a user relies on: a step's log-probs of each response token are the
model's own for that sample's media, whatever else shares the micro-batch
(text rows included); a step learns through the vision tower unless
`train.freeze_vision` keeps it as loaded, and frozen encoders are left out
of what the engines are sent.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gloo_exit import leave_group
from PIL import Image

from relax_core.data.sample import Sample
from relax_core.models import multimodal as mm
from relax_core.train.config import TorchTrainerConfig
from relax_core.train.torch_backend import TorchTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_omni"])
def model_dir(request, tmp_path_factory) -> Path:
    from relax_core.models.tiny import materialize_tiny_model

    return materialize_tiny_model(tmp_path_factory.mktemp(request.param) / "model", architecture=request.param,
                                  alphabet="abcd")


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> Path:
    from relax_core.models.tiny import materialize_tiny_model

    return materialize_tiny_model(tmp_path_factory.mktemp("omni") / "model", architecture="qwen3_omni",
                                  alphabet="abcd")


def colour(rgb: tuple[int, int, int], size: int = 64) -> Image.Image:
    return Image.fromarray(np.full((size, size, 3), rgb, dtype=np.uint8))


def samples_for(model_dir: Path) -> list[Sample]:
    """Two samples with an image each (one of them with audio on Omni) and one text sample, two groups."""
    processor = mm.load_processor(model_dir)
    audio = processor.family == "qwen3_omni"
    rng = np.random.default_rng(0)
    a, b, c = processor.tokenizer.convert_tokens_to_ids(["a", "b", "c"])
    out = []
    for i, (rgb, size) in enumerate([((250, 10, 10), 64), ((10, 10, 250), 96)]):
        text, _ = mm.chat_prompt(processor, "ab", n_images=1, n_audios=int(audio and i == 0))
        sound = [rng.standard_normal(16000).astype(np.float32) * 0.1] if audio and i == 0 else []
        done = mm.process(processor, text, images=[colour(rgb, size)], audios=sound)
        out.append(Sample(done.input_ids, [a + i, b, c], [-1.0] * 3, reward=float(i), group_id=0,
                          multimodal=done.tensors))
    _, ids = mm.chat_prompt(processor, "cd")
    out.append(Sample(list(ids), [c, a], [-1.0] * 2, reward=1.0, group_id=1))
    out.append(Sample(list(ids), [b, b], [-1.0] * 2, reward=0.0, group_id=1))
    return out


def alone(model, sample: Sample) -> list[float]:
    """The sample's response log-probs from a forward of that sample alone (no padding, no batch)."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(**mm.model_inputs(model, ids, mask, [sample.multimodal or {}])).logits
    logp = logits[0].log_softmax(-1)
    p = len(sample.prompt_ids)
    return [logp[p - 1 + j, t].item() for j, t in enumerate(sample.response_ids)]


def test_a_mixed_micro_batch_gives_each_sample_its_own_logprobs(model_dir):
    trainer = TorchTrainer(model_dir, TorchTrainerConfig(micro_batch_size=4))
    samples = samples_for(model_dir)
    batched = trainer.compute_logprobs(samples)
    for sample, got in zip(samples, batched):
        assert np.allclose(got, alone(trainer.model, sample), atol=1e-5), (got, alone(trainer.model, sample))


@pytest.mark.parametrize("freeze_vision", [False, True])
def test_freeze_vision_keeps_the_vision_tower_and_leaves_it_out_of_the_sync(model_dir, freeze_vision):
    trainer = TorchTrainer(model_dir, TorchTrainerConfig(micro_batch_size=2, lr=1e-2, freeze_vision=freeze_vision))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.train_step(samples_for(model_dir))
    assert np.isfinite(metrics["loss"])
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    vision = {n for n in before if n.startswith("model.visual.")}
    assert vision and any(not n.startswith("model.visual.") for n in changed)  # the language model learned
    synced = {n for n, _ in trainer.named_parameters_for_sync()}
    if freeze_vision:
        assert not changed & vision and not synced & vision
    else:
        assert changed & vision and vision <= synced


def _fsdp_rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """Sharded steps where one rank's rows have images and the other's are text, then one where a rank has
    nothing (it runs idle passes)."""
    import os

    import torch.distributed as dist

    from relax_core.train.batching import shard

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        trainer = TorchTrainer(model_dir, TorchTrainerConfig(micro_batch_size=1, lr=1e-2, fsdp=True))
        samples = samples_for(Path(model_dir))  # images on rank 0, text on rank 1
        trainer.train_step(shard(samples, rank, world))
        trainer.train_step(samples if rank == 0 else [])
        weights = {n: t.clone() for n, t in trainer.named_parameters_for_sync()}
        if rank == 0:
            torch.save(weights, f"{out}/rank0.pt")
    finally:
        leave_group()


def test_sharded_ranks_with_and_without_images_train_as_one_process(omni_dir, tmp_path):
    """On the Omni thinker, which has both encoders (Qwen3-VL's case is its vision half)."""
    import socket

    model_dir = omni_dir

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp_rank, args=(2, port, str(model_dir), str(tmp_path)), nprocs=2, join=True)
    sharded = torch.load(tmp_path / "rank0.pt")
    alone = TorchTrainer(model_dir, TorchTrainerConfig(micro_batch_size=1, lr=1e-2))
    alone.train_step(samples_for(model_dir))
    alone.train_step(samples_for(model_dir))
    expected = dict(alone.named_parameters_for_sync())
    assert sharded.keys() == expected.keys()
    assert max((sharded[n] - expected[n]).abs().max().item() for n in expected) < 1e-5
