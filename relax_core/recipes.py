"""The recipes shipped with Relax (`relax recipes`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from relax_core.assets import asset_dir


@dataclass(frozen=True)
class ShippedRecipe:
    name: str
    path: Path
    description: str


def shipped_recipes() -> list[ShippedRecipe]:
    """Every YAML recipe in the shipped recipes folder, subfolders included."""
    root = asset_dir("recipes")
    found = sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".yml"))
    return [ShippedRecipe(str(p.relative_to(root)), p, _description(p)) for p in found]


def _description(path: Path) -> str:
    """A recipe's description is its first comment line."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""
