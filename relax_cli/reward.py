"""`relax reward score NAME ...`: try a reward on your own outputs before spending GPU hours.

    relax reward score math --response 'So the answer is \\boxed{1/2}' --label 0.5
    relax reward score math --jsonl outputs.jsonl [--plugin-dir my_rewards/]

Each scored response prints one JSON line with `score` (and `scores` for
dict-valued rewards, `error` when the reward failed or timed out). Scoring
goes through the same hub as training (worker pool, time limit, plugins).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from relax_core.errors import UserError

app = typer.Typer(help="Check rewards on your own outputs.", no_args_is_help=True)


@app.callback()
def reward_group() -> None:
    """Check rewards on your own outputs."""


@app.command("score")
def score(
    name: str = typer.Argument(..., help="Reward name (see `relax list rewards`)."),
    response: str | None = typer.Option(None, "--response", help="One response text to score."),
    label: str | None = typer.Option(None, "--label", help="The reference answer for --response."),
    metadata: str | None = typer.Option(None, "--metadata", help="JSON object: the sample's metadata."),
    jsonl: Path | None = typer.Option(None, "--jsonl", help='File of {"response", "label", "metadata"} lines '
                                         '(and "reward": that line\'s reward instead of NAME).'),
    plugin_dir: list[Path] = typer.Option([], "--plugin-dir", help="Extra reward plugin folder (repeatable)."),
    key: str | None = typer.Option(None, "--key", help="Entry of a dict-valued reward to report as score."),
    timeout_s: float = typer.Option(10.0, "--timeout", min=0.001, help="Time limit of one call, seconds."),
    workers: int = typer.Option(0, "--workers", min=0, help="Worker processes (0: one per CPU)."),
) -> None:
    """Score responses with a reward; one JSON line per response."""
    from relax_core.rewards.hub import RewardHub

    items = _items(response, label, metadata, jsonl)
    with RewardHub(name, key=key, plugin_dirs=[str(d) for d in plugin_dir], timeout_s=timeout_s,
                   num_workers=workers or None) as hub:
        for result in hub.score_sync(items):
            typer.echo(json.dumps(result.as_dict()))


def _items(response: str | None, label: str | None, metadata: str | None, jsonl: Path | None) -> list:
    from relax_core.rewards.hub import RewardItem

    if (response is None) == (jsonl is None):
        raise UserError("give either --response TEXT (with --label) or --jsonl FILE")
    if jsonl is not None:
        return [_item_from_line(line, jsonl, n) for n, line in _lines(jsonl)]
    return [RewardItem(response, label, _metadata(metadata, "--metadata"))]


def _lines(path: Path) -> list[tuple[int, str]]:
    if not path.is_file():
        raise UserError(f"--jsonl: no file '{path}'")
    lines = path.read_text().splitlines()
    return [(n, line) for n, line in enumerate(lines, 1) if line.strip()]


def _item_from_line(line: str, path: Path, number: int):
    from relax_core.rewards.hub import RewardItem

    try:
        row = json.loads(line)
    except ValueError as exc:
        raise UserError(f"{path}:{number}: not JSON ({exc})") from None
    if not isinstance(row, dict) or "response" not in row:
        raise UserError(f'{path}:{number}: expected an object with "response", "label", "metadata"')
    meta = row.get("metadata") or {}
    if not isinstance(meta, dict):
        raise UserError(f"{path}:{number}: metadata must be an object")
    return RewardItem(str(row["response"]), row.get("label"), meta, row.get("reward"))


def _metadata(text: str | None, option: str) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UserError(f"{option}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise UserError(f"{option}: must be a JSON object")
    return value
