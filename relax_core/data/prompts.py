"""Prompt sources: where each step's prompts come from, and how they become token ids.

A source yields `{"prompt", "label", "metadata", "reward", "media"}` rows with a
resumable cursor (`state_dict` / `load_state_dict`, saved in every checkpoint).
`reward` is the row's own reward name, read from the column `data.reward_key`
names (None without one, so the recipe's reward scores it); it sits beside the
data set's columns, never among them, so a column that happens to be called
`reward` routes nothing.

The rows come from a synthetic task (quick start), a local JSONL/JSON/Parquet
file, or the same files of a hub data set (fetched once with `huggingface_hub`,
then read by the same code), all held in memory as Python dicts (about 600 MB
for a million short rows). `encode_prompt` applies the model's chat template.

Media columns (`data.image_key`, `video_key`, `audio_key`) are read when the
rows load: every file's bytes are in memory from then on (media.py). They stay
out of `metadata` (which travels as JSON); `media` carries them instead,
`{"row", "columns": {kind: column}, kind: [records]}` (None without media
keys), and `media.row_media` decodes it where the row is used.
`media_problems` is the check `relax validate` runs on every media value.
"""

from __future__ import annotations

import fnmatch
import json
import random
from pathlib import Path
from typing import Any

from relax_core.config.data import FileData, SyntheticData
from relax_core.data.media import KINDS, MediaBounds, MediaError, check_value, read_value
from relax_core.data.synthetic import SyntheticTask
from relax_core.errors import UserError

MEDIA_TASKS = ("colours", "tones")  # synthetic tasks with media: data sets written in the real schemas


def build_prompt_source(data: SyntheticData | FileData):
    if isinstance(data, SyntheticData) and data.task in MEDIA_TASKS:
        return synthetic_media_source(data)
    if isinstance(data, SyntheticData):
        return SyntheticTask(kind=data.task, seed=data.seed, alphabet=data.symbols,
                             min_len=data.min_len, max_len=data.max_len)
    return RowSource(load_rows(data), data)


class RowSource:
    """Rows of a data set, reshuffled every epoch from a seed, with a cursor.

    The cursor counts rows served. Row `cursor` is row `order(epoch)[index]`
    with `epoch, index = divmod(cursor, len(rows))`, where `order(epoch)` is
    `range(len(rows))` shuffled by `random.Random(f"{seed}:{epoch}")`; so a
    source resumed at any cursor serves the same rows as the uninterrupted one.
    The order of the current epoch is computed once and kept.
    """

    def __init__(self, rows: list[dict[str, Any]], data: FileData):
        if not rows:
            raise UserError(f"data.path: '{data.path}' holds no rows")
        if not data.apply_chat_template:
            chat = next((i for i, row in enumerate(rows) if not isinstance(dotted_get(row, data.prompt_key), str)),
                        None)
            if chat is not None:
                raise UserError(f"data.apply_chat_template: row {chat} of '{data.path}' has a prompt that is not "
                                f"text ('{data.prompt_key}': chat messages?), which only the chat template turns "
                                "into tokens; set it to true or give text prompts")
        self.rows, self.data, self.cursor = rows, data, 0
        self._epoch, self._order = -1, []

    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._epoch, self._order = epoch, list(range(len(self.rows)))
            if self.data.shuffle:
                random.Random(f"{self.data.seed}:{epoch}").shuffle(self._order)
        return self._order

    def next_batch(self, n: int) -> list[dict[str, Any]]:
        batch = []
        for _ in range(n):
            epoch, index = divmod(self.cursor, len(self.rows))
            row = self._order_of(epoch)[index]
            batch.append(self._item(self.rows[row], row))
            self.cursor += 1
        return batch

    def _item(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        d, columns = self.data, media_columns(self.data)
        skip = {d.prompt_key, d.label_key} | {column.split(".")[0] for column in columns.values()}
        media = {"row": index, "columns": columns} | {kind: _media_get(row, c) for kind, c in columns.items()}
        return {"prompt": dotted_get(row, d.prompt_key), "label": dotted_get(row, d.label_key),
                "metadata": {k: v for k, v in row.items() if k not in skip},
                "reward": dotted_get(row, d.reward_key) if d.reward_key else None,
                "media": media if columns else None}

    def reward_names(self) -> set:
        """Every value of the `data.reward_key` column (empty without one): checked before the run starts."""
        if not self.data.reward_key:
            return set()
        return {_hashable(dotted_get(row, self.data.reward_key)) for row in self.rows}

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])


