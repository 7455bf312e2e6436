"""What a fresh `pip install` gets: a declared distribution for every third-party module that the package (or, via
the [dev] extra, its tests) imports; the recipes and templates; the license."""

import ast
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # the [dev] extra brings tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("relax_core", "relax_cli")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared_distributions() -> set[str]:
    """Distributions pyproject.toml asks for, the optional extras included (a GPU-only import is declared there)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {_normalise(Requirement(r).name) for r in reqs}


def _imported_top_modules(folders: tuple[str, ...]) -> dict[str, str]:
    """Top-level module -> first place it is imported, every `import` statement included (those inside functions)."""
    found: dict[str, str] = {}
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def _provided_by(module: str, declared: set[str]) -> bool:
    distributions = {_normalise(d) for d in metadata.packages_distributions().get(module, [])}
    if distributions:
        return bool(distributions & declared)
    # Not installed here (a GPU extra on a CPU machine): a declared name like it will do (megatron -> megatron-core).
    return any(d == _normalise(module) or d.startswith(_normalise(module) + "-") for d in declared)


@pytest.mark.parametrize("folders", [PACKAGES, ("tests",)], ids=["package", "tests"])
def test_every_imported_third_party_module_is_declared(folders):
    """The package's imports and, for `pip install -e '.[dev]' && bash tests/run`, the tests' ones."""
    declared = _declared_distributions()
    local = {path.stem for path in (REPO / "tests").rglob("*.py")}  # the tests import their helpers by name
    own = set(PACKAGES) | local | {"__future__"} | set(sys.stdlib_module_names)
    third_party = {module: where for module, where in _imported_top_modules(folders).items() if module not in own}
    missing = [f"{module} (imported at {where}; distribution: {metadata.packages_distributions().get(module)})"
               for module, where in third_party.items() if not _provided_by(module, declared)]
    assert not missing, "imported but not declared in pyproject.toml:\n" + "\n".join(missing)


def test_wheel_ships_recipes_templates_and_license(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("relax_rl-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("recipes", "templates"):
        for path in (REPO / folder).rglob("*"):
            if path.is_file():
                assert f"relax_core/_assets/{folder}/{path.relative_to(REPO / folder)}" in names
    assert "relax_core/_assets/recipes/quickstart.yaml" in names
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    assert f"{dist_info}/licenses/LICENSE" in names
    wheel_metadata = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in wheel_metadata.splitlines()

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = "from relax_core.assets import asset_dir; print(asset_dir('recipes'))"
    found = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(target)}, cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(found) == target / "relax_core" / "_assets" / "recipes"
    assert (Path(found) / "quickstart.yaml").is_file()
