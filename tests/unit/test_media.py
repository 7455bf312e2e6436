"""Media of multimodal data sets: every value form a data set or an SGLang request uses decodes, the
recipe's bounds act, a bad value names its row, column and file, `relax validate` refuses a data set
whose media will not decode (exit 2, nothing written), and the synthetic generators write data sets
that load back with their media beside the metadata, not in it."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile
import yaml
from PIL import Image

from relax_core.config.data import FileData
from relax_core.data import media
from relax_core.data.media import MediaBounds, MediaError, RowMedia, decode_audio, decode_image, decode_video
from relax_core.data.prompts import build_prompt_source, media_problems
from relax_core.data.synthetic_media import COLOURS, write_color_images, write_tone_pairs, write_video

REPO = Path(__file__).resolve().parents[2]
RED = (220, 30, 30)


def png(colour=RED, size=(8, 6)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def wav(seconds: float, rate: int) -> bytes:
    buffer = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    soundfile.write(buffer, (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


def ramp_video(path: Path, n_frames: int = 30, fps: int = 10) -> Path:
    """Frame i has brightness 8 i: the decoded frames tell which ones were taken."""
    return write_video(path, np.stack([np.full((32, 48, 3), 8 * i, np.uint8) for i in range(n_frames)]), fps)


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def served(data: FileData) -> list[dict]:
    source = build_prompt_source(data)
    return source.next_batch(len(source.rows))


# ------------------------------------------------------------------ value forms
def test_every_value_form_of_a_data_set_decodes(tmp_path, monkeypatch):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png((0, 0, 255)))
    uri = "data:image/png;base64," + base64.b64encode(png((0, 255, 0))).decode()
    rows = [{"prompt": "p", "label": "l", "image": "imgs/a.png"},  # relative to the data file
            {"prompt": "p", "label": "l", "image": ["imgs/a.png", uri]},
            {"prompt": "p", "label": "l", "image": uri},
            {"prompt": "p", "label": "l", "image": {"bytes": None, "path": "imgs/a.png"}},
            {"prompt": "p", "label": "l", "image": None}]  # a text-only row
    data = FileData(path=str(jsonl(tmp_path / "d.jsonl", rows)), image_key="image", shuffle=False)
    monkeypatch.chdir("/")  # nothing depends on the working folder
    colours = [[image.getpixel((0, 0)) for image in media.row_media(item["media"], MediaBounds()).images]
               for item in served(data)]
    assert colours == [[(0, 0, 255)], [(0, 0, 255), (0, 255, 0)], [(0, 255, 0)], [(0, 0, 255)], []]


def test_parquet_records_with_embedded_bytes_decode_and_stay_out_of_metadata(tmp_path):
    """The `{bytes, path}` struct Hugging Face `datasets` writes for Image/Audio features, raw bytes too."""
    table = pa.table({"problem": ["q0", "q1"], "solution": ["A", "B"],
                      "image": [{"bytes": png(), "path": "not/here.png"}, {"bytes": png((1, 2, 3)), "path": None}],
                      "audio": [wav(0.5, 8000), wav(0.25, 8000)]})
    pq.write_table(table, tmp_path / "train.parquet")
    data = FileData(path=str(tmp_path / "train.parquet"), prompt_key="problem", label_key="solution",
                    image_key="image", audio_key="audio", audio_sample_rate=16000, shuffle=False)
    items = served(data)
    assert [item["metadata"] for item in items] == [{}, {}]
    decoded = [media.row_media(item["media"], MediaBounds.from_data(data)) for item in items]
    assert [m.images[0].getpixel((0, 0)) for m in decoded] == [RED, (1, 2, 3)]
    assert [m.audios[0].shape for m in decoded] == [(8000,), (4000,)] and decoded[0].audio_sample_rate == 16000
    json.dumps([item["metadata"] for item in items])  # what travels as JSON holds no bytes


def test_hf_audio_array_records_decode():
    record = {"array": [0.0, 0.5, -0.5, 0.25] * 100, "sampling_rate": 8000, "path": None}
    samples = decode_audio(record, MediaBounds(audio_sample_rate=16000))
    assert samples.dtype == np.float32 and samples.shape == (800,)


def test_media_files_are_read_when_the_rows_load(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    data = FileData(path=str(jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "label": "l", "image": "a.png"}])),
                    image_key="image")
    source = build_prompt_source(data)
    (tmp_path / "a.png").unlink()  # a network file system that went away
    [item] = source.next_batch(1)
    assert item["media"]["image"][0]["path"] == str((tmp_path / "a.png").resolve())
    assert media.row_media(item["media"], MediaBounds()).images[0].getpixel((0, 0)) == RED


def test_a_recipe_without_media_keys_serves_no_media(tmp_path):
    data = FileData(path=str(jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "label": "l", "image": "x.png"}])))
    [item] = served(data)
    assert item["media"] is None and item["metadata"] == {"image": "x.png"}
    assert media.row_media(None, MediaBounds()) == RowMedia()


@pytest.mark.parametrize("kind", ["image", "audio", "video"])
def test_request_strings_decode_like_sglang_takes_them(tmp_path, kind):
    """A data URI, plain base64, a local path and a file:// URL (SGLang's forms); a URL is refused."""
    if kind == "image":
        decode, payload, check = decode_image, png(), lambda image: image.getpixel((0, 0)) == RED
    elif kind == "audio":
        decode, payload, check = decode_audio, wav(0.5, 16000), lambda samples: samples.shape == (8000,)
    else:
        payload = ramp_video(tmp_path / "v.mp4").read_bytes()
        decode, check = decode_video, lambda video: len(video.frames) == 6
    (tmp_path / "f").write_bytes(payload)
    plain = base64.b64encode(payload).decode()
    for value in (f"data:application/octet-stream;base64,{plain}", plain, str(tmp_path / "f"),
                  f"file://{tmp_path / 'f'}", payload):
        assert check(decode(value))
    with pytest.raises(MediaError, match="URL"):
        decode("https://example.com/x")


