"""What every command shares: the consoles and how user mistakes are reported."""

from __future__ import annotations

import sys

from rich.console import Console

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

EXIT_USER_ERROR = 2
EXIT_RUNTIME_ERROR = 1


def fail(message: str, code: int = EXIT_USER_ERROR) -> None:
    """Print `message` on stderr and exit with `code` (2: the user must fix something)."""
    err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    sys.exit(code)
