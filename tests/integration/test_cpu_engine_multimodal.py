"""The CPU engine serving multimodal requests (tiny Qwen3-VL and Qwen3-Omni thinker) as SGLang does.

What a user relies on: a `/generate` with the unexpanded prompt ids (one
placeholder per item) and `image_data` / `video_data` / `audio_data` data URIs
is answered with SGLang's response, `prompt_tokens` counting the expanded
prompt; its log-probs are the model's own (checked against a plain full
forward, computed here, of the expanded prompt + output with the processor's
tensors); multimodal and text rows decode in the same forward passes; a weight
update reaches the vision tower; bad media, a placeholder mismatch or media
sent to a text-only model get a 400 and the engine keeps serving.
"""

from __future__ import annotations

import asyncio
import io

import httpx
import numpy as np
import pytest
import torch
from engine_fixtures import EngineServer
from PIL import Image

from relax_core.data.media import MediaBounds, decode_audio, decode_image, decode_video, encode_data_uri
from relax_core.models import multimodal
from relax_core.models.tiny import materialize_tiny_model

# A random model samples media tokens too; a response stops at one, so that no media token is in the
# reference forward's input (a sampled image pad would be an image placeholder there).
MEDIA_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|audio_start|>",
                "<|audio_end|>", "<|audio_pad|>"]


class Served:
    """One engine server on a tiny model, with the reference model and processor."""

    def __init__(self, model_dir, server: EngineServer) -> None:
        self.server = server
        self.model = multimodal.load_policy(model_dir)
        self.processor = multimodal.load_processor(model_dir)
        vocab = self.processor.tokenizer.get_vocab()
        stop = [vocab[t] for t in MEDIA_TOKENS if t in vocab]
        self.greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "stop_token_ids": stop}
        self.sampled = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "stop_token_ids": stop}

    def prompt(self, text: str = "what is it?", **counts) -> tuple[str, list[int]]:
        return multimodal.chat_prompt(self.processor, text, **counts)

    def generate(self, body: dict, status: int = 200) -> dict | list:
        response = httpx.post(f"{self.server.base_url}/generate", json=body, timeout=120)
        assert response.status_code == status, response.text
        return response.json()

    def stats(self) -> dict:
        return httpx.get(f"{self.server.base_url}/get_model_info", timeout=10).json()["engine_stats"]

    def max_error(self, result: dict, text: str, images=(), videos=(), audios=()) -> float:
        """Largest |engine log-prob - full-forward log-prob| over the output; checks prompt_tokens too."""
        processed = multimodal.process(self.processor, text, list(images), list(videos), list(audios), 16000)
        assert result["meta_info"]["prompt_tokens"] == len(processed.input_ids)
        output = result["output_ids"]
        ids = torch.tensor([processed.input_ids + output[:-1]])
        inputs = multimodal.model_inputs(self.model, ids, torch.ones_like(ids), [processed.tensors])
        with torch.no_grad():
            logp = torch.log_softmax(self.model(**inputs).logits[0].float(), dim=-1)
        start = len(processed.input_ids) - 1
        expected = [logp[start + t, tok].item() for t, tok in enumerate(output)]
        got = [item[0] for item in result["meta_info"]["output_token_logprobs"]]
        assert [item[1] for item in result["meta_info"]["output_token_logprobs"]] == output
        return max(abs(a - b) for a, b in zip(got, expected))


def _serve(architecture: str, tmp_path_factory):
    model_dir = materialize_tiny_model(tmp_path_factory.mktemp(architecture), architecture=architecture, seed=0)
    with EngineServer(model_dir, tmp_path_factory.mktemp("logs") / f"{architecture}.log") as server:
        yield Served(model_dir, server)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    yield from _serve("qwen3_vl", tmp_path_factory)


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    yield from _serve("qwen3_omni", tmp_path_factory)


def image(seed: int, size=(64, 48)) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return encode_data_uri("image", Image.fromarray(pixels))