def test_encoded_data_uris_decode_to_the_same_media(tmp_path):
    image = Image.new("RGB", (5, 4), (9, 8, 7))
    assert media.encode_data_uri("image", image).startswith("data:image/png;base64,")
    assert decode_image(media.encode_data_uri("image", image)).tobytes() == image.tobytes()
    samples = np.linspace(-1, 1, 1600, dtype=np.float32)
    uri = media.encode_data_uri("audio", samples, sample_rate=16000)
    assert uri.startswith("data:audio/wav;base64,") and np.array_equal(decode_audio(uri), samples)
    video = decode_video(ramp_video(tmp_path / "v.mp4"))
    uri = media.encode_data_uri("video", video)
    assert uri.startswith("data:video/mp4;base64,") and base64.b64decode(uri.split(",")[1]) == video.data
    fields = media.encode_request_media(RowMedia([image], [video], [samples], 16000))
    assert decode_image(fields["image_data"][0]).tobytes() == image.tobytes()
    assert fields["video_data"] == [uri] and np.array_equal(decode_audio(fields["audio_data"][0]), samples)
    assert media.encode_request_media(RowMedia([image])) == {"image_data": [media.encode_data_uri("image", image)]}


# ------------------------------------------------------------------ bounds
def brightness(video) -> list[int]:
    return [round(float(frame.mean()) / 8) for frame in video.frames]