def row_problems(data: FileData, limit: int = 5) -> list[str]:
    """What would stop a run at reading this local data set, found before it starts: the file parses, holds
    rows, each row has the columns `RowSource` reads (at most `limit` rows named), and its prompts are
    what `RowSource` takes."""
    try:
        rows = _read_file(Path(data.path).expanduser())
    except UserError as exc:
        return [str(exc)]
    problems = []
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            problems.append(f"data: row {index} of '{data.path}' is a {type(row).__name__}, not an object of columns")
            continue
        for column in (data.prompt_key, data.label_key, *([data.reward_key] if data.reward_key else [])):
            try:
                dotted_get(row, column)
            except UserError:
                problems.append(f"data: row {index} of '{data.path}' has no column '{column}' (columns: "
                                f"{', '.join(map(str, row))}); "
                                f"set data.{_key_field(data, column)} to the column that holds it")
                break
        if len(problems) >= limit:
            return problems
    if problems:
        return problems
    try:
        RowSource(rows, data)
    except UserError as exc:
        return [str(exc)]
    return []


def _key_field(data: FileData, column: str) -> str:
    return next(f for f in ("prompt_key", "label_key", "reward_key") if getattr(data, f) == column)


def _hashable(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def dotted_get(row: dict[str, Any], key: str) -> Any:
    """`row["a"]["b"]` for key "a.b" (nested columns such as reward_model.ground_truth)."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise UserError(f"data: column '{key}' not found in a row (columns: {', '.join(row)})")
        value = value[part]
    return value


def load_rows(data: FileData) -> list[dict[str, Any]]:
    """Every row of the data set, with the bytes of its media files read into memory."""
    files = _hub_files(data) if data.source == "hub" else [Path(data.path).expanduser()]
    rows: list[dict[str, Any]] = []
    for path in files:
        file_rows = _read_file(path)
        for index, row in enumerate(file_rows, len(rows)):
            for column in media_columns(data).values():
                _media_set(row, column, read_value(_media_get(row, column), path.parent, _where(index, column)))
        rows += file_rows
    return rows


def media_columns(data: FileData) -> dict[str, str]:
    """The media columns the recipe names, by kind ("image", "video", "audio")."""
    return {kind: column for kind in KINDS if (column := getattr(data, f"{kind}_key", None))}


def _where(index: int, column: str) -> str:
    return f"data: row {index}, column '{column}'"


def _media_get(row: dict[str, Any], column: str) -> Any:
    """The media value of a row; None (no media) where the column is absent: text-only rows of a mixed set."""
    value: Any = row
    for part in column.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _media_set(row: dict[str, Any], column: str, records: list[dict[str, Any]]) -> None:
    *parents, last = column.split(".")
    for part in parents:
        row = row.setdefault(part, {})
    row[last] = records


def media_problems(data: FileData, limit: int = 10) -> list[str]:
    """What would fail in the media of a data set this machine holds: a missing file, an image, video or
    audio that does not decode, audio over `audio_max_seconds`, a media column no row has. At most `limit`
    lines and a count of the rest. A file this machine cannot see, or a hub data set not downloaded yet,
    yields none (the run checks it when it loads)."""
    columns = media_columns(data)
    files = _hub_files(data, local_only=True) if data.source == "hub" else [Path(data.path).expanduser()]
    if not columns or not files or not all(path.is_file() for path in files):
        return []
    bounds, problems, seen, first = MediaBounds.from_data(data), [], set(), 0
    for path in files:
        rows = _read_file(path)
        for index, row in enumerate(rows, first):
            for kind, column in columns.items():
                value = _media_get(row, column)
                seen.update([column] if value is not None else [])
                problems += _value_problems(kind, value, path.parent, bounds, _where(index, column))
        first += len(rows)
    problems += [f"data.{kind}_key: no row has a column '{column}'" for kind, column in columns.items()
                 if column not in seen]
    more = [f"... and {len(problems) - limit} more media problem(s)"] if len(problems) > limit else []
    return problems[:limit] + more


def _value_problems(kind: str, value: Any, base_dir: Path, bounds: MediaBounds, where: str) -> list[str]:
    try:
        for record in read_value(value, base_dir, where):
            check_value(kind, record, bounds, where)
    except MediaError as exc:
        return [str(exc)]
    return []


def _read_file(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise UserError(f"data.path: file '{path}' does not exist")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UserError(f"data.path: reading '{path}' needs pyarrow (pip install pyarrow)") from None
        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        loaded = json.loads(text)
        return loaded if isinstance(loaded, list) else loaded.get("data", [])
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                raise UserError(f"data.path: line {number} of '{path}' is not JSON: {exc}") from None
    return rows


DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


def split_patterns(split: str) -> list[str]:
    """The files of a hub data set that hold `split` (what is fetched of it)."""
    return [f"*{split}*{suffix}" for suffix in DATA_SUFFIXES]


def split_files(root: Path, split: str) -> list[Path]:
    """The files of `split` in a hub data set's folder (which may hold other splits fetched before)."""
    patterns = split_patterns(split)
    return sorted(p for p in root.rglob("*") if p.is_file()
                  and any(fnmatch.fnmatch(p.relative_to(root).as_posix(), pattern) for pattern in patterns))


def _hub_files(data: FileData, local_only: bool = False) -> list[Path]:
    """The split's files of a hub data set: in its folder when `data.path` is one (where `relax submit` fetched
    it), else fetched once; with `local_only`, none unless already downloaded."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    root = Path(data.path).expanduser()
    try:
        if not root.is_dir():
            root = Path(snapshot_download(data.path, repo_type="dataset", allow_patterns=split_patterns(data.split),
                                          local_files_only=local_only))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        if local_only:
            return []
        raise
    files = split_files(root, data.split)
    if not files:
        raise UserError(f"data.path: hub data set '{data.path}' has no {data.split} split files")
    return files


def encode_prompt(tokenizer, prompt: str | list[dict[str, str]], system_prompt: str | None = None,
                  chat_template: bool = True) -> list[int]:
    """Token ids of a prompt with the chat template and the assistant turn opened; without `chat_template`
    (`data.apply_chat_template: false`) the text's own tokens (and the BOS a tokenizer adds)."""
    if not chat_template:
        if not isinstance(prompt, str):
            raise UserError("data.apply_chat_template: a prompt is a list of chat messages, which only the chat "
                            "template turns into text; set it to true or give text prompts")
        return list(tokenizer.encode(prompt))
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def media_view(data: SyntheticData | FileData) -> FileData | None:
    """The data set's columns as a file data set names them, when it has media (the synthetic media tasks
    read like the files they are written as); None for text data."""
    if isinstance(data, SyntheticData):
        if data.task not in MEDIA_TASKS:
            return None
        keys = {"image_key": "image"} | ({"audio_key": "audio"} if data.task == "tones" else {})
        return FileData(path=f"synthetic:{data.task}", prompt_key="problem", label_key="solution",
                        seed=data.seed, **keys)
    return data if media_columns(data) else None


def synthetic_media_source(data: SyntheticData, rows: int = 64) -> RowSource:
    """`colours` / `tones`: the data set written to a scratch folder in its real schema (parquet with embedded
    PNGs; JSONL with image and WAV paths), read back by the file reader like any data set (media in memory),
    then the folder removed. The same seed writes the same rows in every process."""
    import tempfile

    from relax_core.data.synthetic_media import write_color_images, write_tone_pairs

    view = media_view(data)
    write = write_color_images if data.task == "colours" else write_tone_pairs
    with tempfile.TemporaryDirectory(prefix="relax-synthetic-") as scratch:
        path = write(scratch, n_rows=rows, seed=data.seed)
        loaded = load_rows(view.model_copy(update={"path": str(path)}))
    return RowSource(loaded, view)
