"""No module of relax_core imports itself back through others: the import graph has no cycle.

The graph counts every import in a module, at its top or inside a function (a lazy import still makes the
two modules need each other), each resolved to the relax_core module it names; `from pkg import name`
counts as an import of the submodule `pkg.name` where there is one. Its strongly connected components of
more than one module are the cycles; there must be none. `python tests/unit/test_import_cycles.py` prints
every one there is.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "relax_core"


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file of every module of the package at `root` (a package by its __init__.py)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(node: ast.Import | ast.ImportFrom, package: str, modules: dict[str, Path]) -> list[str]:
    """The dotted names one import statement names (`package`: the one a relative import starts from)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its file."""
    modules = module_files(root)
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        needs = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(node, package, modules):
                    while target and target not in modules:  # a name inside a module: that module
                        target = target.rpartition(".")[0]
                    if target and target != name:
                        needs.add(target)
        graph[name] = needs
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, edges = work[-1]
            step = next((e for e in edges if e in graph), None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while not component or component[-1] != node:
                    component.append(stack.pop())
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def within(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """The graph of `package`'s modules alone."""
    inside = {name for name in graph if name == package or name.startswith(package + ".")}
    return {name: graph[name] & inside for name in inside}


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "modules of relax_core that import each other:\n" + "\n".join(map(" -> ".join, found))


def test_the_graph_finds_a_cycle_through_a_lazy_import_and_a_submodule_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (package / "c.py").write_text("import pkg.a\ndef g(): pass\n")
    (package / "d.py").write_text("from pkg import a\n")  # into the cycle, not part of it
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.d"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert cycles(within(graph, "pkg.sub")) == []


if __name__ == "__main__":
    for component in cycles(import_graph()):
        print(len(component), " ".join(component))