def test_video_frames_follow_fps_and_the_frame_bounds(tmp_path):
    clip = ramp_video(tmp_path / "v.mp4", n_frames=30, fps=10)  # 3 s
    video = decode_video(clip, MediaBounds.from_data(FileData(path="d", video_fps=2.0)))
    assert video.frames.shape == (6, 32, 48, 3) and video.frames.dtype == np.uint8
    assert brightness(video) == video.indices == [0, 5, 10, 15, 20, 25]
    assert video.fps == 2.0 and video.timestamps == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert (video.source_fps, video.total_frames) == (10.0, 30)
    slow = MediaBounds.from_data(FileData(path="d", video_fps=1.0, video_min_frames=1))
    assert brightness(decode_video(clip, slow)) == [0, 10, 20]
    many = decode_video(clip, MediaBounds.from_data(FileData(path="d", video_min_frames=8)))
    assert brightness(many) == many.indices == [0, 4, 8, 12, 17, 21, 25, 29]  # spread over the whole clip
    few = decode_video(clip, MediaBounds.from_data(FileData(path="d", video_min_frames=1, video_max_frames=3)))
    assert brightness(few) == few.indices == [0, 14, 29] and few.fps == pytest.approx(20 / 29)
    short = decode_video(ramp_video(tmp_path / "s.mp4", n_frames=3, fps=10))  # fewer frames than video_min_frames
    assert short.indices == [0, 1, 2]


def test_audio_is_resampled_and_refused_over_its_longest(tmp_path):
    clip = wav(2.0, 44100)
    samples = decode_audio(clip, MediaBounds.from_data(FileData(path="d", audio_sample_rate=16000)))
    assert samples.shape == (32000,) and samples.dtype == np.float32
    spectrum = np.abs(np.fft.rfft(samples))
    assert np.argmax(spectrum) / 2.0 == pytest.approx(440, abs=1)  # the tone survives resampling
    assert MediaBounds.from_data(FileData(path="d"), audio_sample_rate=24000).audio_sample_rate == 24000
    stereo = io.BytesIO()
    soundfile.write(stereo, np.stack([np.ones(800), -np.ones(800)], axis=1) * 0.5, 8000, format="WAV")
    assert np.allclose(decode_audio(stereo.getvalue(), MediaBounds(audio_sample_rate=8000)), 0, atol=1e-4)
    with pytest.raises(MediaError, match=r"lasts 2.00 s, longer than data.audio_max_seconds \(1.5 s\)"):
        decode_audio(clip, MediaBounds.from_data(FileData(path="d", audio_max_seconds=1.5)))


def test_images_are_scaled_into_the_pixel_bounds():
    big, small = png(size=(400, 200)), png(size=(20, 10))
    assert decode_image(big).size == (400, 200)  # no bound: left to the processor
    bounds = MediaBounds.from_data(FileData(path="d", image_min_pixels=800, image_max_pixels=20000))
    scaled = decode_image(big, bounds)
    assert scaled.size == (200, 100) and scaled.mode == "RGB"
    assert decode_image(small, bounds).size == (40, 20)
    rgba = io.BytesIO()
    Image.new("RGBA", (4, 4), (1, 2, 3, 255)).save(rgba, format="PNG")
    assert decode_image(rgba.getvalue()).mode == "RGB"


@pytest.mark.parametrize(("fields", "words"), [
    ({"image_min_pixels": 100, "image_max_pixels": 10}, "image_min_pixels (100) must not exceed image_max_pixels"),
    ({"video_min_frames": 9, "video_max_frames": 3}, "video_min_frames (9) must not exceed video_max_frames"),
    ({"video_fps": 0}, "video_fps"),
    ({"audio_max_seconds": -1}, "audio_max_seconds"),
])
def test_bounds_that_contradict_are_refused(fields, words):
    with pytest.raises(ValueError, match=re_escape(words)):
        FileData(path="d", **fields)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


