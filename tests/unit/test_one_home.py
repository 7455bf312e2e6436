"""One home per concept: code that behaves differently per mode or per engine kind asks the concept's
spec (relax_core/config/modes.py, relax_core/config/engines.py) for the property it depends on, and never
compares the name itself. A newcomer who must change how one mode does something finds one table.

The check reads relax_core's source (AST). A mode's name, in code rather than in a docstring, may appear
only in config/modes.py (the names are unique words). An engine kind's name may not be compared with
`engine` (`rollout.engine == "sglang"`) outside config/engines.py: "cpu" is also a device type, and
"sglang" the package doctor checks and rollout/sglang_source.py reads. An executor's name may not be
compared with anything outside launch/executors.py: what differs between executors is a method or
property of the `Executor` (and, inside the job, of controller/scale_out.py's `ScaleOut`).
"""

from __future__ import annotations

import ast
from pathlib import Path

from relax_core.config.engines import ENGINE_KINDS
from relax_core.config.modes import MODE_NAMES
from relax_core.launch.executors import _EXECUTORS

PACKAGE = Path(__file__).resolve().parents[2] / "relax_core"


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that stand alone as statements: docstrings, and attribute docs."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for stmt in body if isinstance(body, list) else []:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                found.add(id(stmt.value))
    return found


def mode_names_in_code(path: Path, root: Path = PACKAGE) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    skip = docstrings(tree)
    return [f"{path.relative_to(root)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in MODE_NAMES and id(node) not in skip]


def _is_engine(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "engine") or (isinstance(node, ast.Name)
                                                                          and node.id == "engine")


def engine_kinds_compared(path: Path, root: Path = PACKAGE) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_engine(side) for side in sides) and any(
                    isinstance(side, ast.Constant) and side.value in ENGINE_KINDS for side in sides):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def executors_compared(path: Path, root: Path = PACKAGE) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare) and any(isinstance(side, ast.Constant) and side.value in _EXECUTORS
                                                 for side in [node.left, *node.comparators]):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def sources(but: str) -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py")) if path.relative_to(PACKAGE).as_posix() != but]


def test_mode_names_appear_in_code_only_in_the_mode_spec():
    found = [hit for path in sources("config/modes.py") for hit in mode_names_in_code(path)]
    assert not found, "mode names outside relax_core/config/modes.py (ask mode_spec instead):\n" + "\n".join(found)


def test_engine_kinds_are_compared_only_in_the_engine_spec():
    found = [hit for path in sources("config/engines.py") for hit in engine_kinds_compared(path)]
    assert not found, "engine kinds compared outside relax_core/config/engines.py (ask engine_kind instead):\n" + \
        "\n".join(found)


def test_executors_are_compared_only_in_the_executor_registry():
    found = [hit for path in sources("launch/executors.py") for hit in executors_compared(path)]
    assert not found, "executor names compared outside relax_core/launch/executors.py (add to the Executor or " \
        "ScaleOut interface instead):\n" + "\n".join(found)


def test_the_checks_find_what_they_look_for(tmp_path):
    """A planted comparison of each kind is found; a docstring's mention and a device type are not."""
    planted = tmp_path / "planted.py"
    planted.write_text('"""hybrid is described here."""\n\n'
                       'def f(recipe, tensor):\n'
                       '    if tensor.device.type == "cpu":\n'
                       '        return recipe.rollout.engine == "sglang"\n'
                       '    if op.source != "slurm":\n'
                       '        return None\n'
                       '    return recipe.mode == "hybrid"\n')
    assert mode_names_in_code(planted, root=tmp_path) == ["planted.py:8: 'hybrid'"]
    assert executors_compared(planted, root=tmp_path) == ["planted.py:6: op.source != 'slurm'"]
    assert engine_kinds_compared(planted, root=tmp_path) == ["planted.py:5: recipe.rollout.engine == 'sglang'"]
