"""Importing a user's Python file (reward plug-ins, environments) under a module name of its own.

A file is imported once per process, as `NAMESPACE.<stem>_<hash of its path>`, so two files of the same
name in different folders never replace each other. A file that fails to import raises the caller's
`UserError` subclass naming the file and the line that failed, so a run does not start on it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType

from relax_core.errors import UserError

_MODULES: dict[Path, ModuleType] = {}


def module_name(file: Path, namespace: str) -> str:
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:8]
    return f"{namespace}.{file.stem}_{digest}"


def import_file(file: str | Path, namespace: str, error: type[UserError] = UserError, what: str = "plug-in",
                before_exec=None) -> ModuleType:
    """The module of `file`, imported now or earlier in this process. `before_exec(module_name)` runs just
    before the file's code (registries use it to know which file registers what)."""
    path = Path(file).expanduser().resolve()
    if path in _MODULES:
        return _MODULES[path]
    if not path.is_file():
        raise error(f"{what} {file}: no such file")
    name = module_name(path, namespace)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if before_exec is not None:
        before_exec(name)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # SyntaxError, ImportError, anything its top level raises
        sys.modules.pop(name, None)
        raise error(f"{what} {path}{_line(exc, path)} failed to import: {type(exc).__name__}: {exc}") from None
    _MODULES[path] = module
    return module


def _line(exc: BaseException, file: Path) -> str:
    """':LINE' of the deepest frame of the traceback inside `file`, if any."""
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f":{exc.lineno}"
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == file]
    return f":{lines[-1]}" if lines else ""
