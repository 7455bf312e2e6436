"""The wheel a user installs carries the recipes and templates, and finds them."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_ships_recipes_and_templates(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("relax_rl-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("recipes", "templates"):
        for path in (REPO / folder).rglob("*"):
            if path.is_file():
                assert f"relax_core/_assets/{folder}/{path.relative_to(REPO / folder)}" in names
    assert "relax_core/_assets/recipes/quickstart.yaml" in names

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = "from relax_core.assets import asset_dir; print(asset_dir('recipes'))"
    found = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(target)}, cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(found) == target / "relax_core" / "_assets" / "recipes"
    assert (Path(found) / "quickstart.yaml").is_file()
