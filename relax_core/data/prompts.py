"""Prompt sources: where each step's prompts come from, and how they become token ids.

A source yields `{"prompt", "label", "metadata", "reward"}` rows with a
resumable cursor (`state_dict` / `load_state_dict`, saved in every checkpoint).
`reward` is the row's own reward name, read from the column `data.reward_key`
names (None without one, so the recipe's reward scores it); it sits beside the
data set's columns, never among them, so a column that happens to be called
`reward` routes nothing.

The rows come from a synthetic task (quick start), a local JSONL/JSON/Parquet
file, or the same files of a hub data set (fetched once with `huggingface_hub`,
then read by the same code), all held in memory as Python dicts (about 600 MB
for a million short rows). `encode_prompt` applies the model's chat template.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from relax_core.config.schema import FileData, SyntheticData
from relax_core.data.synthetic import SyntheticTask
from relax_core.errors import UserError


def build_prompt_source(data: SyntheticData | FileData):
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
            batch.append(self._item(self.rows[self._order_of(epoch)[index]]))
            self.cursor += 1
        return batch

    def _item(self, row: dict[str, Any]) -> dict[str, Any]:
        d = self.data
        metadata = {k: v for k, v in row.items() if k not in (d.prompt_key, d.label_key)}
        return {"prompt": dotted_get(row, d.prompt_key), "label": dotted_get(row, d.label_key),
                "metadata": metadata, "reward": dotted_get(row, d.reward_key) if d.reward_key else None}

    def reward_names(self) -> set:
        """Every value of the `data.reward_key` column (empty without one): checked before the run starts."""
        if not self.data.reward_key:
            return set()
        return {_hashable(dotted_get(row, self.data.reward_key)) for row in self.rows}

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])


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
    files = _hub_files(data) if data.source == "hub" else [Path(data.path).expanduser()]
    rows: list[dict[str, Any]] = []
    for path in files:
        rows += _read_file(path)
    return rows


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
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError as exc:
        raise UserError(f"data.path: '{path}' is not JSON lines: {exc}") from None


def _hub_files(data: FileData) -> list[Path]:
    from huggingface_hub import snapshot_download

    patterns = [f"*{data.split}*.{ext}" for ext in ("parquet", "jsonl", "json")]
    root = Path(snapshot_download(data.path, repo_type="dataset", allow_patterns=patterns))
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".parquet", ".jsonl", ".json"))
    if not files:
        raise UserError(f"data.path: hub data set '{data.path}' has no {data.split} split files")
    return files


def encode_prompt(tokenizer, prompt: str | list[dict[str, str]], system_prompt: str | None = None) -> list[int]:
    """Token ids of a prompt with the chat template and the assistant turn opened."""
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