def video(frames: int = 8, fps: int = 4) -> str:
    """A small mp4 clip (moving gradient) written with PyAV."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for k in range(frames):
            ramp = (np.arange(64)[None, :, None] * 4 + k * 20) % 256
            rgb = np.broadcast_to(ramp, (64, 64, 3)).astype(np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")))
        container.mux(stream.encode())
    return encode_data_uri("video", buffer.getvalue())


def test_image_request_matches_a_full_forward(vl):
    text, ids = vl.prompt(n_images=1)
    uri = image(0)
    result = vl.generate({"input_ids": ids, "image_data": uri, "sampling_params": vl.sampled, "return_logprob": True})
    assert result["meta_info"]["prompt_tokens"] > len(ids)  # the expanded prompt
    assert vl.max_error(result, text, [decode_image(uri)]) < 1e-4


def test_a_batch_of_image_and_text_rows_decodes_together(vl):
    text, ids = vl.prompt(n_images=1)
    plain_text, plain_ids = vl.prompt("2+2=?")
    uris = [image(1), image(2, size=(96, 64))]
    before = vl.stats()
    results = vl.generate({
        "input_ids": [ids, ids, plain_ids, ids], "image_data": [[uris[0]], [uris[1]], None, [uris[0]]],
        "sampling_params": vl.sampled, "return_logprob": True,
    })  # fmt: skip
    after = vl.stats()
    # One admission: a text prefill, one per distinct image prompt (the repeat shares it), then every
    # decode step runs all rows still going.
    lengths = [len(r["output_ids"]) for r in results]
    assert after["decode_steps"] - before["decode_steps"] == max(lengths) - 1
    assert after["prefill_passes"] - before["prefill_passes"] == 3
    assert results[3]["meta_info"]["cached_tokens"] == results[3]["meta_info"]["prompt_tokens"]
    for result, uri in zip(results, [uris[0], uris[1], None, uris[0]]):
        if uri is None:
            assert vl.max_error(result, plain_text) < 1e-4
        else:
            assert vl.max_error(result, text, [decode_image(uri)]) < 1e-4


def test_concurrent_requests_with_different_images_each_match(vl):
    text, ids = vl.prompt(n_images=1)
    plain_text, plain_ids = vl.prompt("1+1=?")
    bodies = [{"input_ids": ids, "image_data": [image(3 + i)]} for i in range(2)] + [{"input_ids": plain_ids}]

    async def send_all():
        async with httpx.AsyncClient(base_url=vl.server.base_url, timeout=120) as client:
            responses = await asyncio.gather(*(
                client.post("/generate", json={**b, "sampling_params": vl.sampled, "return_logprob": True})
                for b in bodies))  # fmt: skip
        return [r.json() for r in responses]

    results = asyncio.run(send_all())
    for result, body in zip(results[:2], bodies):
        assert vl.max_error(result, text, [decode_image(body["image_data"][0])]) < 1e-4
    assert vl.max_error(results[2], plain_text) < 1e-4


def test_video_request_matches_a_full_forward(vl):
    text, ids = vl.prompt("what moves?", n_videos=1)
    uri = video()
    result = vl.generate({"input_ids": ids, "video_data": uri, "sampling_params": vl.greedy, "return_logprob": True})
    assert vl.max_error(result, text, videos=[decode_video(uri)]) < 1e-4


def test_text_input_with_an_image(vl):
    text, _ = vl.prompt(n_images=1)
    uri = image(7)
    result = vl.generate({"text": text, "image_data": [uri], "sampling_params": vl.greedy, "return_logprob": True})
    assert vl.max_error(result, text, [decode_image(uri)]) < 1e-4


def test_bad_media_and_placeholder_mismatch_get_400_and_the_engine_keeps_serving(vl):
    _, ids = vl.prompt(n_images=1)
    error = vl.generate({"input_ids": ids, "image_data": "data:image/png;base64,AAAA"}, status=400)
    assert "image_data[0]" in error["error"]["message"]
    error = vl.generate({"input_ids": [ids, ids], "image_data": [image(0), "data:image/png;base64,AAAA"]}, 400)
    assert "image_data[0] (item 1 of the batch)" in error["error"]["message"]
    error = vl.generate({"input_ids": ids, "image_data": [image(0), image(1)]}, status=400)
    assert "1 image placeholders but 2 image inputs" in error["error"]["message"]
    error = vl.generate({"input_ids": ids, "image_data": image(0), "audio_data": "x" * 100}, status=400)
    assert "takes no audio_data" in error["error"]["message"]
    assert vl.generate({"input_ids": ids, "image_data": image(0), "sampling_params": vl.greedy})["output_ids"]


def test_a_vision_tower_weight_update_changes_the_output(vl):
    from relax_core.rollout.weight_wire import serialize_named_tensors

    text, ids = vl.prompt(n_images=1)
    uri = image(9)
    body = {"input_ids": ids, "image_data": uri, "sampling_params": vl.greedy, "return_logprob": True}
    before = vl.generate(body)
    name = "model.visual.patch_embed.proj.weight"
    original = dict(vl.model.named_parameters())[name].detach().clone()
    changed = original + 0.5 * torch.randn(original.shape, generator=torch.Generator().manual_seed(0))

    def load(tensor: torch.Tensor) -> None:
        url = vl.server.base_url
        assert httpx.post(f"{url}/begin_weight_update", json={}, timeout=30).json()["success"]
        payload = serialize_named_tensors([(name, tensor)])
        answer = httpx.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": payload},
                            timeout=60).json()
        assert answer["success"], answer
        assert httpx.post(f"{url}/end_weight_update", timeout=30).json()["success"]

    load(changed)
    try:
        after = vl.generate(body)
        with torch.no_grad():
            dict(vl.model.named_parameters())[name].copy_(changed)
        assert vl.max_error(after, text, [decode_image(uri)]) < 1e-4
        first = [lp for lp, _, _ in before["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b[0]) for a, b in zip(first, after["meta_info"]["output_token_logprobs"])) > 1e-3
    finally:
        with torch.no_grad():
            dict(vl.model.named_parameters())[name].copy_(original)
        load(original)


def test_omni_answers_audio_and_an_image(omni):
    text, ids = omni.prompt(n_images=1, n_audios=1)
    wave = (0.3 * np.sin(np.arange(16000) * 2 * np.pi * 440 / 16000)).astype(np.float32)
    audio_uri, image_uri = encode_data_uri("audio", wave, 16000), image(11)
    result = omni.generate({"input_ids": ids, "image_data": [image_uri], "audio_data": [audio_uri],
                            "sampling_params": omni.sampled, "return_logprob": True})
    audio = decode_audio(audio_uri, MediaBounds(audio_sample_rate=16000))
    assert omni.max_error(result, text, [decode_image(image_uri)], audios=[audio]) < 1e-4
    error = omni.generate({"input_ids": ids, "image_data": [image_uri], "audio_data": ["data:audio/wav;base64,AAAA"]},
                          status=400)
    assert "audio_data[0]" in error["error"]["message"]


def test_a_text_only_model_refuses_media(engine):
    response = httpx.post(f"{engine.base_url}/generate", json={"input_ids": [5, 6], "image_data": image(0)},
                          headers={"Authorization": f"Bearer {engine.api_key}"}, timeout=60)
    assert response.status_code == 400 and "text-only" in response.json()["error"]["message"]