# ------------------------------------------------------------------ bad media
def test_bad_media_name_the_row_column_and_file(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not an image")
    rows = [{"prompt": "p", "label": "l", "pic": "bad.png"}, {"prompt": "p", "label": "l", "pic": "gone.png"}]
    data = FileData(path=str(jsonl(tmp_path / "d.jsonl", rows)), image_key="pic", shuffle=False)
    with pytest.raises(MediaError, match=f"row 1, column 'pic': file '{tmp_path / 'gone.png'}' does not exist"):
        build_prompt_source(data)
    source = build_prompt_source(FileData(path=str(jsonl(tmp_path / "d.jsonl", rows[:1])), image_key="pic"))
    with pytest.raises(MediaError, match=f"row 0, column 'pic': '{tmp_path / 'bad.png'}' is not an image"):
        media.row_media(source.next_batch(1)[0]["media"], MediaBounds())
    with pytest.raises(MediaError, match="is not a video"):
        decode_video(b"\x00" * 100, where="request video_data[0]")
    with pytest.raises(MediaError, match="request audio_data"):
        decode_audio(b"\x00" * 100, where="request audio_data[0]")


# ------------------------------------------------------------------ relax validate
def relax_validate(tmp_path: Path, data: dict, base: str = "quickstart_omni.yaml",
                   **changes) -> subprocess.CompletedProcess:
    recipe = yaml.safe_load((REPO / "recipes" / base).read_text()) | {"data": data} | changes
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    env = os.environ | {"COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "relax_cli.main", "validate", str(tmp_path / "recipe.yaml")],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)


def test_validate_refuses_media_that_will_not_decode_and_writes_nothing(tmp_path):
    (tmp_path / "ok.png").write_bytes(png())
    (tmp_path / "bad.png").write_bytes(png()[:30])  # cut short
    (tmp_path / "long.wav").write_bytes(wav(3.0, 8000))
    rows = [{"prompt": "ab", "label": "ab", "image": "ok.png", "audio": None},
            {"prompt": "ab", "label": "ab", "image": "missing.png"},
            {"prompt": "ab", "label": "ab", "image": ["ok.png", "bad.png"], "audio": "long.wav"}]
    path = jsonl(tmp_path / "d.jsonl", rows)
    before = sorted(tmp_path.rglob("*"))
    proc = relax_validate(tmp_path, {"path": str(path), "image_key": "image", "audio_key": "audio",
                                     "audio_max_seconds": 2})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    err = " ".join(proc.stderr.split())  # rich wraps long lines
    assert f"row 1, column 'image': file '{tmp_path / 'missing.png'}' does not exist" in err
    assert f"row 2, column 'image': '{tmp_path / 'bad.png'}' is not an image" in err
    assert f"row 2, column 'audio': audio '{tmp_path / 'long.wav'}' lasts 3.00 s" in err
    assert "ok.png" not in err and "3 problem(s)" in err
    tmp_path.joinpath("recipe.yaml").unlink()
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


def test_the_media_key_is_what_makes_validate_look_at_the_files(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "label": "ab", "image": "missing.png"}])
    refused = relax_validate(tmp_path, {"path": str(path), "image_key": "image"})
    assert refused.returncode == 2 and "missing.png" in refused.stderr
    accepted = relax_validate(tmp_path, {"path": str(path)})
    assert accepted.returncode == 0, accepted.stderr


def test_the_problem_list_is_capped_and_names_a_column_no_row_has(tmp_path):
    rows = [{"prompt": "p", "label": "l", "image": f"m{i}.png"} for i in range(25)]
    path = jsonl(tmp_path / "d.jsonl", rows)
    problems = media_problems(FileData(path=str(path), image_key="image"))
    assert len(problems) == 11 and problems[-1] == "... and 15 more media problem(s)"
    assert media_problems(FileData(path=str(path), video_key="clip")) == [
        "data.video_key: no row has a column 'clip'"]
    assert media_problems(FileData(path=str(tmp_path / "elsewhere.jsonl"), image_key="image")) == []


def test_a_hub_data_set_not_downloaded_is_left_to_the_run():
    assert media_problems(FileData(source="hub", path="nobody/not-downloaded", image_key="image")) == []


