"""Tiny Qwen3-VL / Qwen3-Omni checkpoints and `models/multimodal.py`: what every side relies on.

A padded batch must give each sample exactly its own log-probs (wrong M-RoPE
positions would not), decoding with a cache must continue positions through
`rope_deltas`, and freezing must keep the encoders out of the gradients.
"""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from relax_core.models import multimodal as mm
from relax_core.models.tiny import materialize_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_omni"])
def tiny(request, tmp_path_factory):
    out = materialize_tiny_model(tmp_path_factory.mktemp(request.param) / "model", architecture=request.param)
    return out, mm.load_policy(out), mm.load_processor(out)


def _image(h, w, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def _sample(processor, i, text="abc"):
    audio = processor.family == "qwen3_omni"
    prompt, _ = mm.chat_prompt(processor, text * (i + 1), n_images=1, n_audios=int(audio))
    sound = [np.random.default_rng(i).standard_normal(8000 * (i + 1)).astype(np.float32)] if audio else []
    return mm.process(processor, prompt, images=[_image(*[(64, 64), (96, 64), (32, 128)][i], seed=i)], audios=sound)


def _logprobs(model, ids, mask, tensors):
    with torch.no_grad():
        return model(**mm.model_inputs(model, ids, mask, tensors)).logits.log_softmax(-1)


def test_directory_reloads_offline_like_a_real_checkpoint(tiny):
    path, model, processor = tiny
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == {"qwen3_vl": "qwen3_vl", "qwen3_omni": "qwen3_omni_moe"}[mm.family(path)]
    assert type(model).__name__ in ("Qwen3VLForConditionalGeneration", "Qwen3OmniMoeThinkerForConditionalGeneration")
    assert processor.tokenizer.convert_tokens_to_ids(mm.IMAGE) == model.config.image_token_id
    again = mm.load_policy(path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_one_image_expands_to_its_grid(tiny):
    _, _, processor = tiny
    prompt, ids = mm.chat_prompt(processor, "ab", n_images=1)
    image_id = processor.tokenizer.convert_tokens_to_ids(mm.IMAGE)
    assert prompt.endswith("<|im_start|>assistant\n") and ids.count(image_id) == 1
    out = mm.process(processor, prompt, images=[_image(64, 64)])
    assert out.tensors["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert out.input_ids.count(image_id) == 4 and len(out.input_ids) == len(ids) + 3


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_matches_each_sample_alone(tiny, side):
    _, model, processor = tiny
    samples = [_sample(processor, i) for i in range(3)]
    width = max(len(s.input_ids) for s in samples)
    ids = torch.full((3, width), processor.tokenizer.pad_token_id)
    mask = torch.zeros(3, width, dtype=torch.long)
    spans = []
    for row, s in enumerate(samples):
        n = len(s.input_ids)
        spans.append(slice(0, n) if side == "right" else slice(width - n, width))
        ids[row, spans[-1]], mask[row, spans[-1]] = torch.tensor(s.input_ids), 1
    batch = _logprobs(model, ids, mask, [s.tensors for s in samples])
    for row, s in enumerate(samples):
        alone = torch.tensor([s.input_ids])
        torch.testing.assert_close(batch[row, spans[row]], _logprobs(model, alone, torch.ones_like(alone),
                                                                     [s.tensors])[0], atol=1e-5, rtol=0)


def test_video_frames_go_through_process_and_forward(tiny):
    _, model, processor = tiny
    frames = np.random.default_rng(0).integers(0, 255, (4, 64, 64, 3), dtype=np.uint8)
    prompt, _ = mm.chat_prompt(processor, "ab", n_videos=1)
    out = mm.process(processor, prompt, videos=[frames])
    assert out.tensors["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert out.input_ids.count(processor.tokenizer.convert_tokens_to_ids(mm.VIDEO)) == 8
    ids = torch.tensor([out.input_ids])
    assert torch.isfinite(_logprobs(model, ids, torch.ones_like(ids), [out.tensors])).all()


def test_text_only_prompt_works(tiny):
    _, model, processor = tiny
    prompt, ids = mm.chat_prompt(processor, "abc", system_prompt="be brief")
    assert mm.process(processor, prompt).input_ids == ids
    ids = torch.tensor([ids])
    assert _logprobs(model, ids, torch.ones_like(ids), [{}]).shape[:2] == ids.shape


def test_decoding_with_a_cache_continues_positions_through_rope_deltas(tiny):
    from transformers import DynamicCache

    _, model, processor = tiny
    s = _sample(processor, 1)
    full = torch.tensor([s.input_ids + processor.tokenizer("abca")["input_ids"]])
    expected = _logprobs(model, full, torch.ones_like(full), [s.tensors])[0]
    prefix = full[:, : len(s.input_ids)]
    inputs = mm.model_inputs(model, prefix, torch.ones_like(prefix), [s.tensors])
    _, deltas = mm.rope_positions(model, prefix, torch.ones_like(prefix), mm.batch_media([s.tensors]))
    cache = DynamicCache(config=model.config.get_text_config())
    with torch.no_grad():
        steps = [model(**inputs, cache=cache, use_cache=True).logits[0, -1]]
        for k in range(prefix.shape[1], full.shape[1] - 1):
            position = torch.full((4, 1, 1), cache.get_seq_length()) + deltas.view(1, 1, 1) * torch.tensor(
                [0, 1, 1, 1]).view(4, 1, 1)
            out = model(input_ids=full[:, k:k + 1], attention_mask=torch.ones(1, k + 1, dtype=torch.long),
                        position_ids=position, cache=cache, use_cache=True)
            steps.append(out.logits[0, -1])
    got = torch.stack(steps).log_softmax(-1)
    torch.testing.assert_close(got, expected[prefix.shape[1] - 1:-1], atol=1e-4, rtol=0)


def test_freeze_keeps_encoders_out_of_the_gradients(tiny):
    _, model, processor = tiny
    towers = mm.towers(model)
    frozen = mm.freeze(model, vision=True, audio=True)
    try:
        s = _sample(processor, 0)
        ids = torch.tensor([s.input_ids])
        model(**mm.model_inputs(model, ids, torch.ones_like(ids), [s.tensors])).logits.logsumexp(-1).sum().backward()
        named = dict(model.named_parameters())
        assert frozen and all(named[n].grad is None for n in frozen)
        assert {n.split(".")[1] for n in frozen} == {t.split(".")[1] for t in towers.values()}
        assert named["lm_head.weight"].grad is not None
    finally:
        for n in frozen:
            model.get_parameter(n).requires_grad_(True)
        model.zero_grad(set_to_none=True)
