"""Media values of a data set: read when the rows load, decoded where a row is used.

A media column (`data.image_key`, `video_key`, `audio_key`) holds per row one value, a list of
them (several images), or null (a text-only row). A value is a path (relative to the data file's
folder), raw bytes, a data URI (`data:image/png;base64,...`), or the record Hugging Face
`datasets` stores in parquet for its Image/Audio/Video features: `{"bytes", "path"}` (the bytes
win when present) or, for audio, `{"array", "sampling_rate"}`. `read_value` turns a column's value
into records held in memory when the rows load: `{"bytes", "path"}` with the path absolute (kept to
name the file in messages), or `{"array", "sampling_rate"}`. No file handle outlives the load: lazy
handles break on network file systems and do not travel to worker processes.

Decoding happens where the row is used (the rollout's workers), with the library made for each
kind: Pillow for images (RGB, resized into the pixel bounds), PyAV for video (frames sampled at
`video_fps` within the frame bounds), soundfile for audio (PyAV for the containers it cannot read;
mono float32 at the sample rate, refused above `audio_max_seconds`). `row_media` decodes the media
entry of a served row (built by `RowSource`, prompts.py). The same decoders take the strings of
SGLang requests (`image_data`, `audio_data`, `video_data`): a data URI, plain base64 or a local
path (`file://` too), the forms SGLang's own loaders accept, but never a URL (compute nodes have no
network). `encode_data_uri` makes such strings, `encode_request_media` a row's request fields.
`check_value` is the cheap check `relax validate` runs on every value before a run starts.

Every failure is a `MediaError` that names where the value sits (row and column, or request field)
and the file or the problem.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from relax_core.errors import UserError

KINDS = ("image", "video", "audio")
DEFAULT_SAMPLE_RATE = 16000  # SGLang's load_audio default, and the rate of Whisper-style feature extractors
# Leading bytes of the containers a data URI names (anything else is sent as application/octet-stream).
_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
          (b"BM", "image/bmp"), (b"fLaC", "audio/flac"), (b"OggS", "audio/ogg"), (b"ID3", "audio/mpeg"),
          (b"\x1a\x45\xdf\xa3", "video/webm"))


class MediaError(UserError):
    """A media value that cannot be read or decoded; the message names the row, column and file."""


@dataclass(frozen=True)
class MediaBounds:
    """How media are decoded: the recipe's `data.*` bounds (see `FileData` for each)."""

    image_min_pixels: int | None = None
    image_max_pixels: int | None = None
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768
    audio_sample_rate: int = DEFAULT_SAMPLE_RATE
    audio_max_seconds: float | None = None

    @classmethod
    def from_data(cls, data, audio_sample_rate: int | None = None) -> MediaBounds:
        """The bounds of a `FileData`; `audio_sample_rate` (the processor's) stands in for a null
        `data.audio_sample_rate`, and 16 kHz for both."""
        rate = data.audio_sample_rate or audio_sample_rate or DEFAULT_SAMPLE_RATE
        return cls(data.image_min_pixels, data.image_max_pixels, data.video_fps, data.video_min_frames,
                   data.video_max_frames, rate, data.audio_max_seconds)


@dataclass
class Video:
    """Frames sampled from a clip: `timestamps[k] = indices[k] / source_fps` seconds."""

    frames: Any
    """uint8 array [T, H, W, 3] (RGB)."""
    fps: float
    """Frames per second of video time actually sampled (`video_fps`, unless the bounds changed it)."""
    timestamps: list[float]
    indices: list[int] = field(default_factory=list)
    """Index of each frame in the clip (with `source_fps` and `total_frames`: a processor's video metadata)."""
    source_fps: float | None = None
    total_frames: int | None = None
    data: bytes | None = field(default=None, repr=False)
    """The container's bytes (mp4, ...), what an SGLang request carries."""


@dataclass
class RowMedia:
    """The decoded media of one row, in column order."""

    images: list = field(default_factory=list)
    """PIL images, RGB."""
    videos: list[Video] = field(default_factory=list)
    audios: list = field(default_factory=list)
    """Mono float32 arrays at `audio_sample_rate`."""
    audio_sample_rate: int | None = None
    """Rate of `audios` (None without audio)."""


# ------------------------------------------------------------------ reading (when rows load)
def read_value(value: Any, base_dir: Path, where: str) -> list[dict[str, Any]]:
    """A column's value as records held in memory, one per image, clip or sound (none for null).

    Args:
        value: a path (str or Path), bytes, data URI, `{"bytes", "path"}` or `{"array", "sampling_rate"}` record,
            or a list of them.
        base_dir: folder relative paths start from (the data file's).
        where: names the value in errors, e.g. "data: row 3, column 'image'".
    """
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [record for item in value for record in read_value(item, base_dir, where)]
    if isinstance(value, dict):
        return [_read_record(value, base_dir, where)]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return [{"bytes": bytes(value), "path": None}]
    if isinstance(value, (str, Path)):
        return [_read_string(str(value), base_dir, where, base64_ok=False)]
    raise MediaError(f"{where}: a {type(value).__name__} is not a media value (a path, bytes, a data URI, "
                     "a {bytes, path} record, or a list of them)")


