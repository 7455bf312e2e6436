"""The layers of relax_core, lowest first, and the contract that an import never runs back up them.

docs/architecture.md gives the layers and why each sits where it does. A module may import its own
package and the packages of lower layers; an import of a higher layer, at the top of a module or inside a
function alike (a lazy import hides a cycle from Python, not from this check), is an upward import.

The contract landed with 43 upward imports listed as debt; the last was paid off, so none is allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "relax_core"
LAYERS = [
    ("errors", "assets", "plugin_files", "rundir", "run_requests"),
    ("config",),
    ("algorithms",),
    ("metrics", "models"),
    ("cluster",),
    ("data",),
    ("rollout",),
    ("rewards",),
    ("weights",),
    ("train",),
    ("checkpoint",),
    ("services",),
    ("controller",),
    ("entrypoints",),
    ("launch",),
    ("recipes", "catalog", "doctor"),
]


LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer} | {"__init__": 0}


def layer_of(name: str) -> int:
    """The layer of a relax_core package or top-level module (a KeyError names one no layer holds)."""
    return LAYER_OF[name]


def upward_imports(root: Path = PACKAGE) -> set[tuple[str, str]]:
    """(importing file, imported module) for every import of a higher layer under `root`."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        here = layer_of(rel.parts[0].removesuffix(".py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules = [node.module]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] == "relax_core" and len(parts) > 1 and layer_of(parts[1]) > here:
                    found.add((rel.as_posix(), module))
    return found


def test_every_package_has_a_layer():
    names = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")}
    assert names == {name for layer in LAYERS for name in layer}


def test_no_import_runs_back_up_the_layers():
    found = sorted(upward_imports())
    assert not found, "imports of a higher layer (docs/architecture.md: move the shared part down instead):\n" + \
        "\n".join(f"  {f} imports {m}" for f, m in found)


def test_a_planted_upward_import_is_found_lazy_or_not(tmp_path):
    """The contract's check itself: a low layer that imports the controller, at the top or in a function."""
    for package in ("config", "controller"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "config" / "top.py").write_text("from relax_core.controller.job import Job\n")
    (tmp_path / "config" / "lazy.py").write_text("def f():\n    import relax_core.controller.driver\n")
    (tmp_path / "controller" / "down.py").write_text("from relax_core.config.schema import Recipe\n")
    assert upward_imports(tmp_path) == {("config/top.py", "relax_core.controller.job"),
                                        ("config/lazy.py", "relax_core.controller.driver")}
