"""Small multimodal data sets written locally, in the schemas of the real ones (quick starts, tests).

- `write_color_images`: a parquet file in the schema of lmms-lab/multimodal-open-r1-8k-verified
  (`image` as a `{bytes, path}` record with PNG bytes, `problem`, `solution` as `<answer> X </answer>`,
  `original_question`, `original_answer`), read by recipes like vlm_openr1_qwen3vl_4b.yaml. Each image
  is filled with one of four colours and the problem asks which, with the options in a fixed order:
  a task a tiny random model can learn from the pixels alone.
- `write_tone_pairs`: a JSONL file in the schema of recipes/omni_avqa.yaml (`problem`, `solution`,
  `image`, `audio`; the media as paths relative to the file), whose answer only the audio tells: two
  tones in sequence, and whether the second is higher.
- `write_video`: a clip from frames with PyAV (H.264 in mp4, MPEG-4 Part 2 where no H.264 encoder is built).

Rows are balanced over the answers and shuffled by `seed`.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (30, 60, 220), "yellow": (235, 215, 40)}
LETTERS = "ABCD"
COLOUR_PROBLEM = ("What colour fills the image?\n" +
                  "\n".join(f"{letter}. {name}" for letter, name in zip(LETTERS, COLOURS)) +
                  "\nAnswer with the option's letter.")
TONE_PROBLEM = ("You hear two tones, one after the other. Is the second tone higher than the first?\n"
                "A. yes\nB. no\nAnswer with the option's letter.")
TONES_HZ = (330.0, 660.0)


def write_color_images(folder: str | Path, n_rows: int = 64, seed: int = 0, size: int = 64) -> Path:
    """`folder/train-00000-of-00001.parquet`: `n_rows` one-colour images of `size` x `size` pixels."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, answer in enumerate(_balanced(n_rows, len(COLOURS), seed)):
        buffer = io.BytesIO()
        Image.new("RGB", (size, size), list(COLOURS.values())[answer]).save(buffer, format="PNG")
        letter = LETTERS[answer]
        rows.append({"image": {"bytes": buffer.getvalue(), "path": f"{i:05d}.png"}, "problem": COLOUR_PROBLEM,
                     "solution": f"<answer> {letter} </answer>", "original_question": COLOUR_PROBLEM,
                     "original_answer": f"Answer: {letter}"})
    schema = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                        ("problem", pa.string()), ("solution", pa.string()),
                        ("original_question", pa.string()), ("original_answer", pa.string())])
    path = folder / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def write_tone_pairs(folder: str | Path, n_rows: int = 32, seed: int = 0, sample_rate: int = 16000,
                     seconds: float = 1.0, image_size: int = 32) -> Path:
    """`folder/train.jsonl` with `audio/NNNNN.wav` (two tones of `seconds / 2` each) and `images/NNNNN.png`
    (a grey square that tells nothing); the solution is `A` (the second tone is higher) or `B`."""
    import numpy as np
    import soundfile
    from PIL import Image

    folder = Path(folder)
    (folder / "audio").mkdir(parents=True, exist_ok=True)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    half = np.arange(int(sample_rate * seconds / 2)) / sample_rate
    lines = []
    for i, answer in enumerate(_balanced(n_rows, 2, seed)):
        low, high = TONES_HZ
        first, second = (low, high) if answer == 0 else (high, low)
        tones = np.concatenate([0.5 * np.sin(2 * np.pi * hz * half) for hz in (first, second)])
        soundfile.write(folder / "audio" / f"{i:05d}.wav", tones.astype(np.float32), sample_rate, subtype="PCM_16")
        Image.new("RGB", (image_size, image_size), (128, 128, 128)).save(folder / "images" / f"{i:05d}.png")
        lines.append(json.dumps({"problem": TONE_PROBLEM, "solution": LETTERS[answer],
                                 "image": f"images/{i:05d}.png", "audio": f"audio/{i:05d}.wav"}))
    path = folder / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_video(path: str | Path, frames, fps: int) -> Path:
    """A clip of `frames` (uint8 [T, H, W, 3], even H and W) at `fps` frames per second."""
    import av

    path = Path(path)
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    return path


def _balanced(n_rows: int, n_answers: int, seed: int) -> list[int]:
    answers = [i % n_answers for i in range(n_rows)]
    random.Random(seed).shuffle(answers)
    return answers