# ------------------------------------------------------------------ synthetic data sets
def test_color_images_load_back_in_the_open_r1_schema(tmp_path):
    from relax_core.rewards.openr1mm import openr1mm

    path = write_color_images(tmp_path, n_rows=8, seed=1)
    assert pq.read_schema(path).names == ["image", "problem", "solution", "original_question", "original_answer"]
    data = FileData(path=str(path), prompt_key="problem", label_key="solution", image_key="image")
    assert media_problems(data) == []
    items = served(data)
    assert all("image" not in item["metadata"] for item in items)
    letters = {item["label"]: set() for item in items}
    for item in items:
        image = media.row_media(item["media"], MediaBounds()).images[0]
        letters[item["label"]].add(image.getpixel((10, 10)))
        assert openr1mm(f"<think>x</think><answer>{item['label'][9]}</answer>", item["label"])["accuracy"] == 1.0
    assert sorted(letters) == [f"<answer> {letter} </answer>" for letter in "ABCD"]
    assert {next(iter(c)) for c in letters.values()} == set(COLOURS.values())  # one colour per answer
    assert all(len(c) == 1 for c in letters.values())


def test_tone_pairs_load_back_and_the_audio_tells_the_answer(tmp_path):
    from relax_core.rewards.choice import multiple_choice

    path = write_tone_pairs(tmp_path, n_rows=6, seed=2, sample_rate=16000)
    recipe = yaml.safe_load((REPO / "recipes" / "omni_avqa.yaml").read_text())["data"]
    data = FileData(**(recipe | {"path": str(path)}))
    assert media_problems(data) == []
    for item in served(data):
        assert set(item["metadata"]) == set()
        decoded = media.row_media(item["media"], MediaBounds.from_data(data))
        assert len(decoded.images) == 1 and decoded.audio_sample_rate == 16000
        halves = np.split(decoded.audios[0], 2)
        pitch = [np.argmax(np.abs(np.fft.rfft(half))) for half in halves]
        assert ("A" if pitch[1] > pitch[0] else "B") == item["label"]
        assert multiple_choice(item["label"], item["label"]) == 1.0


def test_the_engine_never_samples_a_media_marker_and_reports_the_models_own_logprob():
    import torch

    from relax_core.rollout.cpu_engine.sampling import RowSampling, sample_next

    logits = torch.tensor([[0.0, 5.0, 4.0, 0.5]] * 64)  # token 1 would win most draws
    rows = [RowSampling(1.0, -1, 1.0, 0.0, False, torch.Generator().manual_seed(i)) for i in range(64)]
    free, _ = sample_next(logits, rows)
    tokens, logprobs = sample_next(logits, [RowSampling(1.0, -1, 1.0, 0.0, False, torch.Generator().manual_seed(i))
                                            for i in range(64)], banned=[1])
    assert 1 in free and 1 not in tokens
    full = torch.log_softmax(logits[0], -1)
    assert all(abs(lp - full[t].item()) < 1e-6 for t, lp in zip(tokens, logprobs))


def test_media_columns_need_a_model_that_reads_them(tmp_path):
    (tmp_path / "ok.png").write_bytes(png())
    (tmp_path / "ok.wav").write_bytes(wav(1.0, 16000))
    path = jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "label": "ab", "image": "ok.png", "audio": "ok.wav"}])
    data = {"path": str(path), "image_key": "image", "audio_key": "audio"}
    assert relax_validate(tmp_path, data).returncode == 0  # the Omni thinker reads both
    text = relax_validate(tmp_path, data, base="quickstart.yaml")
    assert text.returncode == 2 and "data.image_key: model.architecture is a text-only model" in text.stderr
    vl = relax_validate(tmp_path, data, base="quickstart_vlm.yaml")
    assert vl.returncode == 2 and "data.audio_key: model.architecture is a Qwen3-VL model" in flat(vl.stderr)
    ppo = relax_validate(tmp_path, data, algorithm={"name": "ppo", "critic": {"lr": 1e-5}})
    assert ppo.returncode == 2 and "algorithm.critic: a critic (value model) on data with media" in flat(ppo.stderr)


def flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines
