"""Where the shipped templates and recipes are, installed or in a checkout.

In a wheel they live in `relax_core/_assets/` (force-included at build time);
in an editable install or a checkout they are the top-level `templates/` and
`recipes/` folders of the repository.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def asset_dir(name: str) -> Path:
    """The folder of shipped assets called `name` ("templates" or "recipes")."""
    for candidate in (_PACKAGE / "_assets" / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"Relax installation is missing its '{name}' folder")