def _read_record(value: dict, base_dir: Path, where: str) -> dict[str, Any]:
    if value.get("array") is not None:
        import numpy as np

        if not value.get("sampling_rate"):
            raise MediaError(f"{where}: an audio array record needs its sampling_rate")
        return {"array": np.asarray(value["array"], dtype=np.float32), "sampling_rate": int(value["sampling_rate"])}
    if value.get("bytes") is not None:
        return {"bytes": bytes(value["bytes"]), "path": value.get("path")}
    if value.get("path"):
        return _read_string(str(value["path"]), base_dir, where, base64_ok=False)
    raise MediaError(f"{where}: a record with neither bytes, a path nor an audio array")


def _read_string(text: str, base_dir: Path, where: str, base64_ok: bool) -> dict[str, Any]:
    """A data URI, a `file://` URL or a path; plain base64 too where `base64_ok` (SGLang requests)."""
    if text.startswith("data:"):
        return {"bytes": _b64(text.partition(",")[2], where, "a data URI whose payload is not base64"), "path": None}
    if text.startswith(("http://", "https://")):
        raise MediaError(f"{where}: '{text[:80]}' is a URL, and Relax fetches nothing from the network (compute "
                         "nodes have none); download the file and give its local path")
    path = Path(unquote(urlparse(text).path) if text.startswith("file://") else text).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if _is_file(path):
        try:
            return {"bytes": path.read_bytes(), "path": str(path.resolve())}
        except OSError as exc:
            raise MediaError(f"{where}: file '{path}' cannot be read: {exc}") from None
    if base64_ok and not text.startswith("file://") and len(text) > 64:
        return {"bytes": _b64(text, where, "neither a local file nor base64"), "path": None}
    raise MediaError(f"{where}: file '{path}' does not exist")


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long: base64 text, not a path
        return False


def _b64(text: str, where: str, problem: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{where}: '{text[:40]}...' is {problem}") from None


def _record(value: Any, where: str) -> dict[str, Any]:
    """One record from a record, bytes, or a request string (data URI, base64 or local path)."""
    if isinstance(value, str):
        return _read_string(value, Path.cwd(), where, base64_ok=True)
    records = read_value(value, Path.cwd(), where)
    if len(records) != 1:
        raise MediaError(f"{where}: expected one media value, got {len(records)}")
    return records[0]


def _bytes(record: dict[str, Any], kind: str, where: str) -> bytes:
    if record.get("bytes") is None:
        raise MediaError(f"{where}: an audio array is not {'an' if kind == 'image' else 'a'} {kind}")
    return record["bytes"]


def _named(record: dict[str, Any]) -> str:
    return f"'{record['path']}'" if record.get("path") else "the value"


# ------------------------------------------------------------------ decoding (where rows are used)
def row_media(entry: dict[str, Any] | None, bounds: MediaBounds, row_index: int | None = None) -> RowMedia:
    """Decode a served row's `media` entry (prompts.py `RowSource`; None for a text-only recipe).

    The entry is `{"row": index, "columns": {kind: column}, kind: [records]}` for the kinds the recipe
    names; the records come from `read_value` (raw values are read here, relative to the working folder).
    `row_index` names the row in errors where the entry does not.
    """
    if not entry:
        return RowMedia()
    decoders = {"image": decode_image, "video": decode_video, "audio": decode_audio}
    decoded: dict[str, list] = {kind: [] for kind in KINDS}
    for kind, column in entry["columns"].items():
        where = f"data: row {entry.get('row', row_index)}, column '{column}'"
        decoded[kind] = [decoders[kind](record, bounds, where) for record in read_value(entry[kind], Path.cwd(), where)]
    return RowMedia(decoded["image"], decoded["video"], decoded["audio"],
                    bounds.audio_sample_rate if decoded["audio"] else None)


def decode_image(value: Any, bounds: MediaBounds | None = None, where: str = "image"):
    """A PIL image in RGB, resized (aspect ratio kept) into `image_min_pixels`..`image_max_pixels`."""
    from PIL import Image

    record = _record(value, where)
    try:
        with Image.open(io.BytesIO(_bytes(record, "image", where))) as image:
            image.load()
            rgb = image.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"{where}: {_named(record)} is not an image Pillow can decode ({_pil_problem(exc)})") from None
    bounds = bounds or MediaBounds()
    return fit_pixels(rgb, bounds.image_min_pixels, bounds.image_max_pixels)


