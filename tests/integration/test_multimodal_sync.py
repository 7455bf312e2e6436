"""After a training step and a weight sync, the engine's log-probs on a multimodal batch are the trainer's.

Real pieces: a CPU engine server on a tiny Qwen3-VL, the rollout manager with its media worker process
(requests built from the synthetic colour data set, as a run builds them), the torch trainer, and the
weights sent to the engine over SGLang's `update_weights_from_tensor` session. Also: the engine samples a
video into the frames the run's `data.video_*` settings name (the trainer's), not its own defaults.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from engine_fixtures import EngineServer

from relax_core.config.data import SyntheticData
from relax_core.data.media import MediaBounds
from relax_core.data.prompts import build_prompt_source
from relax_core.models.tiny import materialize_tiny_model
from relax_core.rewards.hub import RewardHub
from relax_core.rollout.client import EngineClient
from relax_core.rollout.manager import RolloutManager, SamplingConfig
from relax_core.rollout.prompt_prep import MediaPrompts
from relax_core.train.config import TorchTrainerConfig
from relax_core.train.torch_backend import TorchTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ALPHABET = "'.?ABCDWbcdfghlopw"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return materialize_tiny_model(tmp_path_factory.mktemp("vl") / "model", architecture="qwen3_vl", alphabet=ALPHABET)


def rollout(url: str, model_dir, rows: list[dict], step: int) -> list:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sampling = SamplingConfig(n_samples_per_prompt=4, max_new_tokens=3, max_prompt_len=512, seed=3)
    media = MediaPrompts(str(model_dir), MediaBounds(), None, 512)

    async def run():
        async with EngineClient(url) as client:
            scorer = RewardHub.from_function(lambda r, label, m: float(sum(map(ord, r)) % 2))
            manager = RolloutManager([client], tokenizer, sampling, scorer,
                                     media=media)
            return await manager.generate(rows, step)

    try:
        return asyncio.run(run())
    finally:
        media.close()


def send_weights(url: str, named: list) -> None:
    from relax_core.rollout.weight_wire import serialize_named_tensors

    assert httpx.post(f"{url}/begin_weight_update", json={}, timeout=30).json()["success"]
    answer = httpx.post(f"{url}/update_weights_from_tensor", timeout=120,
                        json={"serialized_named_tensors": serialize_named_tensors(named)}).json()
    assert answer["success"], answer
    assert httpx.post(f"{url}/end_weight_update", timeout=30).json()["success"]


@pytest.mark.full(covered_by="tests/integration/test_multimodal_runs.py::"
                              "test_a_parquet_in_the_openr1_schema_trains_and_an_oversize_image_is_skipped")
def test_engine_logprobs_equal_the_trainers_after_a_step_and_a_sync(model_dir, tmp_path):
    rows = build_prompt_source(SyntheticData(task="colours", seed=4)).next_batch(4)
    trainer = TorchTrainer(model_dir, TorchTrainerConfig(micro_batch_size=4, lr=5e-2))
    with EngineServer(model_dir, tmp_path / "engine.log") as server:
        first = rollout(server.base_url, model_dir, rows, step=0)
        trainer.train_step(first)
        named = list(trainer.named_parameters_for_sync())
        assert any(n.startswith("model.visual.") for n, _ in named)
        send_weights(server.base_url, named)
        second = rollout(server.base_url, model_dir, rows, step=1)
    assert all(s.multimodal is not None for s in second)
    engine = [lp for s in second for lp in s.rollout_logprobs]
    ours = [lp for row in trainer.compute_logprobs(second) for lp in row]
    assert len(engine) == len(ours) == sum(s.response_len for s in second) > 0
    assert max(abs(a - b) for a, b in zip(engine, ours)) < 1e-4
    before = TorchTrainer(model_dir, TorchTrainerConfig(micro_batch_size=4)).compute_logprobs(second)
    assert max(abs(a - b) for a, b in zip(engine, [lp for row in before for lp in row])) > 1e-3  # it moved


def test_the_engine_samples_video_frames_as_the_run_says(model_dir, tmp_path):
    from relax_core.data.media import encode_data_uri
    from relax_core.data.synthetic_media import write_video
    from relax_core.models import multimodal
    from relax_core.rollout.cpu_engine.media_inputs import MediaPreprocessor

    frames = np.stack([np.full((32, 32, 3), 15 * k, dtype=np.uint8) for k in range(16)])
    clip = encode_data_uri("video", write_video(tmp_path / "clip.mp4", frames, fps=8).read_bytes())
    _, prompt = multimodal.chat_prompt(multimodal.load_processor(model_dir), "ab", n_videos=1)
    default, _ = MediaPreprocessor(str(model_dir)).prepare(prompt, {"image": [], "video": [clip], "audio": []})
    as_run, _ = MediaPreprocessor(str(model_dir), {"video_fps": 8.0}).prepare(
        prompt, {"image": [], "video": [clip], "audio": []})
    pad = multimodal.load_processor(model_dir).tokenizer.convert_tokens_to_ids(multimodal.VIDEO)
    assert as_run.count(pad) == 4 * default.count(pad)  # 16 frames at 8 fps against 4 at 2 fps


def test_the_runs_video_settings_reach_the_engines_command_line(tmp_path):
    from pathlib import Path

    import yaml

    from relax_core.config import load_recipe
    from relax_core.rollout.engine_command import engine_command, rollout_engines

    recipe = yaml.safe_load((Path(__file__).resolve().parents[2] / "recipes" / "quickstart_vlm.yaml").read_text())
    recipe["data"] = {"source": "file", "path": str(tmp_path / "d.jsonl"), "video_key": "clip", "video_fps": 8.0,
                      "video_max_frames": 64}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    settings = rollout_engines(load_recipe(tmp_path / "r.yaml", []), "m", threads=1)
    argv = engine_command(settings, 0, python="python", host="h", port=1, fd=3)
    assert argv[-3:] == ["--video-fps=8.0", "--video-min-frames=4", "--video-max-frames=64"]
