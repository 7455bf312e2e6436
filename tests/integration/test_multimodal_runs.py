"""`relax submit` on data sets with media, written here in the schemas of the real ones.

- a parquet file in multimodal-open-r1-8k-verified's schema (images embedded as `{bytes, path}`) trains
  2 steps of a tiny Qwen3-VL; a row whose image expands past `rollout.max_prompt_len` is skipped, named
  in the log, and the run goes on;
- a JSONL in the omni recipe's schema (image and audio paths), with a video column too (an mp4 written
  here), trains 2 steps of a tiny Qwen3-Omni thinker in `fully_async` (the processor's tensors travel
  through TransferQueue) with 2 media worker processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
QUICKSTART_VLM = yaml.safe_load((REPO / "recipes" / "quickstart_vlm.yaml").read_text())
QUICKSTART_OMNI = yaml.safe_load((REPO / "recipes" / "quickstart_omni.yaml").read_text())


def submit(recipe: dict, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    path = cwd / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = os.environ | {"COLUMNS": "200", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "relax_cli.main", "submit", str(path), "--executor", "local",
                           "--run-dir", "runs/mm", *overrides], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def steps_of(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_parquet_in_the_openr1_schema_trains_and_an_oversize_image_is_skipped(tmp_path):
    import io

    import pyarrow.parquet as pq
    from PIL import Image

    from relax_core.data.synthetic_media import write_color_images

    path = write_color_images(tmp_path / "openr1", n_rows=8, seed=1)
    rows = pq.read_table(path).to_pylist()
    big = io.BytesIO()
    Image.new("RGB", (128, 128), (200, 0, 0)).save(big, format="PNG")  # 16 image tokens instead of 4
    rows[0]["image"] = {"bytes": big.getvalue(), "path": "big.png"}
    pq.write_table(pq.read_table(path).from_pylist(rows, schema=pq.read_schema(path)), path)
    recipe = QUICKSTART_VLM | {
        "data": {"source": "file", "path": str(path), "prompt_key": "problem", "label_key": "solution",
                 "image_key": "image", "shuffle": False},
        "train": QUICKSTART_VLM["train"] | {"steps": 2},
        "rollout": QUICKSTART_VLM["rollout"] | {"prompts_per_step": 4, "n_samples_per_prompt": 2,
                                                # the colour question is 120 tokens with a 64x64 image, 132 with 128x128
                                                "max_prompt_len": 125},
    }
    proc = submit(recipe, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "mm"
    assert steps_of(run) == [1, 2]
    log = (run / "logs" / "driver.log").read_text()
    assert "skipped a prompt" in log and "rollout.max_prompt_len=125" in log, log[-2000:]


@pytest.mark.full(covered_by="tests/integration/test_multimodal_runs.py::test_a_parquet_in_the_openr1_schema_trains_and_an_oversize_image_is_skipped")
def test_a_jsonl_in_the_omni_schema_with_a_video_trains_fully_async(tmp_path):
    from relax_core.data.synthetic_media import write_tone_pairs, write_video

    path = write_tone_pairs(tmp_path / "avqa", n_rows=4, seed=2)
    frames = np.stack([np.full((32, 32, 3), 40 * k, dtype=np.uint8) for k in range(4)])
    write_video(path.parent / "clip.mp4", frames, fps=4)
    lines = [json.loads(line) | {"video": "clip.mp4"} for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    recipe = QUICKSTART_OMNI | {
        "data": {"source": "file", "path": str(path), "prompt_key": "problem", "label_key": "solution",
                 "image_key": "image", "audio_key": "audio", "video_key": "video", "video_fps": 4.0},
        "train": QUICKSTART_OMNI["train"] | {"steps": 2},
        "rollout": QUICKSTART_OMNI["rollout"] | {"prompts_per_step": 2, "n_samples_per_prompt": 2,
                                                 "max_prompt_len": 500, "media_workers": 2},
    }
    proc = submit(recipe, tmp_path, "mode=fully_async")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert steps_of(tmp_path / "runs" / "mm") == [1, 2]