def fit_pixels(image, min_pixels: int | None, max_pixels: int | None):
    """`image` scaled, aspect ratio kept, so that width x height lies in the bounds (None: no bound)."""
    from PIL import Image

    width, height = image.size
    pixels = width * height
    if max_pixels and pixels > max_pixels:
        scale, rounding = math.sqrt(max_pixels / pixels), math.floor
    elif min_pixels and pixels < min_pixels:
        scale, rounding = math.sqrt(min_pixels / pixels), math.ceil
    else:
        return image
    size = (max(1, rounding(width * scale)), max(1, rounding(height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)


def decode_video(value: Any, bounds: MediaBounds | None = None, where: str = "video") -> Video:
    """Frames of a clip sampled at `video_fps` of video time, between `video_min_frames` and
    `video_max_frames` (never more than the clip has); out of those bounds, spread evenly over the clip."""
    import av

    bounds = bounds or MediaBounds()
    record = _record(value, where)
    data = _bytes(record, "video", where)
    try:
        total, source_fps = _frame_count(data, record, where)
        indices, fps = sample_indices(total, source_fps, bounds)
        frames, decoded = _decode_frames(data, indices)
        if decoded != total:  # the container's packets and its frames disagree: sample the frames there are
            total = decoded
            indices, fps = sample_indices(total, source_fps, bounds)
            frames, _ = _decode_frames(data, indices)
    except (av.FFmpegError, ValueError, IndexError) as exc:
        raise MediaError(f"{where}: {_named(record)} is not a video PyAV can decode ({exc})") from None
    import numpy as np

    return Video(np.stack(frames), fps, [i / source_fps for i in indices], indices, source_fps, total, data)


def sample_indices(total: int, source_fps: float, bounds: MediaBounds) -> tuple[list[int], float]:
    """Frame indices to keep and the sampling rate they have, in frames per second of video time."""
    import numpy as np

    wanted = int(total / source_fps * bounds.video_fps + 1e-6)
    count = max(1, min(max(wanted, bounds.video_min_frames), bounds.video_max_frames, total))
    if count == wanted:  # every 1/video_fps seconds
        step = source_fps / bounds.video_fps
        return [min(total - 1, round(k * step)) for k in range(count)], bounds.video_fps
    indices = np.linspace(0, total - 1, count).round().astype(int).tolist()
    return indices, (source_fps * (count - 1) / (total - 1) if count > 1 else 0.0)


def _frame_count(data: bytes, record: dict, where: str) -> tuple[int, float]:
    import av

    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise MediaError(f"{where}: {_named(record)} has no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        total = sum(1 for packet in container.demux(stream) if packet.size)
    if not total or not rate:
        raise ValueError("no frames, or no frame rate")
    return total, float(rate)


def _decode_frames(data: bytes, indices: list[int]) -> tuple[list, int]:
    """The frames at `indices` (RGB arrays, repeats kept) and how many frames the clip decoded to."""
    import av

    wanted, kept, count = set(indices), {}, 0
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for count, frame in enumerate(container.decode(stream), 1):
            if count - 1 in wanted:
                kept[count - 1] = frame.to_ndarray(format="rgb24")
    return [kept[i] for i in indices if i in kept], count


def decode_audio(value: Any, bounds: MediaBounds | None = None, where: str = "audio"):
    """Mono float32 samples at `audio_sample_rate`; a sound longer than `audio_max_seconds` is refused."""
    bounds = bounds or MediaBounds()
    record = _record(value, where)
    samples, rate = _samples(record, where)
    _check_duration(len(samples) / rate, record, bounds, where)
    return resample(samples, rate, bounds.audio_sample_rate)


def _samples(record: dict[str, Any], where: str):
    """Mono float32 samples and their rate, as stored."""
    import numpy as np

    if record.get("array") is not None:
        array = np.asarray(record["array"], dtype=np.float32)
        return (array.mean(axis=0) if array.ndim > 1 else array), record["sampling_rate"]
    import soundfile

    data = _bytes(record, "audio", where)
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        return samples.mean(axis=1), rate
    except (soundfile.LibsndfileError, RuntimeError, TypeError):
        return _av_samples(data, record, where)  # containers libsndfile cannot read: m4a, mp4, webm, ...


def _av_samples(data: bytes, record: dict[str, Any], where: str):
    import av
    import numpy as np

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.audio:
                raise MediaError(f"{where}: {_named(record)} has no audio stream")
            stream = container.streams.audio[0]
            to_mono = av.AudioResampler(format="flt", layout="mono", rate=stream.rate)
            frames = [out for frame in container.decode(stream) for out in to_mono.resample(frame)]
            frames += to_mono.resample(None)
    except av.FFmpegError as exc:
        raise MediaError(f"{where}: {_named(record)} is not audio soundfile or PyAV can decode ({exc})") from None
    if not frames:
        raise MediaError(f"{where}: {_named(record)} holds no audio samples")
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float32), stream.rate


def _check_duration(seconds: float, record: dict, bounds: MediaBounds, where: str) -> None:
    if bounds.audio_max_seconds is not None and seconds > bounds.audio_max_seconds:
        raise MediaError(f"{where}: audio {_named(record)} lasts {seconds:.2f} s, longer than "
                         f"data.audio_max_seconds ({bounds.audio_max_seconds:g} s); raise the bound or cut the clip")


def resample(samples, rate: int, target: int):
    """`samples` at `target` Hz: band-limited (FFT) resampling, as scipy.signal.resample does."""
    import numpy as np

    if rate == target or not len(samples):
        return samples
    count = max(1, round(len(samples) * target / rate))
    out = np.fft.irfft(np.fft.rfft(samples), count) * (count / len(samples))
    return out.astype(np.float32)


# ------------------------------------------------------------------ checking (relax validate)
def check_value(kind: str, record: dict[str, Any], bounds: MediaBounds, where: str) -> None:
    """Raise `MediaError` when a record will not decode: an image that fails Pillow's `verify()`, a video
    whose first frame does not decode, audio that does not decode or lasts over `audio_max_seconds`."""
    if kind == "audio":
        samples, rate = _samples(record, where)
        _check_duration(len(samples) / rate, record, bounds, where)
    elif kind == "image":
        _verify_image(_bytes(record, "image", where), record, where)
    else:
        _check_video(_bytes(record, "video", where), record, where)


def _verify_image(data: bytes, record: dict, where: str) -> None:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"{where}: {_named(record)} is not an image Pillow can decode ({_pil_problem(exc)})") from None


def _pil_problem(exc: Exception) -> str:
    from PIL import UnidentifiedImageError

    return "not a format Pillow knows, or cut short" if isinstance(exc, UnidentifiedImageError) else str(exc)


def _check_video(data: bytes, record: dict, where: str) -> None:
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise MediaError(f"{where}: {_named(record)} has no video stream")
            next(container.decode(container.streams.video[0]))
    except (av.FFmpegError, StopIteration) as exc:
        raise MediaError(f"{where}: {_named(record)} is not a video PyAV can decode ({exc or 'no frames'})") from None


# ------------------------------------------------------------------ encoding (SGLang requests)
def encode_data_uri(kind: str, obj: Any, sample_rate: int | None = None) -> str:
    """A data URI for an SGLang request's `image_data` / `video_data` / `audio_data`.

    Args:
        kind: "image", "video" or "audio".
        obj: a PIL image (sent as PNG), a `Video` (its container bytes) or a float array (sent as 32-bit
            float WAV at `sample_rate`, so the engine decodes the very samples); bytes are sent as they are.
        sample_rate: the rate of an audio array.
    """
    if isinstance(obj, (bytes, bytearray)):
        data = bytes(obj)
    elif kind == "image":
        buffer = io.BytesIO()
        obj.save(buffer, format="PNG")
        data = buffer.getvalue()
    elif kind == "video":
        if getattr(obj, "data", None) is None:
            raise ValueError("a Video without its container bytes cannot be sent; pass the file's bytes")
        data = obj.data
    elif kind == "audio":
        if not sample_rate:
            raise ValueError("encoding an audio array needs its sample_rate")
        import soundfile

        buffer = io.BytesIO()
        soundfile.write(buffer, obj, sample_rate, format="WAV", subtype="FLOAT")
        data = buffer.getvalue()
    else:
        raise ValueError(f"unknown media kind {kind!r} (one of {', '.join(KINDS)})")
    return f"data:{_mime(data)};base64,{base64.b64encode(data).decode('ascii')}"


def encode_request_media(media: RowMedia) -> dict[str, list[str]]:
    """A row's decoded media as an SGLang request's fields: `image_data` (PNG of the bounded image),
    `video_data` (the clip's own container bytes), `audio_data` (WAV at `audio_sample_rate`); empty
    fields left out."""
    fields = {"image_data": [encode_data_uri("image", image) for image in media.images],
              "video_data": [encode_data_uri("video", video) for video in media.videos],
              "audio_data": [encode_data_uri("audio", audio, media.audio_sample_rate) for audio in media.audios]}
    return {name: uris for name, uris in fields.items() if uris}


def _mime(data: bytes) -> str:
    if data[:4] == b"RIFF":
        return {b"WAVE": "audio/wav", b"AVI ": "video/x-msvideo", b"WEBP": "image/webp"}.get(data[8:12],
                                                                                          "application/octet-stream")
    if data[4:8] == b"ftyp":
        return "video/mp4"
    return next((mime for magic, mime in _MAGIC if data.startswith(magic)), "application/octet-stream")
